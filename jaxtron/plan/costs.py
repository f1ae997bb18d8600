"""What a step costs by formula: model FLOPs per token, the matmuls a remat policy implies, MFU
against a device peak table, and the row each logged step is (the training loop's and the
benchmarks' alike).

Model FLOPs per token, for training (forward + backward = 3x forward):
  6 * N_matmul                      N_matmul: every matmul weight incl. the LM head, not
                                    norms/biases
  + 6 * L * N * H * S               attention scores and weighted sum: 12*L*N*H*S, halved for causal
                                    (a windowed layer: its mean keys per query in place of S/2)
MFU = achieved model FLOP/s per device / the device's dense BF16 peak. Remat recomputation is not
counted (that would be hardware FLOPs), so MFU is comparable across remat policies. With
model.fp8 the same FLOPs are also given against the dense FP8 peak (`mfu_fp8`, twice the BF16 one
on Hopper): MFU stays comparable with BF16 runs and peers' BF16 numbers, `mfu_fp8` says how far
from the FP8 tensor cores' limit the run is (the LM head, attention and the elementwise work
still run in BF16, so it cannot reach 1 even in principle).

`expected_matmul` is what the remat policy implies for the matmuls: 6N per token (forward and
backward of every matmul weight), plus the forward that the policy recomputes in the backward (a
mixture of experts: with gate and up the router too; over an expert axis every ring step
recomputes its gate and up in its own backward, whatever the policy), plus the LM head's forward,
which a loss in more than one chunk recomputes under every policy (jaxtron/ops/vocab.py: the
backward recomputes each chunk's logits from the saved logsumexp; in one chunk XLA merges that
with the forward's). jaxtron/program/flops.py counts the compiled matmuls against it.
"""

from __future__ import annotations

from dataclasses import dataclass

from jaxtron.config import Config, ModelConfig
from jaxtron.model import families, windows
from jaxtron.ops import vocab
from jaxtron.plan.memory import layer_weights, process_bytes

# Dense (not 2:4-sparse) BF16 tensor-core peaks in TFLOP/s; first matching substring wins.
PEAK_TFLOPS = (
    ("H100 PCIe", 756.0),
    ("H100 NVL", 835.0),
    ("H100", 989.0),
    ("H200", 989.0),
    ("H800", 989.0),
    ("GH200", 989.0),
    ("B200", 2250.0),
    ("A100", 312.0),
)

# Dense FP8 tensor-core peaks in TFLOP/s (model.fp8): twice the BF16 ones; none on the A100.
FP8_PEAK_TFLOPS = (
    ("H100 PCIe", 1513.0),
    ("H100 NVL", 1671.0),
    ("H100", 1979.0),
    ("H200", 1979.0),
    ("H800", 1979.0),
    ("GH200", 1979.0),
    ("B200", 4500.0),
)

KEYS = ("step", "loss", "lr", "grad_norm", "tokens_per_sec", "step_time", "tflops_per_device",
        "mfu", "mfu_fp8", "tokens", "host_memory_gib")
BAR_DROPS = ("ms", "lr", "grad_norm", "tok")  # what the progress bar drops first when narrow


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a token's matmuls: attention, MLP and the LM head (tied or
    not); of a mixture of experts, the experts_per_token experts a token runs and the router
    (the active parameters, less the embedding and norms); with model.mtp_depth, each
    multi-token-prediction module's layer, projection and pass through the head."""
    return sum(count * sum(w.values()) for count, w in _layer_kinds(cfg)) \
        + (1 + cfg.mtp_depth) * cfg.d_model * cfg.vocab_size


