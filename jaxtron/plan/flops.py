"""Matmul and attention FLOPs: counted in a compiled step's HLO, and expected from the config.

`compiled` reads the optimized HLO (`jaxtron.plan.hlo`): 2 * M * N * K of every matmul (dots, inside
fusions too, cuBLAS calls, Triton GEMM fusions) apart from the cuDNN attention kernels
(`__cudnn$fmha...`), per device per step, times the trip counts of the loops around them. The MoE
experts' grouped matmuls (tokamax's ragged_dot, `ragged`) are counted apart, at their
buffers' static size: 2 * R * K * N for R rows, of which a kernel works on the rows its group sizes
cover (jaxtron/model/moe.py: a device's rows are its expert group's pairs, and each pair is its
one expert's: over the group's devices, R / |expert| rows on average).

`expected_matmul` is what the remat policy implies for the matmuls: 6N per token (forward and
backward of every matmul weight, `metrics.matmul_params`), plus the forward that the policy
recomputes in the backward (a mixture of experts: with gate and up the router too; over an expert
axis every ring step recomputes its gate and up in its own backward, whatever the policy), plus
the LM head's forward, which a loss in more than one chunk
recomputes under every policy (jaxtron/ops/vocab.py: the backward recomputes each chunk's logits
from the saved logsumexp; in one chunk XLA merges that with the forward's). Their ratio says whether
the compiler recomputes what the policy asks, and no more.
"""

from __future__ import annotations

import json
import math
import re

from jaxtron.config import Config, ModelConfig
from jaxtron.ops import vocab
from jaxtron.plan import hlo, metrics
from jaxtron.plan.hlo import Instruction, Module

# The projections each remat policy (model.REMAT_POLICIES) recomputes in the backward. The down
# projection never is: its output only joins the residual stream, which nothing in the backward
# reads, so XLA drops it from the recompute. The output projection is recomputed whenever the
# residual after attention is not saved (the MLP's norm reads it).
RECOMPUTED = {
    "none": (),
    "save_dots": (),  # every projection's output saved
    "offload_dots": (),  # ... in host memory
    "save_qkv_out": ("o", "gate", "up"),  # q, k, v and the attention output saved
    "save_attn_out": ("q", "k", "v", "o", "gate", "up"),
    "full": ("q", "k", "v", "o", "gate", "up"),
}


def compiled(module: Module) -> dict[str, int]:
    """FLOPs per device per step of the matmuls and of the cuDNN attention kernels, apart; of
    the matmuls, those with FP8 operands (`fp8`: an FP8 GEMM, model.fp8) and of those, the ones
    with an e5m2 operand (`fp8_e5m2`: the backward's, against a gradient)."""
    totals = {"matmul": 0, "attention": 0, "ragged": 0, "fp8": 0, "fp8_e5m2": 0}
    for comp, insts in module.computations.items():
        runs = module.executions.get(comp, 0)
        for inst in insts:
            if not runs or not (flops := _flops(inst, module)):
                continue
            if hlo._target(inst).startswith("__cudnn$fmha"):
                totals["attention"] += runs * flops
                continue
            if _ragged(inst):
                totals["ragged"] += runs * flops
                continue
            totals["matmul"] += runs * flops
            dtypes = [dtype for dtype, _ in _operand_shapes(inst, module)[:2]]
            if all(dtype.startswith("f8") for dtype in dtypes):
                totals["fp8"] += runs * flops
                totals["fp8_e5m2"] += runs * flops * ("f8e5m2" in dtypes)
    return totals


