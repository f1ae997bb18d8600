"""Reading an optimized HLO module's text: what runs per step, how often, moving how many bytes.

The compiled program is a tree of computations: ENTRY calls fusions, while loops (the scanned
layers, the microbatch and pipeline loops) and async wrappers. Everything here counts per
*execution*: an instruction in a while body runs the loop's trip count times (XLA records it as
`known_trip_count` on the loop), nested loops multiply.

- `collectives`: every all-gather, reduce-scatter, all-reduce, all-to-all and collective-permute,
  grouped by (op, mesh axes, async), with executions and bytes per step per device. Bytes follow
  nccl-tests' "size": the whole buffer (an all-gather's output, a reduce-scatter's input).
  `overlapped` (`overlapped_bytes`): the async executions with a matmul or attention kernel
  scheduled between start and done (the text is in XLA's schedule order), hidden behind compute.
- `kernels`: custom calls (cuBLAS, cuDNN) and Triton fusions, by name, in executions per step.

FLOPs of the matmuls and attention kernels are counted in `jaxtron.program.flops`.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
               "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16,
               "f8e4m3fn": 1, "f8e5m2": 1, "s4": 1, "u4": 1}
COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_COUNTS = ("instructions", "count", "bytes", "overlapped", "overlapped_bytes")  # per step
_ARRAY = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_COMPUTATION = re.compile(r"^(?:ENTRY )?%?([\w.\-]+) \(.*\{\s*$")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
_CALLEE = re.compile(r"\b(?:body|calls)=%([\w.\-]+)")  # not to_apply: reductions' adders
_BRANCHES = re.compile(r"\bbranch_computations=\{([^}]*)\}"
                       r"|\b(?:true|false)_computation=%([\w.\-]+)")


@dataclass
class Instruction:
    name: str
    shape: str  # the result shape text: an array, or a tuple of them
    opcode: str
    rest: str  # operands and attributes


@dataclass
class Module:
    computations: dict[str, list[Instruction]]
    entry: str
    executions: dict[str, int] = field(default_factory=dict)  # computation -> runs per step
    async_bodies: set[str] = field(default_factory=set)  # computations run by async-start
    shapes: dict[str, str] = field(default_factory=dict)  # instruction name -> result shape
    instructions: dict[str, Instruction] = field(default_factory=dict)  # by name
    # a conditional's branches: each counted in `executions` as if it ran every time the
    # conditional does, since which runs is data (flops.compiled weighs attention's)
    branches: set[str] = field(default_factory=set)
    # each computation run inside a conditional's branch (its own or one it calls): the index of
    # that branch (0: false_computation, 1: true_computation; flops.compiled weighs matmuls)
    branch_of: dict[str, int] = field(default_factory=dict)


def parse(text: str) -> Module:
    """The computations of an HLO module's text, with how many times each runs per step."""
    computations: dict[str, list[Instruction]] = {}
    entry, current = "", None
    for line in text.splitlines():
        if current is None:
            match = _COMPUTATION.match(line)
            if match:
                current = computations.setdefault(match.group(1), [])
                entry = match.group(1) if line.startswith("ENTRY") else entry
            continue
        if line.startswith("}"):
            current = None
        elif (inst := _instruction(line)) is not None:
            current.append(inst)
    module = Module(computations, entry)
    module.instructions = {inst.name: inst for insts in computations.values() for inst in insts}
    module.shapes = {name: inst.shape for name, inst in module.instructions.items()}
    _count_executions(module, entry, 1)
    return module


def _instruction(line: str) -> Instruction | None:
    """`%name = SHAPE opcode(operands), attributes` -> Instruction (SHAPE may be a tuple)."""
    head, sep, tail = line.strip().removeprefix("ROOT ").partition(" = ")
    if not sep:
        return None
    if tail.startswith("("):
        depth = 0
        for end, char in enumerate(tail):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                break
        shape, tail = tail[:end + 1], tail[end + 1:].lstrip()
    else:
        shape, _, tail = tail.partition(" ")
    opcode, paren, rest = tail.partition("(")
    return Instruction(head.lstrip("%"), shape, opcode, rest) if paren else None