def attention_width(cfg: ModelConfig) -> float:
    """The head size attention's two products run at: the scores over the query/key size, the
    weighted sum over the value size (latent attention's 192 and 128: their mean)."""
    m = cfg.mla
    if m.kv_lora_rank:
        return (m.qk_nope_head_dim + m.qk_rope_head_dim + m.v_head_dim) / 2
    return cfg.head_size


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training FLOPs per token (see the module docstring); a windowed layer's attention over
    the keys its window leaves (windows.keys_per_query)."""
    keys = sum(windows.keys_per_query(w, seq_len) for w in windows.layer_windows(cfg))
    return 6.0 * matmul_params(cfg) + 12 * cfg.num_heads * attention_width(cfg) * keys


def peak_tflops(device_kind: str, fp8: bool = False) -> float | None:
    """Dense BF16 (or FP8) peak of a device, or None when unknown (then MFU is reported as
    null)."""
    for name, tflops in FP8_PEAK_TFLOPS if fp8 else PEAK_TFLOPS:
        if name.lower() in device_kind.lower():
            return tflops
    return None


@dataclass(frozen=True)
class StepCost:
    """What one train step processes, and on what: the constants of every logged row."""

    tokens: int  # global tokens per step
    flops: float  # model FLOPs per step (flops_per_token x tokens)
    num_devices: int
    device_kind: str
    fp8: bool = False  # model.fp8: MFU against the FP8 peak too

    @classmethod
    def of(cls, cfg: Config, devices: list) -> "StepCost":
        """The cost of one step of `cfg` over `devices`."""
        tokens = cfg.train.batch_size * cfg.train.seq_len
        flops = flops_per_token(cfg.model, cfg.train.seq_len) * tokens
        return cls(tokens, flops, len(devices), devices[0].device_kind, cfg.model.fp8 != "none")


def make_row(step: int, fetched: dict, step_time: float, cost: StepCost, tokens: int) -> dict:
    """The logged metrics of one step from its fetched {loss, lr, grad_norm[, fp8_...]}: KEYS,
    and with model.fp8 the FP8 statistics; floats are plain Python floats, non-finite kept as
    is. `tokens`: all the run has trained on by this step."""
    tflops = cost.flops / step_time / cost.num_devices / 1e12
    peak = peak_tflops(cost.device_kind)
    fp8_peak = peak_tflops(cost.device_kind, fp8=True) if cost.fp8 else None
    return {
        "step": step, "loss": float(fetched["loss"]), "lr": float(fetched["lr"]),
        "grad_norm": float(fetched["grad_norm"]),
        "tokens_per_sec": cost.tokens / step_time, "step_time": step_time,
        "tflops_per_device": tflops, "mfu": None if peak is None else tflops / peak,
        "mfu_fp8": None if fp8_peak is None else tflops / fp8_peak, "tokens": tokens,
        # this process's resident memory: a leak (one per save, per batch) shows as a rising line
        "host_memory_gib": round(process_bytes() / 2**30, 4),
        # model.fp8: the amax and scale statistics of the step (jaxtron/ops/fp8.py statistics)
        **{key: float(value) for key, value in fetched.items() if key.startswith("fp8_")},
        # model.moe.num_experts: the router's statistics (jaxtron/model/moe.py metrics), and
        # with model.mtp_depth the multi-token-prediction loss
        **{key: float(value) for key, value in fetched.items()
           if key.startswith(("moe_", "mtp_"))},
    }


# The projections each remat policy (model.REMAT_POLICIES) recomputes in the backward. The down
# projection is not: its output only joins the residual stream, which nothing in the backward
# reads, so XLA drops it from the recompute; except where a norm reads it first (a family with
# post_norms, Gemma: `expected_matmul`). The output projection is recomputed whenever the
# residual after attention is not saved (the MLP's norm reads it).
RECOMPUTED = {
    "none": (),
    "save_dots": (),  # every projection's output saved
    "offload_dots": (),  # ... in host memory
    "save_qkv_out": ("o", "gate", "up"),  # q, k, v and the attention output saved
    "save_attn_out": ("q", "k", "v", "o", "gate", "up"),
    "full": ("q", "k", "v", "o", "gate", "up"),
}


def expected_matmul(cfg: Config, tokens_per_device: float, mesh_expert: int = 1,
                    mesh_tensor: int = 1) -> int:
    """Matmul FLOPs per device per step that cfg.model.remat implies: 6N per token, the policy's
    recomputed projections (2 FLOPs per weight per token) and the chunked LM head's; with
    latent attention over tensor > 1, its down projections again on every other tensor rank
    (`_on_every_tensor_rank`). Measured exact over data, fsdp and tensor; with a pipeline only
    approximate, a lower bound: the stages also run in the bubble iterations (tiny, 2 stages, 4
    microbatches: compiled 1.15x this)."""
    m = cfg.model
    repeated = (mesh_tensor - 1) * _on_every_tensor_rank(m, RECOMPUTED[m.remat])
    names = RECOMPUTED[m.remat]
    if m.moe.num_experts and "gate" in names:
        names = (*names, "router")
    if families.FAMILIES[families.family_of(m)].post_norms and "gate" in names:
        names = (*names, "down")  # the norm after the MLP reads its output
    recomputed = sum(count * sum(w[name] for name in names) for count, w in _layer_kinds(m))
    if m.moe.num_experts and mesh_expert > 1 and "gate" not in names:
        # each ring step's own gate and up, of the routed experts (not the shared ones), in
        # the MoE layers (not model.moe.first_dense's)
        routed = m.d_model * (m.moe.mlp_dim or m.mlp_dim) * m.moe.experts_per_token
        recomputed += (m.num_layers - m.moe.first_dense + m.mtp_depth) * 2 * routed
    chunked = vocab.chunks(cfg.train.seq_len, cfg.train.loss_chunk) > 1
    head = (1 + m.mtp_depth) * m.d_model * m.vocab_size if chunked else 0
    return round((6 * matmul_params(m) + 2 * recomputed + 2 * head + repeated)
                 * tokens_per_device)


def _on_every_tensor_rank(m: ModelConfig, recomputed: tuple[str, ...]) -> int:
    """FLOPs per token of what each tensor rank computes whole: latent attention's down
    projections (W_q_a and W_kv_a, read by every head; not split over tensor), 6 per weight,
    8 where the policy recomputes them (q, k). 0 for other attention."""
    a = m.mla
    if not a.kv_lora_rank:
        return 0
    per_flop = lambda name: 6 + (2 if name in recomputed else 0)
    weights = per_flop("q") * m.d_model * a.q_lora_rank \
        + per_flop("k") * m.d_model * (a.kv_lora_rank + a.qk_rope_head_dim)
    return (m.num_layers + m.mtp_depth) * weights


def expected_attention(cfg: Config, tokens_per_device: float) -> float:
    """Attention's FLOPs per device per step as the compiled program counts its fused kernels
    (`--compile-for`'s attention_per_device): the whole [T, T] of scores and weighted sum, with
    no causal halving, 2 products forward, 5 backward, and the forward again under remat: per
    token 2 * (2 + 5 + 2) * L * N * H * T (a windowed layer's T: twice its window at most,
    windows.counted_keys). Exact for remat=full (Mixtral 8x7B on 16 H100s,
    Qwen3-30B-A3B on 8, jax 0.10.2); the planner's step time reads it so that its estimate and
    the compiled step (planner.compiled_step) count attention alike."""
    m = cfg.model
    products = 2 + 5 + (2 if m.remat != "none" else 0)
    keys = sum(windows.counted_keys(w, cfg.train.seq_len) for w in windows.layer_windows(m))
    return 2 * products * m.num_heads * attention_width(m) * keys * tokens_per_device


def _layer_kinds(m: ModelConfig) -> list[tuple[int, dict[str, int]]]:
    """(layers, one layer's `layer_weights`) for each kind of layer: model.moe.first_dense dense
    ones before the MoE layers, or every layer alike; then the model.mtp_depth
    multi-token-prediction modules' MoE layers with their input projection ("eh", 2 D x D)."""
    dense = m.moe.first_dense if m.moe.num_experts else 0
    kinds = [(dense, layer_weights(m, experts=False))] if dense else []
    kinds.append((m.num_layers - dense, layer_weights(m)))
    if m.mtp_depth:
        kinds.append((m.mtp_depth, {**layer_weights(m), "eh": 2 * m.d_model * m.d_model}))
    return kinds
