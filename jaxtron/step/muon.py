"""Muon: momentum orthogonalised by Newton-Schulz for the hidden matrices, AdamW for the rest.

Jordan et al. (2024) and Liu et al. (2025, "Muon is Scalable for LLM Training", Moonlight):
- Muon takes each 2-D hidden matrix (attention and MLP projections, each layer's and each
  expert's apart); AdamW keeps the embeddings, the head, norms, biases, routers and the MoE
  balancing bias, which the papers leave to it.
- Each orthogonalised matrix (RMS 1 / sqrt(max(rows, cols))) is scaled by
  0.2 * sqrt(max(rows, cols)): an update RMS of 0.2, AdamW's typical one, so that one learning
  rate and one decoupled weight decay serve both.

Newton-Schulz needs each whole matrix, but the weights are split over fsdp and tensor. Where it
runs (optim.muon_layout, measured on the H100 compile in docs/performance.md):
- spread: the mesh axes that split a matrix are moved onto its stacked dimensions (layers,
  experts) where they divide them: each device orthogonalises whole matrices, its share of
  them, with one all-to-all in and one out;
- gathered: every device orthogonalises every matrix it holds a piece of, whole;
- sharded: in the weights' own layout, XLA splitting every Newton-Schulz matmul.
The momentum stays in the weights' layout, like AdamW's moments.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxtron import parallel
from jaxtron.config import ModelConfig, OptimConfig

# Logical axes along which a weight stacks separate matrices: each is orthogonalised alone.
STACKED = ("layers", "stack", "experts")
# Leaves AdamW keeps although they may be 2-D: the routers (a few columns; Moonlight leaves
# them out) besides the norms', biases' and sinks' names (optim.NO_DECAY); every weight with a
# vocab axis (embeddings, head) too.
ADAMW_NAMES = frozenset({"router"})
# Embed-like axes: when a matrix ends with one, its other axes are its rows (W_o[N, H, D]).
OUTPUT_LAST = ("embed", "expert_embed")
# Keller Jordan's quintic Newton-Schulz coefficients: the steepest slope at 0 that keeps the
# singular values in about [0.7, 1.2] after 5 iterations.
COEFFS = (3.4445, -4.7750, 2.0315)
RMS = 0.2  # the update RMS Moonlight matches to AdamW's
SCOPE = "newton_schulz"  # the named scope of its matmuls, which compile reports count apart


@dataclass(frozen=True)
class Matrix:
    """One weight as Muon sees it: its stacked dimensions, its rows and columns (dimension
    indices), and its mesh PartitionSpec."""

    stacked: tuple[int, ...]
    rows: tuple[int, ...]
    cols: tuple[int, ...]
    spec: P


class MuonState(NamedTuple):
    """The momentum of Muon's matrices (one moment; AdamW keeps two)."""

    momentum: optax.Updates


def matrix_of(name: str, axes: tuple[str | None, ...], skip: frozenset[str]) -> Matrix | None:
    """How the weight `name` with logical `axes` is orthogonalised; None where AdamW keeps it:
    a name in `skip`, a vocab axis, or fewer than two axes besides the stacked ones."""
    if name in skip or name in ADAMW_NAMES or "vocab" in axes:
        return None
    stacked = tuple(i for i, a in enumerate(axes) if a in STACKED)
    inner = tuple(i for i, a in enumerate(axes) if a not in STACKED)
    if len(inner) < 2:
        return None
    cut = len(inner) - 1 if axes[inner[-1]] in OUTPUT_LAST else 1
    return Matrix(stacked, inner[:cut], inner[cut:], parallel.spec(tuple(axes)))


def matrices(model: ModelConfig, skip: frozenset[str]) -> dict:
    """Each weight of `model` -> its Matrix, or None (AdamW's), as a pure dict like the params."""
    from jaxtron.model import abstract_model

    state = nnx.split(abstract_model(model), nnx.Param, ...)[1]  # the FP8 histories apart
    logical = parallel.logical_specs(state)
    return jax.tree_util.tree_map_with_path(
        lambda path, spec: matrix_of(path[-1].key, tuple(spec), skip), logical,
        is_leaf=lambda x: isinstance(x, P))


def muon(cfg: OptimConfig, model: ModelConfig, schedule: optax.Schedule,
         decay_mask, skip: frozenset[str]) -> optax.GradientTransformation:
    """Muon on the matrices, AdamW (`decay_mask` says which of its leaves decay) on the rest,
    both at `schedule`'s rate with decoupled weight decay."""
    shapes = matrices(model, skip)
    is_leaf = lambda x: x is None or isinstance(x, Matrix)
    labels = jax.tree.map(lambda m: "muon" if m else "adamw", shapes, is_leaf=is_leaf)
    masked = jax.tree.map(lambda m: m or optax.MaskedNode(), shapes, is_leaf=is_leaf)
    dtype = jnp.dtype(model.dtype)
    return optax.chain(
        optax.partition({
            "muon": optax.chain(
                orthogonalised(masked, cfg.muon_beta, cfg.muon_steps, dtype, cfg.muon_layout,
                               cfg.mu_dtype or None),
                optax.add_decayed_weights(cfg.weight_decay)),
            "adamw": optax.chain(
                optax.scale_by_adam(cfg.b1, cfg.b2, cfg.eps, mu_dtype=cfg.mu_dtype or None),
                optax.add_decayed_weights(cfg.weight_decay, decay_mask)),
        }, labels),
        optax.scale_by_learning_rate(schedule))


