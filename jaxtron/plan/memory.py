"""The per-device memory of a train step on GPUs, estimated from the plan alone (nothing compiled).

The state, the gradients and the activations saved for the backward are alive through the whole
backward; on top of them come, one after the other, the LM head and loss (forward and backward),
each layer's backward and the embedding's backward, and the largest of these sets the peak. The
terms, per device (b rows per device per microbatch, T the sequence, t = mesh.tensor):

  params, opt_state     the state as sharded (plan.bytes_per_device)
  grads                 the gradients, in the parameters' dtype and sharding
  transposed_weights    fsdp without a pipeline: a float32 copy of the W_o and W_down shards,
                        transposed so that their gather runs on a major dimension; a mixture
                        of experts with several experts per device: its W_down's
  grad_accumulation     microbatches: the running sum and this microbatch's stacked gradients
                        (2x params) and the tables' float32 gradients summed whole
  saved_activations     what autodiff keeps per layer run, by remat policy and attention kernel
                        (with a pipeline, every iteration's layers)
  weights_ahead         model.weights_ahead: every layer's projection weights gathered in the
                        compute dtype, kept for the backward (attention's; a dense layer's MLP too)
  pipeline_buffers      the output buffer [M, b, T/t, D], the inputs spread over the stages
                        [M/S, b, T/t, D], and the moving state
  pipeline_weight_grads the float32 gradients of the stage weights: the running sum and this
                        iteration's (pipeline.grad_sum=whole: the sum whole over fsdp, and this
                        iteration's in the compute dtype)
  pipeline_gathered_weights the stage's weights whole over fsdp in the compute dtype, gathered
                        once per pass and kept through its iterations, forward and backward
  layer_backward        attention's working set (cuDNN: the [b, 1, T, S] mask; XLA: float32
                        scores, their gradient, bf16 probabilities: 11-15 bytes per score), two
                        layers' gathered weights, sequence parallelism's full-sequence [b, T, D]
                        and [b, T, F/t] buffers (t > 1), and the head's bf16 gradient with the
                        loss's last chunk of logit gradients, which XLA consumes late; a
                        mixture of experts' ring step buffers (`_experts_bytes`)
  lm_head_and_loss      the loss chunks [b, chunk, V/t]: two chunks' float32 logits in the
                        forward (before any gradient exists), and in the backward one chunk's
                        float32 logits with the bf16 logit gradients of every chunk (t = 1) or of
                        two (t > 1), the head and its gradient in bf16
  embedding_backward    at the end, once the saved activations are gone: the embedding's float32
                        gradient [V/t, D] twice and the head's bf16 gradient
  workspace             cuBLAS / cuDNN scratch and small buffers

`model.attention=auto` is taken as it resolves on GPUs (cuDNN, inside pipeline stages too; XLA in
float32). The coefficients are read off XLA's buffer assignment for H100 (`jaxtron train
--compile-for h100`, `--xla_dump_to`); `tests/test_aot.py` compiles layouts of small and large
models and holds the sum within 15% of the compiled peak, so a change to the step that moves the
peak shows there.
"""

from __future__ import annotations

import ctypes
import math
import os

import jax
import jax.numpy as jnp

from jaxtron import parallel
from jaxtron.config import Config, ConfigError
from jaxtron.model import windows
from jaxtron.ops import ahead, attention
from jaxtron.ops.vocab import chunks as loss_chunks
from jaxtron.parallel import one_f_one_b, pipeline

WORKSPACE = 16 * 2**20  # cuBLAS / cuDNN scratch and small buffers: what a tiny model's step holds
# Context parallelism's K and V per key position (of one kv head's H): gathered (2 x 2 bytes),
# natural and padded (2 x 2T: 8), the prefix windows (2 x 1.5T: 6), and the float32 gradients
# of the padded ones with their scatter's temporaries (2 x 2 x 2T x 4: 32)
CONTEXT_KV = 50


