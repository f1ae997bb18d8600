"""A stage's backward cut in two for the zero-bubble schedule (`zb_h1`, one_f_one_b.py): B, the
input gradient the stage below waits for, and W, the weight gradients, which wait for nothing and
fill the ticks the stage would otherwise idle.

`split` cuts the backward's jaxpr by its outputs. B is every equation the input gradient needs;
W is every other equation the weight gradients need, and reads what B computed and it needs
(`found`: the cotangents of the input-gradient chain at each matmul, the recomputed activations
the weight gradients multiply). Nothing runs twice. Remat blocks and jit calls are inlined first;
layer scans are cut inside, B's scan emitting per layer what W's scan reads. Other equations with
inner programs (shard_map, conditionals) go whole to B when B needs them: the collective
matmuls' weight gradients stay in B.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
from jax._src import source_info_util
from jax.extend import core

_MATMULS = ("dot_general", "ragged_dot", "ragged_dot_general", "conv_general_dilated")
_INLINED = ("remat2", "checkpoint", "pjit", "jit", "closed_call", "core_call", "custom_jvp_call")


@dataclass(eq=False)
class _Var:
    """A value of the graph: compared by identity."""


@dataclass(eq=False)
class _Lit:
    val: Any


@dataclass(eq=False)
class _Scan:
    body: _Graph  # ins: consts, carries, xs; outs: carries, ys
    consts: int
    carries: int
    length: int
    reverse: bool
    unroll: Any


@dataclass(eq=False)
class _Eqn:
    ins: list
    outs: list[_Var]
    prim: Any = None  # a primitive, or None for a scan
    params: dict = field(default_factory=dict)
    ctx: Any = None
    names: Any = None  # the name stack it was traced under
    scan: _Scan | None = None


@dataclass(eq=False)
class _Graph:
    ins: list[_Var]
    eqns: list[_Eqn]
    outs: list  # _Var | _Lit


@dataclass(frozen=True)
class Split:
    """B and W of a backward `fn(*args)`: `b(*args) -> (B's outputs, the early others,
    found)`, `w(kept args, found) -> the late others`, found's shapes in `found`."""

    b: Callable
    w: Callable
    found: list
    early: list[int]  # of the outputs not B's, those B computes
    late: list[int]  # and those W computes


def split(fn: Callable, args: list, b_outs: list[int], keep: list[int]) -> Split:
    """Cut `fn(*args) -> list` (flat arrays in and out) into B, the outputs `b_outs`, and W,
    the others. W reads the args at `keep` itself (the weights, the microbatch's rows: passed
    again) and everything else it needs of B's from `found`. The others B computes whole on
    its way (`early`, as indices among them) come out of B."""
    closed = jax.make_jaxpr(fn)(*args)
    graph = _graph(closed.jaxpr, closed.consts)
    kept = [v for i, v in enumerate(graph.ins) if i in set(keep)]
    b_graph, w_graph = _split(graph, list(b_outs), set(kept))
    given = set(w_graph.ins[len(kept):])
    early = [i for i, o in enumerate(w_graph.outs) if o in given]
    late = [i for i, o in enumerate(w_graph.outs) if o not in given]
    read = _used(_Graph([], w_graph.eqns, [w_graph.outs[i] for i in late]))
    found = [v for v in w_graph.ins[len(kept):] if v in read]
    n = len(b_outs) + len(early)
    b_graph = _Graph(b_graph.ins, b_graph.eqns,
                     b_graph.outs[:len(b_outs)] + [w_graph.outs[i] for i in early] + found)
    w_graph = _Graph(kept + found, w_graph.eqns, [w_graph.outs[i] for i in late])
    shapes = jax.eval_shape(lambda *a: _eval(b_graph, a)[n:], *args)

    def b(*a):
        outs = _eval(b_graph, a)
        return outs[:len(b_outs)], outs[len(b_outs):n], outs[n:]

    def w(kept_args, found_values):
        return _eval(w_graph, [*kept_args, *found_values])

    return Split(b, w, list(shapes), early, late)


# ------------------------------------------------------------------------------- the graph