def _count_executions(module: Module, name: str, times: int, branch: int | None = None) -> None:
    module.executions[name] = module.executions.get(name, 0) + times
    if branch is not None:
        module.branch_of.setdefault(name, branch)
    for inst in module.computations.get(name, []):
        trip = trip_count(module, inst) if inst.opcode == "while" else 1
        indices = _branch_indices(inst) if inst.opcode == "conditional" else {}
        for callee in _callees(inst):
            if callee in module.computations:
                if inst.opcode == "async-start":
                    module.async_bodies.add(callee)
                if inst.opcode == "conditional":
                    module.branches.add(callee)
                _count_executions(module, callee, times * trip, indices.get(callee, branch))


def _branch_indices(inst: Instruction) -> dict[str, int]:
    """A conditional's branch computations by index: branch_computations in order, or
    false_computation 0 and true_computation 1."""
    listed = re.search(r"\bbranch_computations=\{([^}]*)\}", inst.rest)
    if listed:
        return {name: i for i, name in enumerate(re.findall(r"%([\w.\-]+)", listed.group(1)))}
    return {name: int(kind == "true") for kind, name in
            re.findall(r"\b(true|false)_computation=%([\w.\-]+)", inst.rest)}


def _callees(inst: Instruction) -> list[str]:
    """The computations `inst` runs: a loop's body, a call's or fusion's, a conditional's
    branches (not a reduction's adder)."""
    callees = _CALLEE.findall(inst.rest)
    for match in _BRANCHES.finditer(inst.rest):
        callees += re.findall(r"%([\w.\-]+)", match.group(1) or "") + [match.group(2) or ""]
    return [c for c in callees if c]


