"""Layouts for a model on a GPU cluster, ranked by estimated step time among those that fit.

For every mesh (data x fsdp x tensor x stage over the GPUs), pipeline schedule, microbatch count
and remat policy that the config's checks accept, the planner takes the dry run's memory
estimate (jaxtron.plan.memory: what `--dry-run` prints, held within 15% of compiled peaks) and
estimates one step's time as

    step = compute / (1 - bubble) + exposed communication + per-message latency

- compute: the matmuls with those the remat policy recomputes (costs.expected_matmul: what
  the compiled programs do, within 0.1%) and attention's kernels as the compiled programs count
  them (costs.expected_attention) per GPU, at ACHIEVABLE_TFLOPS; with model.fp8 the layers'
  projections FP8_SPEEDUP times faster.
- bubble: the pipeline's idle share (Pipeline.bubble), (S-1) / (M*R + S-1) for S stages, M
  microbatches per pass, R repeats (circular, interleaved_1f1b) on every schedule but zb_h1
  (jaxtron.parallel.pipeline), whose warm-up leaves its weight gradients for later: 2/3 of that
  idle time. 1F1B changes the memory (parallel/one_f_one_b.py), not the bubble; `1f1b` runs
  the LM head and loss on the last stage (parallel/half_ticks.py), S-1 more shares of their
  time than the schedules that share them out (`last_stage_loss`).
- communication, per collective, bytes on the wire per GPU over the axis's link (NVLink inside a
  node, the inter-node network across; parallel.crossing_axes says which), by nccl-tests' bus
  bandwidth definitions:
  - tensor: sequence parallelism's all-gather and reduce-scatter of each layer's activations,
    4 per layer per pass (forward, backward, and the recomputed forward with remat); exposed,
    unless model.collective_matmul hides all but 1/tensor of it behind the matmuls.
  - fsdp: without a pipeline, each layer's weights all-gathered for the forward and backward and
    their gradients reduce-scattered, every microbatch; with one, the stage's weights gathered
    once per pass and their gradients reduce-scattered every iteration. XLA's scheduler overlaps
    them with compute, so only what exceeds the compute is exposed. With model.fp8 the weights
    travel in FP8 (one byte), their gradients in bf16. Of a mixture of experts, the attention
    weights are sharded over fsdp x expert and each device's num_experts / |expert| experts over
    fsdp (the router is small). model.weights_ahead gathers the dense weights
    once per microbatch, a layer ahead beside the layer before, and keeps them for the backward.
  - data: the gradients' all-reduce, once per step, exposed.
  - stage: each microbatch's activations between neighbouring stages, forward and backward;
    under 1F1B each tick also moves four microbatches' worth over the stages (stage 0's input
    and the loss's gradient gathered from their pieces, the last stage's output and stage 0's
    input gradient scattered).
  - context (context parallelism, sequences of LONG_CONTEXT positions or more): each layer's
    K and V all-gathered over it in the forward and backward and their gradients
    reduce-scattered, overlapped like fsdp's; its weights' ZeRO-3 gathers count with fsdp's.
  - expert (a mixture of experts): the expert ring's permutes, each layer's tokens and partial
    outputs passed |expert| times in the forward, the tokens with their gradients in the backward;
    mostly hidden behind the experts' kernels (the compiled presets: 84% and 95%).
- latency: LATENCY_S per collective message and per pipeline iteration, which penalises many
  small steps (tiny microbatches, deep pipelines, many layers per step).

A layout fits where its estimate leaves autofit.SPARE (10%) of the usable memory free, as
model.remat=auto asks of its choice. The constants are below, each with its source; they are
estimates for ranking layouts against each other, not predictions of absolute speed.
`jaxtron plan --verify` compiles the best layouts for the real GPU topology and times them
again from their programs (`compiled_step`): the compiled matmul and attention FLOPs, and the
collective bytes per axis that no matmul hides.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass

from jaxtron import parallel
from jaxtron.config import Config, ConfigError, MeshConfig, PipelineConfig
from jaxtron.ops import ahead
from jaxtron.parallel import pipeline
from jaxtron.parallel.pipeline import SCHEDULES
from jaxtron.plan import costs, memory
from jaxtron.plan.autofit import SPARE
from jaxtron.plan.setup import set_up

# Dense bf16 TFLOP/s a large LLM training step achieves per GPU: ~45% of the H100 SXM's 989
# (NVIDIA H100 datasheet), the MFU Megatron-LM and MaxText report for 70B-class Llama training on
# H100 clusters. H200: the same compute.
ACHIEVABLE_TFLOPS = {"h100": 450.0, "h200": 450.0}
# Bus bandwidth per GPU (GB/s, nccl-tests' definition) that large NCCL collectives reach.
# NVLink 4 gives 450 GB/s per direction per GPU; nccl-tests all-reduce on a DGX H100 reaches about
# 360-480 GB/s bus bandwidth (with NVLink SHARP). Across nodes, 8 x 400 Gb/s InfiniBand NICs per
# node give 50 GB/s per GPU per direction; multi-node nccl-tests reach about 40-45 GB/s per GPU.
NVLINK_GBPS = 360.0
NETWORK_GBPS = 40.0
# Fixed cost per collective message or pipeline iteration (s): NCCL's small-message latency is
# 10-30 us in nccl-tests; kernel launches and the stage hand-off add to it.
LATENCY_S = 25e-6
# The share of each axis's collective bytes that XLA schedules with a matmul between start and
# done, as the `--compile-for h100` report counts it ("overlapped"): llama3_8b, fsdp=8, seq 8192
# (`--devices 8 train.batch_size=8 mesh.fsdp=8`): 36.7 of 42.9 GiB over fsdp; llama3_70b_pp8
# under gpipe with full recompute (`--devices 128`): 955 of 2309 GiB over tensor. The rest is
# taken as exposed.
FSDP_OVERLAP = 0.85
# Context parallelism is planned for sequences this long and longer (shorter ones fit a GPU's
# attention as they are; the planner then keeps to the other axes)
LONG_CONTEXT = 16384
TENSOR_OVERLAP = 0.4
# The expert ring's permutes hidden behind the experts' kernels: 84% and 95% of the bytes in the
# compiled mixtral_8x7b and qwen3_30b_a3b presets, jax 0.10.2 (docs/performance.md, "The expert
# ring beside its kernels"); the smaller taken.
EXPERT_OVERLAP = 0.84
# model.weights_ahead's gathers of each layer's dense weights, a layer ahead: 97% of their bytes
# overlapped in the compiled mixtral_8x7b preset (jax 0.10.2, docs/performance.md)
AHEAD_OVERLAP = 0.97
# How much faster the layers' projections run as FP8 GEMMs (model.fp8) than in bf16, all told
# (quantizing included). TorchTitan's Llama-3.1 8B on 8 H100s goes from 6,667 to 8,532 tokens/s
# with Float8 (1.28x); with those projections some 70% of its step, that is 1.46x on them. The
# FP8 peak is 2x; scaling and the e4m3/e5m2 casts take the rest.
FP8_SPEEDUP = 1.46


# One part of Layout.name: a mesh axis and its size (TP tensor, PP stage, EP expert, CP context,
# FSDP, DP data), the pipeline schedule and its repeats (R), microbatches (M), the remat policy,
# a whole gradient sum. `jaxtron plan --find` accepts these.
NAME_PART = (r"(TP|PP|R|EP|CP|FSDP|DP|M)\d+|" + "|".join(SCHEDULES)
             + r"|remat=\w+|grad_sum=whole")


@dataclass(frozen=True)
class Layout:
    """One candidate: its settings, its estimates, and what the estimates are made of."""

    mesh: dict[str, int]
    schedule: str
    repeats: int
    microbatches: int
    remat: str
    grad_sum: str  # pipeline.grad_sum
    peak_bytes: int
    fits: bool  # leaves SPARE of the usable memory free, as model.remat=auto's choice does
    step_seconds: float
    parts: dict[str, float]  # seconds: compute, bubble, tensor, fsdp, data, stage, expert, latency
    crossing: tuple[str, ...] = ()  # the mesh axes whose groups span nodes

    def name(self) -> str:
        """The parts of the layout that differ between layouts, e.g. `TP8 PP2 gpipe EP2 FSDP4
        DP1 M8 remat=full`; NAME_PART matches each (what `jaxtron plan --find` accepts)."""
        m = self.mesh
        pipe = (f" PP{m['stage']} {self.schedule}" + (f" R{self.repeats}" if self.repeats > 1
                                                      else "")) if m["stage"] > 1 else ""
        whole = " grad_sum=whole" if self.grad_sum == "whole" else ""
        ep = f" EP{m['expert']}" if m.get("expert", 1) > 1 else ""
        ep += f" CP{m['context']}" if m.get("context", 1) > 1 else ""
        return (f"TP{m['tensor']}{pipe}{ep} FSDP{m['fsdp']} DP{m['data']} M{self.microbatches} "
                f"remat={self.remat}{whole}")

    def overrides(self) -> str:
        """The config overrides that run this layout."""
        m = self.mesh
        out = [f"mesh.{axis}={m.get(axis, 1)}" for axis in parallel.MESH_AXES
               if axis not in parallel.OPTIONAL_AXES or m.get(axis, 1) > 1]
        if m["stage"] > 1:
            out += [f"pipeline.schedule={self.schedule}", f"pipeline.repeats={self.repeats}",
                    f"pipeline.grad_sum={self.grad_sum}"]
        return " ".join(out + [f"model.remat={self.remat}",
                               f"train.microbatches={self.microbatches}"])

    def as_json(self) -> dict:
        return {"mesh": self.mesh, "schedule": self.schedule if self.mesh["stage"] > 1 else "none",
                "repeats": self.repeats, "microbatches": self.microbatches, "remat": self.remat,
                "grad_sum": self.grad_sum,
                "step_seconds": round(self.step_seconds, 4), "peak_bytes": self.peak_bytes,
                "fits": self.fits, "parts": {k: round(v, 4) for k, v in self.parts.items()},
                "crossing": list(self.crossing)}


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _contexts(cfg: Config, tensor: int, rest: int) -> list[int]:
    """Context sizes to try: for a dense model's sequences of LONG_CONTEXT positions or more,
    those dividing `rest` GPUs that split them into 2 * context * tensor pieces."""
    t = cfg.train.seq_len
    if cfg.model.moe.num_experts or t < LONG_CONTEXT:
        return [1]
    return [c for c in _divisors(rest) if t % (2 * c * tensor) == 0]


def meshes(cfg: Config, gpus: int, per_node: int) -> list[dict[str, int]]:
    """Meshes over `gpus`: tensor within a node and dividing the heads, stages dividing the
    layers they split (ModelConfig.staged_layers), fsdp and data the rest; for a mixture of
    experts, expert within a node beside tensor and dividing the experts, and no stages (the
    pipelines run experts, but with stages tiny_moe's layouts on 8 GPUs went from 190 to 1345
    and its plan from 9 to 59 s, and none ranked in Mixtral 8x7B's top 6 on 16 H100s); for long
    sequences, context too (`_contexts`)."""
    m = cfg.model
    out = []
    for tensor in _divisors(min(per_node, gpus)):
        if m.num_kv_heads % tensor or m.num_heads % tensor:
            continue
        experts = [e for e in _divisors(min(per_node // tensor, gpus // tensor))
                   if m.moe.num_experts % e == 0] if m.moe.num_experts else [1]
        for expert, context in itertools.product(experts, _contexts(cfg, tensor, gpus // tensor)):
            rest = gpus // tensor // expert // context
            for stage in ([1] if m.moe.num_experts else _divisors(rest)):
                if m.staged_layers % stage or stage > m.staged_layers:
                    continue
                for fsdp in _divisors(rest // stage):
                    mesh = {"data": rest // stage // fsdp, "stage": stage, "fsdp": fsdp,
                            "context": context, "expert": expert, "tensor": tensor}
                    out.append({k: v for k, v in mesh.items()
                                if k not in parallel.OPTIONAL_AXES or v > 1})
    return out


def variants(cfg: Config, mesh: dict[str, int], remats: list[str]):
    """(schedule, repeats, microbatches, remat, grad_sum) to try for one mesh."""
    replicas = mesh["data"] * mesh["fsdp"] * mesh.get("expert", 1)
    if cfg.train.batch_size % replicas:
        return
    rows = cfg.train.batch_size // replicas  # sequences per data replica per step
    counts = [c for c in _divisors(rows) if c & (c - 1) == 0 or c == rows]
    schedules = [("gpipe", 1)]
    if mesh["stage"] > 1:
        per_stage = cfg.model.staged_layers // mesh["stage"]
        repeated = [r for r in (2, 4, 5, 8, 10) if per_stage % r == 0]
        schedules += [("circular", r) for r in repeated]
        if not cfg.model.mtp_depth:  # the 1F1B ticks run no multi-token prediction
            schedules += [("1f1b", 1)]
            if cfg.model.weight_grads_apart(mesh["tensor"]):
                schedules += [("zb_h1", 1)]
            # R = 1: the whole ticks, 2S - 1 microbatches alive and the loss shared out
            schedules += [("interleaved_1f1b", r) for r in [1, *repeated]]
    sums = ["sharded", "whole"] if mesh["stage"] > 1 and mesh["fsdp"] > 1 else ["sharded"]
    for (schedule, repeats), micro, remat, grad_sum in itertools.product(schedules, counts, remats,
                                                                         sums):
        # without a pipeline, microbatches only trade speed for memory; a mixture of experts'
        # buffers grow with the rows of a microbatch, down to one sequence per GPU
        if mesh["stage"] == 1 and (schedule != "gpipe"
                                   or micro > (rows if cfg.model.moe.num_experts else 8)):
            continue
        yield schedule, repeats, micro, remat, grad_sum


def configure(cfg: Config, mesh: dict[str, int], schedule: str, repeats: int, micro: int,
              remat: str, grad_sum: str = "sharded") -> Config:
    """cfg with one layout's settings."""
    return dataclasses.replace(
        cfg, mesh=MeshConfig(**mesh),
        model=dataclasses.replace(cfg.model, remat=remat),
        pipeline=PipelineConfig(schedule=schedule, repeats=repeats, passes=1, grad_sum=grad_sum),
        train=dataclasses.replace(cfg.train, microbatches=micro))


def _layer_weights(m, ep: int) -> tuple[float, float]:
    """(a layer's dense matmul weights: attention (latent attention's projections), and the
    MLP, or the router and shared experts; the weights of the experts one device holds of it,
    num_experts / ep of them), as counts of parameters. Of DeepSeek's, an MoE layer's."""
    w = memory.layer_weights(m)
    attention = w["q"] + w["k"] + w["v"] + w["o"]
    d = m.d_model
    if not m.moe.num_experts:
        return attention + 3 * d * m.mlp_dim, 0.0
    width = m.moe.mlp_dim or m.mlp_dim
    shared = 3 * d * width * m.moe.shared_experts
    return attention + d * m.moe.num_experts + shared, m.moe.num_experts / ep * 3 * d * width


def _seconds(nbytes: float, crosses: bool) -> float:
    return nbytes / (1e9 * (NETWORK_GBPS if crosses else NVLINK_GBPS))


def step_time(cfg: Config, mesh: dict[str, int], per_node: int, gpu: str) -> dict[str, float]:
    """The parts of one step's estimated time (module docstring), in seconds."""
    m, t = cfg.model, cfg.train
    gpus = math.prod(mesh.values())
    crossing = set(parallel.crossing_axes(mesh, per_node))
    tokens = t.batch_size * t.seq_len
    work = (costs.expected_matmul(cfg, tokens / gpus, mesh_tensor=mesh["tensor"])
            + costs.expected_attention(cfg, tokens / gpus))
    if m.fp8 != "none":  # the projections' share (all but the LM head and attention) in FP8
        head = 6 * m.d_model * m.vocab_size * tokens / gpus
        projections = costs.expected_matmul(cfg, tokens / gpus) - head
        work -= projections * (1 - 1 / FP8_SPEEDUP)
    compute = work / (ACHIEVABLE_TFLOPS[gpu] * 1e12)
    stages, tp = mesh["stage"], mesh["tensor"]
    pipe = pipeline.from_config(cfg, stages)
    iterations = pipe.iterations if pipe else t.microbatches  # 1F1B: ticks, forward + backward
    # idle against busy time: (S-1)/(M*R) of the compute, zb_h1's 2/3 of that (Pipeline.bubble)
    bubble = compute * pipe.bubble / (1 - pipe.bubble) if pipe else 0.0
    # layers each GPU runs per sequence: its stage's, and those every stage runs whole
    layers = m.staged_layers // stages + m.num_layers - m.staged_layers
    ep, cp = mesh.get("expert", 1), mesh.get("context", 1)
    seqs = t.batch_size // (mesh["data"] * mesh["fsdp"] * ep)  # sequences per GPU per step
    passes = 3 if costs.RECOMPUTED[m.remat] else 2  # the recomputed forward gathers again
    act = 2  # bf16 activations and gathered weights
    parts = {"compute": compute, "bubble": bubble}
    slab = t.seq_len // cp * m.d_model * act  # one sequence's [T, D] activations on a GPU
    tensor_bytes = 4 * passes * layers * seqs * slab * (tp - 1) / tp
    tensor_time = _seconds(tensor_bytes, "tensor" in crossing)
    parts["tensor"] = tensor_time / tp if m.collective_matmul else tensor_time * (
        1 - TENSOR_OVERLAP)
    dense, local_experts = _layer_weights(m, ep)
    f = mesh["fsdp"] * cp  # ZeRO-3 over fsdp and context; a layer's dense weights over expert too
    # Without a pipeline each microbatch gathers a layer's weights twice (forward, recompute or
    # backward) and reduce-scatters its gradient; a pipeline gathers a stage's weights once per
    # pass and reduce-scatters their gradient every iteration, or (grad_sum=whole) once, in
    # float32: twice the bytes of a compute-dtype gather. model.weights_ahead gathers the dense
    # weights once per microbatch, beside the layer before (`AHEAD_OVERLAP`).
    runs = iterations if stages > 1 else t.microbatches  # layer runs per sequence group
    whole = cfg.pipeline.grad_sum == "whole"
    fsdp_uses = (3 if whole else 1 + iterations) if stages > 1 else 3 * t.microbatches
    gathers = 1 if stages > 1 else 2 * t.microbatches
    units = fsdp_uses - (gathers / 2 if m.fp8 != "none" else 0)  # FP8 gathers: half a unit
    fetched = ahead.applies(m, mesh) and stages == 1
    g = f * ep  # the dense weights' group
    dense_uses = 2 * t.microbatches if fetched else units
    crosses = bool({"fsdp", "context"} & crossing)
    dense_time = _seconds(dense_uses * layers * dense / tp * act * (g - 1) / g,
                          crosses or "expert" in crossing)
    fsdp_time = _seconds(units * layers * local_experts / tp * act * (f - 1) / f, crosses)
    hidden = (AHEAD_OVERLAP if fetched else FSDP_OVERLAP) * dense_time + FSDP_OVERLAP * fsdp_time
    parts["fsdp"] = dense_time + fsdp_time - hidden + max(0.0, hidden - compute)
    d = mesh["data"]
    held = m.num_layers * (dense / ep + local_experts) + m.d_model * m.vocab_size
    grads = held * 4 / (tp * stages * f)  # float32 gradients per GPU
    parts["data"] = _seconds(2 * grads * (d - 1) / d, "data" in crossing)
    # a microbatch forward and one backward per iteration; 1F1B's ticks also gather stage 0's
    # input and the loss's output gradient from their pieces and scatter the last stage's
    # output and stage 0's input gradient: four (S-1)/S of a microbatch (parallel/one_f_one_b.py).
    # 1f1b's half ticks swap an activation or its gradient and a microbatch's worth of input
    # pieces each way, twice per iteration (parallel/half_ticks.py).
    per_tick = 2 + (4 * (stages - 1) / stages if pipe and pipe.explicit else 0)
    if pipe and pipe.schedule == "1f1b":
        per_tick = 4
        # the last stage runs every microbatch's LM head and loss, which the other schedules
        # share out over the stages: S-1 more shares of it on the step's path
        head = 6 * m.d_model * m.vocab_size * tokens / gpus / (ACHIEVABLE_TFLOPS[gpu] * 1e12)
        parts["last_stage_loss"] = head * (stages - 1)
    stage_bytes = per_tick * iterations * seqs / t.microbatches * slab / tp if pipe else 0.0
    parts["stage"] = _seconds(stage_bytes, "stage" in crossing)
    # context: each layer's K and V gathered forward and backward, their gradients scattered
    kv_bytes = 3 * passes / 2 * layers * seqs * t.seq_len * 2 * m.num_kv_heads * m.head_size \
        // tp * act * (cp - 1) / cp
    context_time = _seconds(kv_bytes, "context" in crossing)
    parts["context"] = context_time * (1 - FSDP_OVERLAP) + max(
        0.0, context_time * FSDP_OVERLAP - compute)
    # the expert ring (ops/experts.py): forward, a layer's tokens passed |expert| - 1 times and
    # the partial sums |expert| times; backward, the tokens with their outputs' gradient passed
    # |expert| - 1 times and the tokens' gradient |expert| times. The compiled presets: 37
    # slabs per layer and sequence at |expert| = 8.
    expert_bytes = (5 * ep - 3) * layers * seqs * slab if ep > 1 else 0.0
    parts["expert"] = _seconds(expert_bytes, "expert" in crossing) * (1 - EXPERT_OVERLAP)
    messages = (4 * passes * layers * runs * (tp > 1) + layers * fsdp_uses * (f > 1)
                + 3 * layers * runs * (cp > 1)
                + iterations * (stages > 1) * 2 + (d > 1))
    parts["latency"] = LATENCY_S * messages
    return parts


def evaluate(cfg: Config, gpus: int, per_node: int, gpu: str, usable: int,
             remats: list[str]) -> list[Layout]:
    """Every layout the config's checks accept, with its memory and time estimates. One fits
    where its estimated peak leaves SPARE of `usable` free: what model.remat=auto and
    train.microbatches=auto ask of their choice, so that the planner's best is one they keep."""
    budget = usable * (1 - SPARE)
    out = []
    for mesh in meshes(cfg, gpus, per_node):
        crossing = tuple(parallel.crossing_axes(mesh, per_node))
        for schedule, repeats, micro, remat, grad_sum in variants(cfg, mesh, remats):
            candidate = configure(cfg, mesh, schedule, repeats, micro, remat, grad_sum)
            try:  # a run's own set-up, for any machine (no kernel chosen, nothing `auto`)
                setup = set_up(candidate, gpus, None)
            except ConfigError:
                continue
            peak = sum(memory.estimate(candidate, setup.plan).values())
            parts = step_time(candidate, mesh, per_node, gpu)
            out.append(Layout(mesh, schedule, repeats, micro, remat, grad_sum, peak,
                              peak <= budget, sum(parts.values()), parts, crossing))
    return rank(out)


def rank(layouts: list[Layout]) -> list[Layout]:
    """Those that fit first, fastest first (of equal times, the fewer microbatches, then the
    smaller peak: the remat policy that recomputes what costs nothing); then those that do not,
    smallest peak first."""
    return sorted(layouts, key=lambda x: (not x.fits, x.step_seconds if x.fits else x.peak_bytes,
                                          x.microbatches, x.peak_bytes))


def why_slower(worse: Layout, better: Layout, usable: int) -> str:
    """One clause: the estimate's terms that cost `worse` the most against `better` (each term
    that adds at least a fifth of the largest, largest first)."""
    if not worse.fits:
        return (f"does not fit: {worse.peak_bytes / 2**30:.1f} GiB per GPU, over "
                f"{1 - SPARE:.0%} of the {usable / 2**30:.1f} GiB jax may use")
    deltas = {k: worse.parts[k] - better.parts.get(k, 0.0) for k in worse.parts}
    costs = sorted(((d, k) for k, d in deltas.items() if d > 0), reverse=True)
    top = costs[0][0] if costs else 0.0
    terms = ", ".join(
        f"{k} {duration(worse.parts[k])} against {duration(better.parts.get(k, 0.0))}"
        for d, k in costs[:3] if d >= top / 5)
    return (f"+{duration(worse.step_seconds - better.step_seconds)} per step, mostly "
            f"{terms or 'rounding'}")


def compiled_step(layout: Layout, report: dict, gpu: str) -> dict[str, float]:
    """The parts of the layout's step time again, from what its compiled program does (an
    `aot.report`): compute from the program's matmul and attention FLOPs; for each set of mesh
    axes, the collective bytes no matmul hides (the report's exposed bytes) over NVLink, or over
    the network where one of the axes spans nodes; the bubble scaled with the compute, and the
    latency as estimated."""
    counted = report["flops"]
    work = counted["matmul_per_device"] + counted["attention_per_device"]
    compute = work / (ACHIEVABLE_TFLOPS[gpu] * 1e12)
    estimated = layout.parts["compute"]
    parts = {"compute": compute,
             "bubble": layout.parts["bubble"] * compute / estimated if estimated else 0.0}
    for axes, nbytes in report["exposed_bytes_per_axis"].items():
        parts[axes] = _seconds(nbytes, bool(set(axes.split("+")) & set(layout.crossing)))
    parts["latency"] = layout.parts["latency"]
    return parts


def duration(seconds: float) -> str:
    """Three significant digits in s, ms or us: a small model's step is not "0.00 s"."""
    if abs(seconds) >= 100:
        return f"{seconds:.0f} s"
    scale, unit = next(((scale, unit) for scale, unit in ((1.0, "s"), (1e-3, "ms"))
                        if abs(seconds) >= scale), (1e-6, "us"))
    return f"{seconds / scale:.3g} {unit}"