def _rows(cfg: Config, sizes: dict[str, int], axes: tuple[str, ...]) -> int:
    """Sequences per device per microbatch when the batch is split over `axes`."""
    ways = 1
    for axis in axes:
        ways *= sizes.get(axis, 1)
    return max(cfg.train.batch_size // cfg.train.microbatches // ways, 1)


def estimate(cfg: Config, plan) -> dict[str, int]:
    """Bytes per device of every large term of the step on GPUs (see the module docstring)."""
    m, sizes = cfg.model, plan.mesh_sizes
    tp, stages = sizes["tensor"], sizes["stage"]
    kernel = attention.kernel_of(m, "gpu")
    act = jnp.dtype(m.dtype).itemsize
    params = plan.bytes_per_device("params")
    b = _rows(cfg, sizes, ("data", "fsdp", "expert"))
    seq, d, v = _local_seq(cfg, sizes), m.d_model, m.vocab_size
    weights_per_layer = (_attention_weights(m) + 3 * d * _mlp_width(cfg, sizes)) // tp
    slab = b * seq * d * act // tp  # one layer's input [b, T/t, D]
    tables = (1 if m.tie_embeddings else 2)
    many = math.prod(sizes.values()) > 1
    # The backward of a layer: attention's working set, two layers' gathered weights, and with
    # tensor > 1 sequence parallelism's full-sequence buffers: eight [b, T, D] (inputs gathered
    # over tensor, partial sums before their reduce-scatter) and four of the MLP's [b, T, F/t]
    # (8B TP8 FSDP8, 32 x 8192 rows: seven 2 GiB [b, T, D] and four 0.9 GiB [b, T, F/t] at
    # the peak).
    layer = (_attention_bytes(cfg, kernel, b, sizes) + 2 * weights_per_layer * act
             + (4 * b * seq * (2 * d + m.mlp_dim // tp) * act if tp > 1 else 0)
             + _experts_bytes(cfg, b, tp))
    head = _head_bytes(cfg, sizes)
    table = v * d // tp * act  # one [V/t, D] table in the compute dtype
    # Through the layers' backward XLA keeps the head's bf16 gradient and the loss's last chunk
    # of logit gradients [b, chunk, V/t], whose product into it comes late (1B TP4 FSDP2 and 8B
    # TP8 FSDP8: 1.0 GiB of them at the peak, in the layers' backward).
    layer += table + head["chunk"] // 2
    pipe = _pipeline_bytes(cfg, plan, slab)
    # The loss's forward comes before any gradient exists, and with a pipeline its backward too:
    # the stage weights' gradients are summed in the pipeline's backward loop, which follows it
    # (8B PP2 FSDP8: 1 GiB logit gradients x 4 chunks, the head and its gradient whole over
    # stage and fsdp, beside the saved activations and gathered weights, no gradient).
    grads = params + pipe["pipeline_weight_grads"]
    head_peak = max(head["backward"] - (grads if stages > 1 else 0), head["forward"] - grads)
    # Last, the embedding's backward, once the saved activations are gone: its float32 gradient
    # [V/t, D] summed whole, twice (the zeros and the scatter-add's result), beside the head's
    # bf16 gradient (8B TP2 FSDP32, one row per GPU: 2 x 1002 + 501 MiB at the peak, the end).
    saved = _layer_runs(cfg, sizes) * _saved_per_layer(cfg, kernel, b, tp, slab, many, seq)
    if m.remat == "none" and _one_f_one_b(cfg, sizes):
        # The ring of slots holds every residual leaf of the stage's jax.vjp, which XLA
        # cannot fuse away or recompute as in autodiff's own backward: read off
        # llama3_70b_pp8 under 1f1b (M256, 98.1 GiB compiled against 63.9 counted without it)
        saved *= 2
    embed_peak = 2 * 4 * v * d // tp + table - saved
    phases = {"layer_backward": layer, "lm_head_and_loss": head_peak,
              "embedding_backward": embed_peak}
    last = max(phases, key=phases.get)
    return {
        "params": params,
        "opt_state": plan.bytes_per_device("opt_state"),
        # With accumulation a mixture of experts' gradients are the running sum's last value, no
        # copy of their own (Mixtral 8x7B on 16 H100s, 16 microbatches: 30.1 GiB of temporaries
        # against 37.6 estimated with one)
        "grads": 0 if m.moe.num_experts and plan.accumulation > 1 else params,
        "transposed_weights": _transposed_weights(plan, cfg) if stages == 1 else 0,
        # microbatches: the running sum and this microbatch's stacked gradients, and the float32
        # gradients of the embedding and head tables summed whole
        "grad_accumulation": (2 * params + 4 * tables * v * d // tp
                              if plan.accumulation > 1 else 0),
        "saved_activations": saved,
        "zero_bubble_queue": _zero_bubble_queue(cfg, sizes, b, seq),
        "weights_ahead": _ahead_bytes(cfg, sizes),
        **pipe,
        # The layers' backward, the LM head's and the embedding's come one after the other: the
        # largest counts.
        **{name: max(size, 0) if name == last else 0 for name, size in phases.items()},
        "workspace": WORKSPACE,
    }


def _local_seq(cfg: Config, sizes: dict[str, int]) -> int:
    """The positions of each sequence one device computes on: all of them, or under context
    parallelism its context rank's share."""
    return cfg.train.seq_len // sizes.get("context", 1)


def layer_weights(m, experts: bool | None = None) -> dict[str, int]:
    """The weights of one layer's projections, by name; of a mixture of experts, those a token
    runs (its experts_per_token experts', the shared experts' and the router). Latent attention
    (model.mla): q its query projections, k the compression of keys and values, v their up
    projection. `experts`: a MoE layer (None: when the model has experts)."""
    d, n, k, h, f = m.d_model, m.num_heads, m.num_kv_heads, m.head_size, m.mlp_dim
    experts = bool(m.moe.num_experts) if experts is None else experts
    if experts:
        f = (m.moe.mlp_dim or m.mlp_dim) * (m.moe.experts_per_token + m.moe.shared_experts)
    w = {"q": d * n * h, "k": d * k * h, "v": d * k * h, "o": n * h * d,
         "gate": d * f, "up": d * f, "down": f * d,
         "router": d * m.moe.num_experts if experts else 0}
    a = m.mla
    if a.kv_lora_rank:
        qk = a.qk_nope_head_dim + a.qk_rope_head_dim
        w |= {"q": (d * a.q_lora_rank + a.q_lora_rank * n * qk) if a.q_lora_rank else d * n * qk,
              "k": d * (a.kv_lora_rank + a.qk_rope_head_dim),
              "v": a.kv_lora_rank * n * (a.qk_nope_head_dim + a.v_head_dim),
              "o": n * a.v_head_dim * d}
    return w


def _attention_weights(m) -> int:
    """One layer's attention weights: q, k, v and o, or latent attention's projections."""
    if m.mla.kv_lora_rank:
        return sum(layer_weights(m, experts=False)[name] for name in "qkvo")
    return 2 * m.d_model * m.num_heads * m.head_size + 2 * m.d_model * m.num_kv_heads * m.head_size


def _head_sizes(m) -> tuple[int, int]:
    """(a query's size, a key's and value's together) per token over all heads."""
    if m.mla.kv_lora_rank:
        qk = m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim
        return m.num_heads * qk, m.num_heads * (qk + m.mla.v_head_dim)
    return m.num_heads * m.head_size, 2 * m.num_kv_heads * m.head_size


def _mlp_width(cfg: Config, sizes: dict[str, int]) -> int:
    """The MLP width one device gathers per layer: mlp_dim, or its experts' widths together."""
    m = cfg.model
    if not m.moe.num_experts:
        return m.mlp_dim
    return (m.moe.mlp_dim or m.mlp_dim) * m.moe.num_experts // sizes.get("expert", 1)


def _experts_bytes(cfg: Config, b: int, tp: int) -> int:
    """A mixture of experts' working set in a layer's backward: one ring step's sorted rows
    (b * T * k of them), six buffers of [rows, D + F/t] in the compute dtype (inputs, outputs,
    the hidden activations and their gradients; jaxtron/model/moe.py). Read off the compiled
    Mixtral 8x7B (16 H100s) and Qwen3-30B-A3B (8) presets."""
    m = cfg.model
    if not m.moe.num_experts:
        return 0
    rows = b * cfg.train.seq_len * m.moe.experts_per_token
    return 6 * rows * (m.d_model + (m.moe.mlp_dim or m.mlp_dim) // tp) \
        * jnp.dtype(m.dtype).itemsize


def _transposed_weights(plan, cfg: Config) -> int:
    """The output projections W_o[N, H, D_fsdp] and W_down[F, D_fsdp], split on their last
    dimension: XLA keeps a transposed float32 copy of this device's shards through the step, so
    that the fsdp gather runs on a major dimension (f32[D/fsdp, L, F] and f32[D/fsdp, L, N, H]
    in every layout without a pipeline: 1B, 7B, 8B and 70B, FSDP 2-32, TP 1-8)."""
    layers = plan.abstract["params"]["layers"]
    specs = plan.specs["params"]["layers"]
    sizes, experts = plan.mesh_sizes, cfg.model.moe.num_experts
    zero = sizes["fsdp"] * sizes.get("context", 1)  # the ways W_o and W_down are split on D
    names = (("attn", "wo"), ("mlp", "w_down")) if zero > 1 and not experts else ()
    if experts:
        # The experts [E, D, F] need no copy to gather (E is split before D), but with more
        # than one expert per device XLA keeps W_down [E', D, F] transposed for the kernels'
        # [E', F, D] (Qwen3-30B-A3B on 8 H100s: f32[48, 16, 768, 2048], 4.5 GiB).
        names = ((("attn", "wo"),) if sizes["fsdp"] > 1 else ()) \
            + ((("mlp", "w_down"),) if experts > sizes.get("expert", 1) else ())
    return sum(parallel.bytes_per_device(layers[block][name], specs[block][name], plan.mesh_sizes)
               for block, name in names)


def _attention_bytes(cfg: Config, kernel: str, b: int, sizes: dict[str, int]) -> int:
    """One layer's attention working set in the backward. cuDNN: the [b, 1, T, S] mask and its
    float32 bias. XLA: float32 scores and their gradient, bf16 probabilities, the mask: 11 bytes
    per score, 15 where weights move every layer (the scheduler overlaps two layers).

    Under context parallelism (C ranks, T/C queries each against all T keys): XLA's scores are
    [T/C, T]; cuDNN's masks are the two pieces' diagonal blocks [T/2C, T/2C], and K and V come
    gathered, in natural order padded for the prefix windows, and as the windows themselves,
    with their float32 gradients: CONTEXT_KV bytes per key position and K/t * H of a row."""
    m, seq, tp = cfg.model, cfg.train.seq_len, sizes["tensor"]
    local = _local_seq(cfg, sizes)
    if kernel == "cudnn" and local < seq:
        piece = local // 2
        return 2 * b * piece * piece * 3 + CONTEXT_KV * b * seq * m.num_kv_heads // tp \
            * m.head_size
    if kernel == "cudnn":
        return 4 * b * seq * seq
    scores = b * m.num_heads * local * max(windows.scored_keys(m, seq)) // tp
    if m.remat == "none":  # the saved scores are the working set; only their gradient is new
        return 4 * scores
    return scores * (15 if sizes["fsdp"] * sizes.get("expert", 1) * tp * sizes["stage"] > 1 else 11)


def _head_bytes(cfg: Config, sizes: dict[str, int]) -> dict[str, int]:
    """The LM head and loss, per chunk of positions `c` ([b, c, V/t] logits; 1B on 16 H100s,
    TP2 FSDP8 and TP1 FSDP8 DP2, and on 8, FSDP8 with 2-8 chunks of 1024-2048 positions):

    - forward: the chunk loop (a scan) is double-buffered: two chunks' float32 logits, and the
      head gathered in the compute dtype;
    - backward: a chunk's float32 logits recomputed, the bf16 logit gradients of the chunks XLA
      holds at once, the gathered head and its bf16 gradient. The Python chunk loop's
      optimization barriers do not order it on GPUs: without collectives between the chunks
      (tensor=1) XLA computes every chunk's logit gradient before their products into the head's
      gradient (b x T x V x 2 bytes at once); with tensor > 1 the per-chunk collectives order
      the chunks, and two are alive at a time."""
    m, t, tp = cfg.model, cfg.train, sizes["tensor"]
    act = jnp.dtype(m.dtype).itemsize
    ways = sizes["data"] * sizes["fsdp"] * sizes.get("expert", 1) * sizes["stage"]
    rows = max(t.batch_size // (cfg.pipeline.passes if sizes["stage"] > 1 else t.microbatches)
               // ways, 1)
    local = _local_seq(cfg, sizes)
    chunks = loss_chunks(local, t.loss_chunk)
    logits = rows * (local // chunks) * m.vocab_size // tp * 4
    table = m.vocab_size * m.d_model // tp * act  # the head in the compute dtype, or its gradient
    held = chunks if tp == 1 else min(chunks, 2)
    if math.prod(sizes.values()) == 1:  # no mesh: the plain loss, one chunk's logits at a time
        return {"chunk": logits, "forward": logits, "backward": logits}
    return {"chunk": logits,
            "forward": (2 if chunks > 1 else 1) * logits + table,
            "backward": logits + held * logits * act // 4 + 2 * table}


def _saved_per_layer(cfg: Config, kernel: str, b: int, tp: int, slab: int, many: bool,
                     seq: int) -> int:
    """Bytes autodiff keeps per layer for the backward, by remat policy, for `seq` positions
    per sequence on a device. With the cuDNN kernel, XLA keeps more per layer where collectives
    run (`many` devices) than on one device: the numbers are read off compiled programs."""
    m = cfg.model
    act = jnp.dtype(m.dtype).itemsize
    q_width, kv_width = _head_sizes(m)
    q = b * seq * q_width * act // tp
    kv = b * seq * kv_width * act // tp
    mlp = b * seq * m.mlp_dim * act // tp
    if m.remat == "full":
        return slab
    if m.remat == "save_attn_out":
        return slab + q
    if m.remat == "save_qkv_out":
        return slab + 2 * q + kv
    # Collective matmuls (tensor > 1) keep no sequence chunks for the weight gradients: their
    # backward gathers them again under the policies that keep the matmuls' outputs
    # (collective_matmul.REGATHER; before, t-1 [b, T/t, D] per gather: compiled 8B TP8 8 x 8192
    # rows save_dots +14.0 GiB), and under the others the recomputed forward brings them.
    if m.remat in ("save_dots", "offload_dots"):  # the projections' and MLP's matmul outputs
        kept = q + kv + 2 * slab + 2 * mlp if kernel == "xla" or many else q + mlp
        if m.collective_matmul and tp > 1 and many:  # read off the compiled programs: three
            kept -= 3 * slab  # [b, T/t, D] fewer (8B TP8 8 x 8192 rows 38.7 GiB, the count
            # without this 45.3; llama3_70b_pp8 37.2 and 39.7)
        return slab if m.remat == "offload_dots" else slab + kept
    everything = 4 * slab + 3 * q + kv + 4 * mlp  # none: every intermediate
    if kernel == "cudnn":  # float32 norms and activations besides; no scores (softmax stats)
        return 3 * everything // 2 if many else 2 * everything
    # the XLA attention's float32 scores, bf16 probabilities and mask are kept too
    keys = sum(windows.scored_keys(m, cfg.train.seq_len)) // m.num_layers  # windows: fewer
    return everything + b * m.num_heads * seq * keys * (4 + act + 1) // tp


def _ahead_bytes(cfg: Config, sizes: dict[str, int]) -> int:
    """model.weights_ahead's gathered projection weights, one copy per layer (Mixtral 8x7B on
    16 H100s: its attention's, +2.5 GiB compiled as estimated)."""
    m = cfg.model
    if not ahead.applies(m, sizes) or sizes["stage"] > 1:
        return 0
    per_layer = _attention_weights(m) + (0 if m.moe.num_experts else 3 * m.d_model * m.mlp_dim)
    return m.num_layers * per_layer // sizes["tensor"] * jnp.dtype(m.dtype).itemsize


def _one_f_one_b(cfg: Config, sizes: dict[str, int]) -> bool:
    """Whether the layers run under a 1F1B schedule (a ring of slots)."""
    pipe = pipeline.from_config(cfg, sizes["stage"])
    return pipe is not None and pipe.explicit


def _layer_runs(cfg: Config, sizes: dict[str, int]) -> int:
    """Layer applications one device keeps activations of: its layers (and model.mtp_depth's
    modules, one layer each), or with a pipeline every iteration's L/(S*R) staged layers (all
    M*R + S - 1 iterations are alive at the backward's start; under 1F1B the items of the ring
    of slots: S under 1f1b, (R+1)*S - 1 under the whole ticks), and the layers outside the
    stages (model.moe.first_dense's, the modules) once."""
    m = cfg.model
    pipe = pipeline.from_config(cfg, sizes["stage"])
    if pipe is None:
        return m.num_layers + m.mtp_depth
    whole = m.num_layers - m.staged_layers + m.mtp_depth
    per_item = m.staged_layers // (pipe.stages * pipe.repeats)
    if pipe.explicit:  # 1F1B: the items alive in the ring of slots, whatever M
        slots = one_f_one_b.Ticks.of(pipe).slots
        return whole + slots * per_item
    return whole + pipe.iterations * per_item


def _zero_bubble_queue(cfg: Config, sizes: dict[str, int], b: int, seq: int) -> int:
    """zb_h1: what W reads of the S-1 backward-items whose weight gradients wait
    (one_f_one_b) and of the tick's own, per layer and position: the weight matmuls' inputs
    (both norms' outputs, whole over tensor as the matmuls gather them; the attention's output,
    the MLP's hidden) and their outputs' cotangents (q, k, v, the output projection, gate, up,
    down): 2D + (2D + 2Dq + 2Dkv + 3F) / tensor in the compute dtype. Against 1f1b's compiled
    peak: llama3_70b_pp8 without collective matmuls +21.5 GiB (19.2 here), llama3_8b PP4 x
    FSDP2 at 4096 positions +18.7 GiB (17.0 here)."""
    pipe = pipeline.from_config(cfg, sizes["stage"])
    if pipe is None or pipe.schedule != "zb_h1":
        return 0
    m, tp = cfg.model, sizes["tensor"]
    if not m.weight_grads_apart(tp):
        return 0
    w = layer_weights(m)
    width = 2 * m.d_model + (2 * m.d_model + 2 * w["q"] // m.d_model + 2 * w["k"] // m.d_model
                             + 3 * m.mlp_dim) // tp
    per_item = m.num_layers // pipe.stages * b * seq * width
    return pipe.stages * per_item * jnp.dtype(m.dtype).itemsize


def _pipeline_bytes(cfg: Config, plan, slab: int) -> dict[str, int]:
    """The stage buffers (the outputs [M, b, T/t, D], the inputs spread M/S per stage, the moving
    state), and the float32 gradients of the stage weights: each iteration's beside their running
    sum (reduced over `data` in every iteration, not once per step; measured as two copies of the
    stage's weights in the 70B preset's buffer assignment, gpipe and circular)."""
    pipe = pipeline.from_config(cfg, plan.mesh_sizes["stage"])
    if pipe is None:
        return {"pipeline_buffers": 0, "pipeline_weight_grads": 0, "pipeline_gathered_weights": 0}
    layers = parallel.bytes_per_device(plan.abstract["params"]["layers"],
                                       plan.specs["params"]["layers"], plan.mesh_sizes)
    spread = -(-pipe.microbatches // pipe.stages)  # the inputs, spread K per stage
    fsdp = plan.mesh_sizes["fsdp"]
    compute = jnp.dtype(cfg.model.dtype).itemsize / jnp.dtype(cfg.model.param_dtype).itemsize
    if pipe.grad_sum == "whole" and fsdp > 1:
        # The running float32 sum whole over fsdp, and this iteration's gradient of the whole
        # stage in the compute dtype (70B, TP8/PP2/FSDP8 on 128 H100s, M=16 and 64: 23.6 and
        # 25.8 GiB over the sharded sum's peak, against 1.5 x 16.3 GiB here).
        grads = layers * fsdp + int(layers * fsdp * compute)
    else:  # With passes (accumulation around the pipeline) the pass's sum is grad_accumulation's.
        grads = 2 * layers if plan.accumulation == 1 else 0
    # gpipe and circular: the outputs [M, ...], the inputs spread, the moving state; 1F1B: the
    # inputs and their gradients spread, and the tick's input, output, cotangent and sends
    buffers = (2 * spread + 6 if pipe.explicit else pipe.microbatches + 2 + spread) * slab
    return {"pipeline_buffers": buffers,
            "pipeline_weight_grads": grads,
            # the stage's weights gathered over fsdp once per pass, in the compute dtype
            "pipeline_gathered_weights": int(layers * fsdp * compute) if fsdp > 1 else 0}


# A CPU program against `estimate` (GPU buffer sizes), measured with the tiny preset at batch 8
# and 32 (2.1 and 5.1 GiB peak RSS for 0.84 and 3.0 GiB estimated): 1.37x the estimate plus a
# process of ~0.95 GiB, about 0.45 GiB more than the dry run's own before compiling.
HOST_FACTOR, HOST_COMPILE = 1.4, 0.45 * 2**30


def host_need(per_device: int, num_devices: int, process: int) -> float:
    """Bytes a step on `num_devices` CPU devices takes of this machine, with its process."""
    return HOST_FACTOR * per_device * num_devices + process + HOST_COMPILE


def check_host(plan, devices: list, cfg: Config) -> None:
    """On CPU devices, which share this machine's memory: the step as the dry run estimates it
    against the memory available here. A ConfigError, one line, instead of the out-of-memory
    killer ending the process without a word (the dry run's verdict says DOES NOT FIT then too)."""
    if devices[0].platform != "cpu" or not (available := available_host_bytes()):
        return
    local = len([d for d in devices if d.process_index == jax.process_index()])
    here = process_bytes()
    if (need := host_need(sum(estimate(cfg, plan).values()), local, here)) > available + here:
        raise ConfigError(
            f"this step needs about {need / 2**30:.1f} GiB of this machine's memory on "
            f"{local} CPU device{'s' if local > 1 else ''} and {(available + here) / 2**30:.1f} "
            "GiB is available (jaxtron train ... --dry-run shows the terms); lower "
            "train.batch_size or raise train.microbatches, run a smaller preset here "
            "(--config tiny), or size it for GPUs with jaxtron train --dry-run --devices N "
            "--gpu h100")


def available_host_bytes() -> int:
    """MemAvailable from /proc/meminfo (Linux); 0 where unknown."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return 0


# glibc's mallopt parameter for the number of heaps ("arenas") threads allocate from.
M_ARENA_MAX = -8
# Measured on a 120-save soak (tests/test_host_memory.py, one CPU device): glibc's default of up to
# 8 heaps per core, each keeping the freed pages of the save threads' host copies, held 1.15 GiB
# at save 20 and 1.22 GiB at save 110; with 2 heaps and freed pages returned after each save
# 0.81 and 0.79 GiB.
ARENAS = 2


def _glibc():
    """glibc through ctypes, or None (another C library: nothing to tune)."""
    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 - glibc only
        return libc
    except (OSError, AttributeError):
        return None


def limit_heaps() -> None:
    """Cap glibc's malloc heaps at ARENAS (MALLOC_ARENA_MAX, where set, is the user's choice)."""
    if (libc := _glibc()) is not None and "MALLOC_ARENA_MAX" not in os.environ:
        libc.mallopt(M_ARENA_MAX, ARENAS)


def release_freed() -> None:
    """Give the pages malloc holds free back to the OS (after a checkpoint save: its host copies
    are freed by then), so that resident memory stays flat over thousands of saves."""
    if (libc := _glibc()) is not None:
        libc.malloc_trim(0)


def process_bytes() -> int:
    """This process's resident memory (Linux); 0 where unknown."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0