def trip_count(module: Module, loop: Instruction) -> int:
    """Iterations of a while loop: XLA's `known_trip_count`, else read off its induction variable
    (a loop XLA peeled or double-buffered may lose the annotation): the constant it starts from,
    the constant the condition compares it with, and the constant the body adds. 1 if unreadable."""
    if found := _TRIP.search(loop.rest):
        return int(found.group(1))
    index = re.search(r'"known_induction_variable":\{"tuple_index":"(\d+)"', loop.rest)
    k = int(index.group(1)) if index else 0
    condition = re.search(r"condition=%([\w.\-]+)", loop.rest)
    body = re.search(r"body=%([\w.\-]+)", loop.rest)
    bound = _scalar_constant(module, condition.group(1)) if condition else None
    direction = _direction(module, condition.group(1)) if condition else None
    operands = _operands(loop)
    start = _constant_element(module, operands[0], k) if operands else None
    step = _body_step(module, body.group(1), k) if body else None
    if bound is None or start is None or direction not in ("LT", "LE", "NE"):
        return 1
    span = bound - start + (1 if direction == "LE" else 0)
    return max(-(-span // (step or 1)), 1)


def _operands(inst: Instruction) -> list[str]:
    return re.findall(r"%([\w.\-]+)", inst.rest.split(")", 1)[0])


def _called(module: Module, name: str) -> list[Instruction]:
    """The instructions of a computation and of the fusions it calls."""
    insts = list(module.computations.get(name, []))
    for inst in list(insts):
        callee = re.search(r"\bcalls=%([\w.\-]+)", inst.rest)
        if callee:
            insts += module.computations.get(callee.group(1), [])
    return insts


def _scalar_constant(module: Module, computation: str) -> int | None:
    for inst in _called(module, computation):
        if inst.opcode == "constant" and re.fullmatch(r"[su](32|64)\[\]", inst.shape):
            return int(inst.rest.split(")")[0])
    return None


def _direction(module: Module, computation: str) -> str | None:
    for inst in _called(module, computation):
        if inst.opcode == "compare" and (found := re.search(r"direction=(\w+)", inst.rest)):
            return found.group(1)
    return None


def _constant_element(module: Module, name: str, k: int) -> int | None:
    """The value of element k of a tuple, followed through copies to a scalar constant."""
    inst = module.instructions.get(name)
    if inst is not None and inst.opcode == "tuple":
        operands = _operands(inst)
        inst = module.instructions.get(operands[k]) if k < len(operands) else None
    while inst is not None and inst.opcode in ("copy", "bitcast"):
        inst = module.instructions.get(_operands(inst)[0])
    if inst is None or inst.opcode != "constant":
        return None
    return int(inst.rest.split(")")[0])


def _body_step(module: Module, body: str, k: int) -> int | None:
    """The constant a loop body adds to induction variable k (an add, or a fused add)."""
    insts = module.computations.get(body, [])
    root = insts[-1] if insts else None
    if root is None or root.opcode != "tuple" or k >= len(_operands(root)):
        return None
    update = module.instructions.get(_operands(root)[k])
    if update is None or update.opcode not in ("add", "fusion"):
        return None
    found = [module.instructions.get(o) for o in _operands(update)]
    values = [int(i.rest.split(")")[0]) for i in found if i is not None and i.opcode == "constant"]
    if values:
        return values[0]
    callee = re.search(r"\bcalls=%([\w.\-]+)", update.rest)
    return _scalar_constant(module, callee.group(1)) if callee else None


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a shape text, in order."""
    return [(dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(shape)]


def nbytes(dtype: str, dims: tuple[int, ...]) -> int:
    return DTYPE_BYTES[dtype] * math.prod(dims)


def _top_level(shape: str) -> list[str]:
    """The elements of a tuple shape `(a, (b, c), d)` -> ["a", "(b, c)", "d"]; an array -> [it]."""
    if not shape.startswith("("):
        return [shape]
    parts, depth, start = [], 0, 1
    for i, char in enumerate(shape):  # layouts {1,0} and dims [4,8] hold commas too
        depth += {"(": 1, ")": -1, "[": 1, "]": -1, "{": 1, "}": -1}.get(char, 0)
        if (char == "," and depth == 1) or (char == ")" and depth == 0):
            parts.append(shape[start:i].strip())
            start = i + 1
    return [re.sub(r"/\*index=\d+\*/", "", p).strip() for p in parts if p.strip()]


def collective_bytes(op: str, inst: Instruction, group: int) -> int:
    """The buffer size of one execution of a collective (nccl-tests' size), per device."""
    shape = inst.shape
    parts = _top_level(shape) if inst.opcode.endswith("-start") else [shape]
    # A start's shape is (operands, results[, contexts]) where its first element is a tuple
    # (jax 0.12's all-reduce-start too; before, its shape was the results alone), and for the
    # other ops (operand, result[, contexts]) with one array: either way, the results.
    if len(parts) > 1 and (parts[0].startswith("(") or op != "all-reduce"):
        shape = parts[1]
    size = sum(nbytes(*a) for a in arrays(shape))
    return size * group if op == "reduce-scatter" else size


def device_groups(inst: Instruction, num_devices: int) -> list[list[int]] | None:
    """The replica groups of a collective as device ids (source-target pairs for a permute);
    None when the format is not one this reads."""
    rest = inst.rest
    if match := re.search(r"source_target_pairs=\{([\d,{} ]*)\}", rest):
        return [[int(x) for x in pair.split(",")]
                for pair in re.findall(r"\{([\d,]+)\}", match.group(1))]
    mesh_form = (r"replica_groups=mesh\[([^\]]*)\]"  # axis sizes
                 r"(?:, device_ids=\(([^)]*\)?)\))?"  # the device at each mesh position
                 r"\s*\{([^}]*)\}")  # the axes a group spans
    if match := re.search(mesh_form, rest):
        axes = re.findall(r"'([^']+)'=(\d+)", match.group(1))
        names, sizes = [a for a, _ in axes], [int(s) for _, s in axes]
        grouped = re.findall(r"'([^']+)'", match.group(3))
        ids = _device_ids(match.group(2), num_devices)
        if ids is None or math.prod(sizes) != num_devices or not set(grouped) <= set(names):
            return None
        ids = ids.reshape(sizes)
        order = ([names.index(a) for a in names if a not in grouped]
                 + [names.index(a) for a in grouped])
        width = math.prod(sizes[names.index(a)] for a in grouped)
        return ids.transpose(order).reshape(-1, width).tolist()
    if match := re.search(r"replica_groups=\[(\d+),(\d+)\]<=\[([\d,]+)\](?:T\(([\d,]+)\))?", rest):
        groups, width = int(match.group(1)), int(match.group(2))
        dims = [int(d) for d in match.group(3).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if match.group(4):
            ids = ids.transpose([int(p) for p in match.group(4).split(",")])
        return ids.reshape(groups, width).tolist()
    if match := re.search(r"replica_groups=\{((?:\{[\d,]*\},?)*)\}", rest):
        groups = [[int(x) for x in g.split(",") if x]
                  for g in re.findall(r"\{([\d,]*)\}", match.group(1))]
        return groups or [list(range(num_devices))]
    return None


def _device_ids(text: str | None, num_devices: int) -> np.ndarray | None:
    """The device at each position of a replica-group mesh: `[2,4]T(1,0)` (an iota reshaped and
    transposed), `[8]`, a list `0,4,1,5`, or absent (the identity)."""
    if not text:
        return np.arange(num_devices)
    if match := re.fullmatch(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", text.strip()):
        dims = [int(d) for d in match.group(1).split(",")]
        ids = np.arange(math.prod(dims)).reshape(dims)
        if match.group(2):
            ids = ids.transpose([int(p) for p in match.group(2).split(",")])
        return ids.reshape(-1)
    if re.fullmatch(r"[\d,\s]+", text):
        return np.array([int(x) for x in text.split(",")])
    return None


def mesh_axes(groups: list[list[int]] | None, mesh_shape: dict[str, int]) -> tuple[str, ...] | None:
    """The mesh axes along which the devices of a group differ (device id = row-major index)."""
    if groups is None:
        return None
    names, dims = list(mesh_shape), [mesh_shape[a] for a in mesh_shape]
    varying: set[str] = set()
    for group in groups:
        coords = np.array(np.unravel_index(np.asarray(group), dims)).T
        varying |= {names[i] for i in range(len(dims)) if len(set(coords[:, i])) > 1}
    return tuple(a for a in names if a in varying)


def is_matmul(inst: Instruction) -> bool:
    """A matmul or attention kernel: a dot, a cuBLAS / cuDNN call, a Triton or cuDNN GEMM
    fusion, the MoE experts' grouped matmul kernels (tokamax's ragged_dot)."""
    kind = _target(inst) or (inst.opcode == "fusion" and _fusion_kind(inst)) or ""
    return inst.opcode in ("dot", "convolution") or kind.startswith(("__cublas", "__cudnn")) \
        or "gemm" in kind or is_ragged_dot(inst)


def is_ragged_dot(inst: Instruction) -> bool:
    """A grouped matmul kernel of the MoE experts: tokamax's ragged_dot, a Triton or a Mosaic GPU
    custom call, named in its metadata (the op `RaggedDot`, or on jax 0.11 a Mosaic kernel's
    `ragged_dot_sm90`, `ragged_contracting_dim_dot_sm90`)."""
    return _target(inst) in ("__gpu$xla.gpu.triton", "mosaic_gpu_v2") and (
        "RaggedDot" in inst.rest or bool(re.search(r'op_name="[^"]*/ragged_\w*dot', inst.rest)))


def _computes(module: Module, inst: Instruction, seen: dict[str, bool]) -> bool:
    """A matmul, or a while loop, call or conditional that runs one (the expert ring's loop
    between a layer's weight gather and its done hides the gather as its kernels would)."""
    if is_matmul(inst):
        return True
    if inst.opcode not in ("while", "call", "conditional"):
        return False
    for callee in _callees(inst):
        if callee not in seen:
            seen[callee] = False
            seen[callee] = any(_computes(module, i, seen)
                               for i in module.computations.get(callee, []))
        if seen[callee]:
            return True
    return False


def overlapped(module: Module) -> set[str]:
    """Async starts (and the async bodies they run) with a matmul scheduled before their done,
    or a loop that runs one (`_computes`)."""
    hidden: set[str] = set()
    seen: dict[str, bool] = {}
    for insts in module.computations.values():
        pending: dict[str, bool] = {}  # start name -> a matmul seen since
        for inst in insts:
            done = inst.opcode.endswith("-done")
            start = next((o for o in _operands(inst) if o in pending), None) if done else None
            if inst.opcode.endswith("-start"):
                pending[inst.name] = False
            elif start is not None and pending.pop(start):
                hidden |= {start, *_CALLEE.findall(module.instructions[start].rest)}
            elif pending and _computes(module, inst, seen):
                pending = dict.fromkeys(pending, True)
    return hidden


def in_scope(inst: Instruction, scope: str) -> bool:
    """Whether the instruction's op_name runs under the named scope `scope`."""
    name = re.search(r'op_name="([^"]*)"', inst.rest)
    return bool(name) and f"/{scope}/" in f"/{name.group(1)}/"


def scope_share(inst: Instruction, scope_shares: dict[str, float] | None) -> float:
    """The share of the named scope in the instruction's op_name (1 for none): of its loop's
    iterations, those on which the conditional under that scope runs (the 1F1B ticks' forward,
    loss and backward, one_f_one_b.Ticks.shares), where the module counts every one."""
    if not scope_shares:
        return 1.0
    name = re.search(r'op_name="([^"]*)"', inst.rest)
    return next((share for scope, share in scope_shares.items()
                 if name and f"/{scope}/" in f"{name.group(1)}/"), 1.0)


def collectives(module: Module, mesh_shape: dict[str, int], hosts: Sequence[int] = (),
                scope_shares: dict[str, float] | None = None) -> list:
    """Every collective grouped by (op, axes, async): instructions, executions and bytes per step,
    executions overlapped with a matmul, and whether any of its groups spans hosts (`hosts[i]`:
    the host of the program's device i, in the mesh's device order; empty: one host).
    `scope_shares`: as `scope_share` weighs them, the executions of those under a scope."""
    num_devices = math.prod(mesh_shape.values())
    hidden = overlapped(module)
    rows: dict[tuple, dict] = {}
    for comp, insts in module.computations.items():
        runs = module.executions.get(comp, 0)
        for inst in insts:
            op = inst.opcode.removesuffix("-start")
            if op not in COLLECTIVES or not runs:
                continue
            groups = device_groups(inst, num_devices)
            axes = mesh_axes(groups, mesh_shape)
            width = len(groups[0]) if groups and op != "collective-permute" else 1
            is_async = inst.opcode.endswith("-start") or comp in module.async_bodies
            row = rows.setdefault((op, axes, is_async), {
                "op": op, "axes": list(axes) if axes is not None else None, "async": is_async,
                "crosses_hosts": False, **dict.fromkeys(_COUNTS, 0)})
            if len(hosts) and groups:
                row["crosses_hosts"] |= any(len({hosts[i] for i in g}) > 1 for g in groups)
            done = round(runs * scope_share(inst, scope_shares))
            size = done * collective_bytes(op, inst, width)
            shown = inst.name in hidden or comp in hidden
            for key, value in zip(_COUNTS, (1, done, size, done * shown, size * shown)):
                row[key] += value
    return sorted(rows.values(), key=lambda r: (COLLECTIVES.index(r["op"]), -r["bytes"]))


def kernels(module: Module, scope_shares: dict[str, float] | None = None) -> dict[str, int]:
    """Library and generated kernels by name (custom-call targets, Triton fusion kinds), counted
    in executions per step (`scope_shares` as in `collectives`)."""
    found: Counter[str] = Counter()
    for comp, insts in module.computations.items():
        runs = module.executions.get(comp, 0)
        for inst in insts:
            if inst.opcode == "custom-call":
                found[_target(inst) or "custom-call"] += round(runs * scope_share(inst,
                                                                                  scope_shares))
            elif inst.opcode == "fusion" and (kind := _fusion_kind(inst)):
                found[kind] += round(runs * scope_share(inst, scope_shares))
    return dict(sorted(found.items(), key=lambda kv: -kv[1]))


def _target(inst: Instruction) -> str:
    """A custom call's target (`__cublas$lt$matmul`, `__cudnn$fmha...`); "" for anything else."""
    found = inst.opcode == "custom-call" and re.search(r'custom_call_target="([^"]+)"', inst.rest)
    return found.group(1) if found else ""


def _fusion_kind(inst: Instruction) -> str | None:
    """The backend kind of a custom fusion (`__triton_gemm`, `__cudnn$fusion`, ...), else None."""
    match = re.search(r'"fusion_backend_config":\{"kind":"([^"]+)"', inst.rest)
    return match.group(1) if match and "kCustom" in inst.rest else None