def _graph(jaxpr, consts) -> _Graph:
    env = {v: _Lit(c) for v, c in zip(jaxpr.constvars, consts)}
    ins = [_Var() for _ in jaxpr.invars]
    env.update(zip(jaxpr.invars, ins))
    eqns: list[_Eqn] = []
    _inline(jaxpr, env, eqns)
    return _Graph(ins, eqns, [_read(env, v) for v in jaxpr.outvars])


def scan_counts(params) -> tuple[int, int]:
    """A scan's (consts, carries): jax 0.10's num_consts and num_carry, or jax 0.12's ft_in
    (the inputs' tree: consts, carries, xs)."""
    if "num_consts" in params:
        return params["num_consts"], params["num_carry"]
    consts, carries, _ = params["ft_in"].unpack()
    return len(consts), len(carries)


def _read(env, a):
    return _Lit(a.val) if isinstance(a, core.Literal) else env[a]


def _inline(jaxpr, env: dict, eqns: list[_Eqn]) -> None:
    """jaxpr's equations into `eqns`, remat blocks and calls inlined, scans as _Scan."""
    for eqn in jaxpr.eqns:
        ins = [_read(env, a) for a in eqn.invars]
        name = eqn.primitive.name
        if name in _INLINED:
            sub = eqn.params.get("jaxpr", eqn.params.get("call_jaxpr"))
            inner, consts = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, ())
            sub_env = {v: _Lit(c) for v, c in zip(inner.constvars, consts)}
            sub_env.update(zip(inner.invars, ins))
            _inline(inner, sub_env, eqns)
            outs = [_read(sub_env, v) for v in inner.outvars]
        elif name == "scan":
            p = eqn.params
            body = _graph(p["jaxpr"].jaxpr, p["jaxpr"].consts)
            outs = [_Var() for _ in eqn.outvars]
            eqns.append(_Eqn(ins, outs, scan=_Scan(body, *scan_counts(p), p["length"],
                                                   p["reverse"], p.get("unroll", 1))))
        else:
            outs = [_Var() for _ in eqn.outvars]
            eqns.append(_Eqn(ins, outs, eqn.primitive, eqn.params, getattr(eqn, "ctx", None),
                             getattr(eqn.source_info, "name_stack", None)))
        for v, out in zip(eqn.outvars, outs):
            if not isinstance(v, core.DropVar):
                env[v] = out


def _eval(graph: _Graph, args) -> list:
    env = dict(zip(graph.ins, args))
    get = lambda a: a.val if isinstance(a, _Lit) else env[a]
    for e in graph.eqns:
        vals = [get(a) for a in e.ins]
        if e.scan is not None:
            outs = _eval_scan(e.scan, vals)
        else:
            params = e.prim.get_bind_params(e.params)
            subfuns, params = params if isinstance(params, tuple) else ((), params)
            manager = getattr(e.ctx, "manager", None) or contextlib.nullcontext()
            with manager, _named(e.names):
                outs = e.prim.bind(*subfuns, *vals, **params)
            outs = outs if e.prim.multiple_results else [outs]
        env.update(zip(e.outs, outs))
    return [get(a) for a in graph.outs]


def _named(names):
    """The op names of a traced equation, under the names current where it runs."""
    if names is None:
        return contextlib.nullcontext()
    return source_info_util.extend_name_stack(str(names)) if str(names) else (
        contextlib.nullcontext())


def _eval_scan(s: _Scan, vals) -> list:
    consts, init, xs = (vals[:s.consts], vals[s.consts:s.consts + s.carries],
                        vals[s.consts + s.carries:])

    def body(carry, x):
        outs = _eval(s.body, [*consts, *carry, *x])
        return outs[:s.carries], outs[s.carries:]

    carry, ys = jax.lax.scan(body, list(init), list(xs), length=s.length, reverse=s.reverse,
                             unroll=s.unroll)
    return [*carry, *ys]


# ------------------------------------------------------------------------------- liveness