def expected_matmul(cfg: Config, tokens_per_device: float, mesh_expert: int = 1) -> int:
    """Matmul FLOPs per device per step that cfg.model.remat implies: 6N per token, the policy's
    recomputed projections (2 FLOPs per weight per token) and the chunked LM head's. Measured
    exact over data, fsdp and tensor; with a pipeline only approximate, a lower bound: the stages
    also run in the bubble iterations (tiny, 2 stages, 4 microbatches: compiled 1.15x this)."""
    m = cfg.model
    names = RECOMPUTED[m.remat]
    if m.num_experts and "gate" in names:
        names = (*names, "router")
    if m.num_experts and mesh_expert > 1 and "gate" not in names:  # each ring step's own
        names = (*names, "gate", "up")
    recomputed = m.num_layers * sum(_weights(m)[name] for name in names)
    chunked = vocab.chunks(cfg.train.seq_len, cfg.train.loss_chunk) > 1
    head = m.d_model * m.vocab_size if chunked else 0
    return round((6 * metrics.matmul_params(m) + 2 * recomputed + 2 * head) * tokens_per_device)


def _weights(m: ModelConfig) -> dict[str, int]:
    """The weights of one layer's projections, by name; of a mixture of experts, those a token
    runs (its experts_per_token experts' and the router)."""
    d, n, k, h, f = m.d_model, m.num_heads, m.num_kv_heads, m.head_size, m.mlp_dim
    if m.num_experts:
        f = (m.moe_mlp_dim or m.mlp_dim) * m.experts_per_token
    return {"q": d * n * h, "k": d * k * h, "v": d * k * h, "o": n * h * d,
            "gate": d * f, "up": d * f, "down": f * d, "router": d * m.num_experts}


def _flops(inst: Instruction, module: Module) -> int:
    if inst.opcode == "dot":
        dims = _dot_dims(inst.rest)
        return _gemm_flops(inst, module, dims) if dims else 0
    target = hlo._target(inst)
    if target.startswith("__cublas"):
        config = re.search(r'"dot_dimension_numbers":(\{[^}]*\})', inst.rest)
        return _gemm_flops(inst, module, json.loads(config.group(1))) if config else 0
    if target.startswith("__cudnn$fmha"):
        return _attention_flops(inst, module, backward="Backward" in target)
    if _ragged(inst):
        # the first matrix operand and the output's last dimension: lhs [R, K] and out [R, N]
        # (forward, and the input's gradient against [G, N, K]), or lhs [R, K] or [K, R] and
        # out [G, K, N] (the weights' gradient); the other operands are group sizes and offsets
        operands, out = _operand_shapes(inst, module), hlo.arrays(hlo._top_level(inst.shape)[0])
        m, k = next(shape for _, shape in operands if len(shape) == 2)
        return 2 * m * k * out[0][1][-1]
    return 0


_ragged = hlo.is_ragged_dot


def _dot_dims(rest: str) -> dict | None:
    contracting = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", rest)
    if contracting is None:
        return None
    return {"lhs_contracting_dimensions": contracting.group(1).split(",")}


def _operand_shapes(inst: Instruction, module: Module) -> list[tuple[str, tuple[int, ...]]]:
    """Shapes of an instruction's operands, looked up by name in the module."""
    return [a for n in hlo._operands(inst) for a in hlo.arrays(module.shapes.get(n, ""))[:1]]


def _gemm_flops(inst: Instruction, module: Module, dims: dict) -> int:
    """2 * (output elements) * (contracted size), from the lhs operand's shape."""
    operands = _operand_shapes(inst, module)
    out = hlo.arrays(hlo._top_level(inst.shape)[0])
    if not operands or not out:
        return 0
    lhs = operands[0][1]
    k = math.prod(lhs[int(d)] for d in dims.get("lhs_contracting_dimensions", []) if d)
    return 2 * math.prod(out[0][1]) * k


def _attention_flops(inst: Instruction, module: Module, backward: bool) -> int:
    """cuDNN attention on q[B, T, N, H], k[B, S, K, H]: 2 matmuls forward (4*B*N*T*S*H FLOPs, as
    cuDNN counts a causal mask: no halving), 5 in the backward (2.5x)."""
    operands = _operand_shapes(inst, module)
    if len(operands) < 2:
        return 0
    (b, t, n, h), s = operands[0][1], operands[1][1][1]
    return 4 * b * n * t * s * h * (5 if backward else 2) // 2
