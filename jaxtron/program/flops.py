"""Matmul and attention FLOPs counted in a compiled step's HLO.

`compiled` reads the optimized HLO (`jaxtron.program.hlo`): 2 * M * N * K of every matmul (dots,
inside fusions too, cuBLAS calls, Triton GEMM fusions) apart from the cuDNN attention kernels
(`__cudnn$fmha...`), per device per step, times the trip counts of the loops around them. The MoE
experts' grouped matmuls (tokamax's ragged_dot, `ragged`) are counted apart, at their
buffers' static size: 2 * R * K * N for R rows, of which a kernel works on the rows its group sizes
cover (jaxtron/model/moe.py: a device's rows are its expert group's pairs, and each pair is its
one expert's: over the group's devices, R / |expert| rows on average). Against
jaxtron/plan/costs.py's expected_matmul, their ratio says whether the compiler recomputes what the
policy asks, and no more. The optimizer's matmuls (Muon's Newton-Schulz, under the named scope
`newton_schulz`: jaxtron/step/muon.py) are counted apart, as `optimizer`.
"""

from __future__ import annotations

import json
import math
import re

from jaxtron.model import windows
from jaxtron.program import hlo
from jaxtron.program.hlo import Instruction, Module
from jaxtron.step.muon import SCOPE as OPTIMIZER_SCOPE


def compiled(module: Module, window_shares: dict[int, float] | None = None,
             scope_shares: dict[str, float] | None = None) -> dict[str, int]:
    """FLOPs per device per step of the matmuls and of the cuDNN attention kernels, apart; of
    the matmuls, those with FP8 operands (`fp8`: an FP8 GEMM, model.fp8) and of those, the ones
    with an e5m2 operand (`fp8_e5m2`: the backward's, against a gradient).

    A layer stack whose layers attend with different windows picks its kernel in a conditional
    (jaxtron/model/windows.py), whose branches the module counts as run each time; a kernel in
    a branch is weighed by `window_shares`: window (0: global) -> the share of the layers that
    attend with it (windows.shares). A cuDNN kernel's window is its own; the XLA kernels'
    matmuls (gpt-oss's sinks) take their branch's: 1 windowed (attention.either's true
    branch), 0 global. `scope_shares`: named scope -> the share of its loop's iterations on which
    a conditional under it runs (the 1F1B ticks' forward, loss and backward,
    one_f_one_b.Ticks.shares); what runs under one, in its loops too, is weighed by it."""
    totals = {"matmul": 0, "attention": 0, "ragged": 0, "fp8": 0, "fp8_e5m2": 0, "optimizer": 0}
    shares = window_shares or {}
    by_branch = {0: shares.get(0, 1.0), 1: sum(v for w, v in shares.items() if w) or 1.0}
    for comp, insts in module.computations.items():
        runs = module.executions.get(comp, 0)
        if len(shares) > 1 and comp in module.branch_of:
            runs *= by_branch[module.branch_of[comp]]
        for inst in insts:
            if not runs or not (flops := _flops(inst, module)):
                continue
            if hlo._target(inst).startswith("__cudnn$fmha"):
                share = shares.get(_window(inst), 1.0)
                runs_here = module.executions.get(comp, 0)
                totals["attention"] += round(runs_here * flops * hlo.scope_share(inst, scope_shares)
                                             * (share if comp in module.branches else 1.0))
                continue
            scoped = hlo.scope_share(inst, scope_shares)
            if _ragged(inst):
                totals["ragged"] += round(runs * flops * scoped)
                continue
            if hlo.in_scope(inst, OPTIMIZER_SCOPE):
                totals["optimizer"] += round(runs * flops * scoped)
                continue
            totals["matmul"] += round(runs * flops * scoped)
            dtypes = [dtype for dtype, _ in _operand_shapes(inst, module)[:2]]
            if all(dtype.startswith("f8") for dtype in dtypes):
                totals["fp8"] += round(runs * flops * scoped)
                totals["fp8_e5m2"] += round(runs * flops * scoped) * ("f8e5m2" in dtypes)
    return totals


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
    cuDNN counts a causal mask: no halving), 5 in the backward (2.5x). With a sliding window
    (its backend config's sliding_window_length W) over min(S, 2W) keys: the band, counted
    like the causal square (windows.counted_keys)."""
    operands = _operand_shapes(inst, module)
    if len(operands) < 2:
        return 0
    (b, t, n, h), s = operands[0][1], operands[1][1][1]
    s = windows.counted_keys(_window(inst), s)
    return 4 * b * n * t * s * h * (5 if backward else 2) // 2


def _window(inst: Instruction) -> int:
    """A cuDNN attention kernel's sliding window (its backend config's sliding_window_length;
    0: none)."""
    window = re.search(r"sliding_window_length\W*(\d+)", inst.rest)
    return int(window.group(1)) if window else 0