def _live(graph: _Graph, wanted) -> set:
    """The values (inputs among them) that computing `wanted` reads."""
    live = {v for v in wanted if isinstance(v, _Var)}
    for e in reversed(graph.eqns):
        if e.scan is not None:
            outs = {i for i, o in enumerate(e.outs) if o in live}
            if outs:
                live |= {e.ins[i] for i in _scan_needs(e.scan, outs)[1]}
        elif any(o in live for o in e.outs):
            live |= set(e.ins)
    return {v for v in live if isinstance(v, _Var)}


def _scan_needs(s: _Scan, wanted: set[int]) -> tuple[set[int], set[int]]:
    """(the scan outputs computed with `wanted`: every carry those read, the inputs read)."""
    outs = set(wanted)
    while True:
        live = _live(s.body, [s.body.outs[i] for i in outs])
        carries = {j for j in range(s.carries) if s.body.ins[s.consts + j] in live}
        if carries <= outs:
            break
        outs |= carries
    ins = {i for i, v in enumerate(s.body.ins) if v in live}
    ins |= {s.consts + j for j in outs if j < s.carries}  # the carries' initial values
    return outs, ins


# ------------------------------------------------------------------------------- the cut

def _split(graph: _Graph, b_idx: list[int], keep: set, w_only: frozenset = frozenset()
           ) -> tuple[_Graph, _Graph]:
    """(B: graph.ins -> the outputs at b_idx + found; W: the kept ins + found -> the others).
    `w_only`: ins B does not get (a scan body's W carries)."""
    b_vars = [graph.outs[i] for i in b_idx]
    in_b: dict[_Eqn, set[int] | None] = {}  # B's equations: a scan's B outputs, else None
    live = {v for v in b_vars if isinstance(v, _Var)}
    for e in reversed(graph.eqns):
        if e.scan is not None:
            wanted = {i for i, o in enumerate(e.outs) if o in live}
            if wanted:
                outs, ins = _scan_needs(e.scan, wanted)
                in_b[e] = outs
                live |= {e.ins[i] for i in ins}
        elif any(o in live for o in e.outs):
            in_b[e] = None
            live |= set(e.ins)
    produced = set(graph.ins) - w_only
    for e, outs in in_b.items():
        produced |= {o for i, o in enumerate(e.outs) if outs is None or i in outs}

    w_outs = [o for i, o in enumerate(graph.outs) if i not in b_idx]
    live_w = {v for v in w_outs if isinstance(v, _Var)}
    in_w: dict[_Eqn, _Eqn] = {}  # W's equations: the equation, or its scan's W part
    b_parts: dict[_Eqn, _Eqn] = {}  # a split scan's B part
    for e in reversed(graph.eqns):
        missing = any(o in live_w and o not in produced for o in e.outs)
        if not missing:
            continue
        if e in in_b:  # a scan whose other outputs W needs: cut inside it
            b_part, w_part = _split_scan(e, in_b[e])
            b_parts[e], in_w[e] = b_part, w_part
            produced |= set(b_part.outs)
        else:
            in_w[e] = e
        live_w |= {v for v in in_w[e].ins if isinstance(v, _Var)}

    # W's cheap equations on B's values alone run in B (a norm scale's gradient, a cast, a
    # weight gradient's sum): what W waits with is then their small results, and what B's
    # opaque equations computed whole (a collective matmul's weight gradient) leaves W at once
    # what reads no value (iota, zeros to update) W computes again rather than wait with
    const: dict[_Var, _Eqn] = {}
    for e in graph.eqns:
        if e.scan is None and not _heavy(e) and all(
                v in const for v in e.ins if isinstance(v, _Var)):
            const.update(dict.fromkeys(e.outs, e))
    moved: dict[_Eqn, _Eqn] = {}
    for e in graph.eqns:
        ins = [v for v in in_w.get(e, e).ins if isinstance(v, _Var)]
        if e in in_w and not _heavy(in_w[e]) and all(v in produced for v in ins) and not all(
                v in const for v in ins):
            moved[e] = in_w.pop(e)
            produced |= set(moved[e].outs)

    found: dict[_Var, None] = {}  # what W reads of B's, in order
    again: set[_Eqn] = set()
    reads = [a for e in graph.eqns if e in in_w for a in in_w[e].ins] + w_outs
    while reads:
        v = reads.pop(0)
        if not isinstance(v, _Var) or v not in produced or v in keep:
            continue
        if v in const and v not in graph.ins:
            if const[v] not in again:
                again.add(const[v])
                reads += const[v].ins
        else:
            found[v] = None
    w_eqns = [e for e in graph.eqns if e in again and e not in in_w] + [
        in_w[e] for e in graph.eqns if e in in_w]
    b_eqns = [part for e in graph.eqns
              for part in ([b_parts.get(e, e)] if e in in_b else []) + (
                  [moved[e]] if e in moved else [])]
    b = _Graph(graph.ins, b_eqns, b_vars + list(found))
    w = _Graph([v for v in graph.ins if v in keep] + list(found),
               w_eqns, w_outs)
    return b, w