def orthogonalised(shapes: dict, beta: float, steps: int, dtype, layout: str,
                   mu_dtype=None) -> optax.GradientTransformation:
    """Nesterov momentum, each matrix of it orthogonalised (`shapes`: Matrix per leaf) in
    `dtype` with `steps` Newton-Schulz iterations where `layout` puts it, RMS-matched."""

    def init(params):
        return MuonState(jax.tree.map(lambda p: jnp.zeros(p.shape, mu_dtype or p.dtype), params))

    def update(grads, state, params=None):
        del params
        momentum = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g, state.momentum, grads)
        ahead = jax.tree.map(lambda m, g: beta * m + (1 - beta) * g, momentum, grads)
        updates = jax.tree.map(lambda u, m: _orthogonal(u, m, steps, dtype, layout), ahead,
                               shapes, is_leaf=lambda x: isinstance(x, Matrix))
        momentum = jax.tree.map(lambda m, old: m.astype(old.dtype), momentum, state.momentum)
        return updates, MuonState(momentum)

    return optax.GradientTransformation(init, update)


def _orthogonal(u: jax.Array, m: Matrix, steps: int, dtype, layout: str) -> jax.Array:
    """RMS * sqrt(max(rows, cols)) * the nearest orthogonal matrix of each matrix in `u`."""
    sizes = _mesh_sizes()
    # The layout pinned on both sides of Newton-Schulz: pinned on its input alone, XLA
    # propagates the weights' layout back from the output into the matmuls.
    pin = (lambda x: jax.lax.with_sharding_constraint(x, placement(m, u.shape, sizes, layout))
           ) if sizes and layout != "sharded" else (lambda x: x)
    order = m.stacked + m.rows + m.cols
    stacked = tuple(u.shape[i] for i in m.stacked)
    rows, cols = (math.prod(u.shape[i] for i in part) for part in (m.rows, m.cols))
    back = sorted(range(u.ndim), key=order.__getitem__)
    with jax.named_scope(SCOPE):
        x = pin(u).transpose(order).reshape(*stacked, rows, cols)
        x = newton_schulz(x.astype(dtype), steps).astype(u.dtype)
        x = pin(x.reshape(tuple(u.shape[i] for i in order)).transpose(back))
    x = (RMS * math.sqrt(max(rows, cols))) * x
    return jax.lax.with_sharding_constraint(x, _present(m.spec, sizes)) if sizes else x


def newton_schulz(x: jax.Array, steps: int) -> jax.Array:
    """The quintic Newton-Schulz iteration on the last two dimensions of `x`: each matrix
    pushed towards U V^T of its SVD, its Gram matrix taken on the shorter side."""
    tall = x.shape[-2] > x.shape[-1]
    x = jnp.swapaxes(x, -1, -2) if tall else x
    norm = jnp.sqrt(jnp.sum(jnp.square(x.astype(jnp.float32)), axis=(-2, -1), keepdims=True))
    x = x / (norm + 1e-7).astype(x.dtype)
    a, b, c = COEFFS
    for _ in range(steps):
        gram = x @ jnp.swapaxes(x, -1, -2)
        x = a * x + (b * gram + c * gram @ gram) @ x
    return jnp.swapaxes(x, -1, -2) if tall else x


def placement(m: Matrix, shape: tuple[int, ...], sizes: dict[str, int], layout: str) -> P:
    """Where `layout` orthogonalises the weight `m` of `shape` on a mesh of `sizes`: its
    stacked dimensions keep their axes; gathered leaves its matrices whole on every device,
    spread also moves each axis that splits them, then each it is replicated over, onto a
    stacked dimension it divides."""
    entries = [list(_axes(e, sizes)) for e in _present(m.spec, sizes)]
    entries += [[] for _ in range(len(shape) - len(entries))]

    def home(axis: str) -> int | None:  # the first stacked dimension the axis still divides
        return next((d for d in m.stacked if layout == "spread" and shape[d] % (
            math.prod(sizes[a] for a in entries[d]) * sizes[axis]) == 0), None)

    for dim in m.rows + m.cols:
        kept = []
        for axis in entries[dim]:
            if (d := home(axis)) is not None:
                entries[d].append(axis)
            elif layout == "spread":
                kept.append(axis)  # divides no stacked dimension: XLA splits the matmuls
        entries[dim] = kept
    # The axes the weight is replicated over (data): each replica would repeat the same work,
    # so spread shares it out too, then gathers the updates back over them.
    for axis in (a for a in sizes if not any(a in e for e in entries)):
        if (d := home(axis)) is not None:
            entries[d].append(axis)
    return P(*(tuple(e) if len(e) > 1 else (e[0] if e else None) for e in entries))


def _mesh_sizes() -> dict[str, int]:
    """The current mesh's axes that split anything (size > 1); {} outside a mesh."""
    mesh = jax.sharding.get_abstract_mesh()
    return {} if mesh.empty else {a: s for a, s in mesh.shape.items() if s > 1}


def _axes(entry, sizes: dict[str, int]) -> tuple[str, ...]:
    axes = entry if isinstance(entry, tuple) else (entry,)
    return tuple(a for a in axes if a in sizes)


def _present(spec: P, sizes: dict[str, int]) -> P:
    """`spec` without the mesh axes this mesh lacks or does not split."""
    return P(*(_one(_axes(e, sizes)) for e in spec))


def _one(axes: tuple[str, ...]):
    return axes if len(axes) > 1 else (axes[0] if axes else None)