def _split_scan(e: _Eqn, b_outs: set[int]) -> tuple[_Eqn, _Eqn]:
    """A scan's B part (the outputs b_outs, and per iteration what W reads of B's as more ys)
    and W part (the other carries and ys, that per-iteration state as more xs)."""
    s, body = e.scan, e.scan.body
    n_in, n_out = s.consts + s.carries, s.carries
    b_carries = [j for j in range(s.carries) if j in b_outs]
    w_carries = [j for j in range(s.carries) if j not in b_outs]
    outer = [i for i in range(len(body.ins)) if i < s.consts or i >= n_in]  # consts and xs
    keep = {body.ins[i] for i in outer} | {body.ins[s.consts + j] for j in w_carries}
    b_body, w_body = _split(body, sorted(b_outs), keep,
                            frozenset(body.ins[s.consts + j] for j in w_carries))
    n_found = len(b_body.outs) - len(b_outs)

    # B: the consts and xs its body reads, its carries; its outputs and the found ys
    used = _used(b_body)
    b_consts = [i for i in range(s.consts) if body.ins[i] in used]
    b_xs = [i for i in range(n_in, len(body.ins)) if body.ins[i] in used]
    b_ins = b_consts + [s.consts + j for j in b_carries] + b_xs
    stacked = [_Var() for _ in range(n_found)]
    b_node = _Eqn([e.ins[i] for i in b_ins], [e.outs[j] for j in sorted(b_outs)] + stacked,
                  scan=_Scan(_Graph([body.ins[i] for i in b_ins], b_body.eqns, b_body.outs),
                             len(b_consts), len(b_carries), s.length, s.reverse, s.unroll))

    # W: the consts and xs it reads, its carries, the found values as xs
    found = w_body.ins[len(w_body.ins) - n_found:]
    used = _used(w_body)
    w_consts = [i for i in range(s.consts) if body.ins[i] in used]
    w_xs = [i for i in range(n_in, len(body.ins)) if body.ins[i] in used]
    w_ins = w_consts + [s.consts + j for j in w_carries] + w_xs
    w_ys = [n_out + k for k in range(len(body.outs) - n_out) if n_out + k not in b_outs]
    w_node = _Eqn([e.ins[i] for i in w_ins] + stacked,
                  [e.outs[j] for j in w_carries] + [e.outs[k] for k in w_ys],
                  scan=_Scan(_Graph([body.ins[i] for i in w_ins] + list(found), w_body.eqns,
                                    w_body.outs),
                             len(w_consts), len(w_carries), s.length, s.reverse, s.unroll))
    return b_node, w_node


def _heavy(e: _Eqn) -> bool:
    """Whether an equation holds a matmul (in its inner programs too)."""
    if e.scan is not None:
        return any(_heavy(inner) for inner in e.scan.body.eqns)
    if e.prim.name in _MATMULS:
        return True
    return any(_heavy_jaxpr(j) for j in core.jaxprs_in_params(e.params))


def _heavy_jaxpr(jaxpr) -> bool:
    return any(eqn.primitive.name in _MATMULS
               or any(_heavy_jaxpr(j) for j in core.jaxprs_in_params(eqn.params))
               for eqn in jaxpr.eqns)


def _used(graph: _Graph) -> set:
    """The values a graph's equations and outputs read."""
    return {a for e in graph.eqns for a in e.ins} | set(graph.outs)
