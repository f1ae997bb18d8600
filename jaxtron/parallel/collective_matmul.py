"""Tensor-parallel matmuls overlapped with their collectives (collective matmul).

With sequence parallelism a block's input is split over `tensor` along the sequence,
x[B, T_tensor, D], and its column-parallel matmuls (W_q, W_k, W_v, W_gate, W_up: output dimension
split over `tensor`) need the whole sequence: XLA all-gathers x, then multiplies. The row-parallel
ones (W_o, W_down: contracting dimension split) produce partial sums that XLA reduce-scatters back
over the sequence. Each collective sits on the critical path, between two matmuls that wait for it.

Here each of these becomes n = |tensor| steps inside a `shard_map` over `tensor`:

    gather_matmuls:   multiply the sequence chunk in hand while a collective-permute passes it
                      on to the neighbour and brings the next one (n-1 permutes of x/n);
    matmul_scatter:   multiply the chunk whose partial sum is due next while the running sum
                      travels one device on (n-1 permutes of out/n).

The permutes do not depend on the matmul beside them, so XLA's latency-hiding scheduler runs them
together (an async collective-permute started before the GEMM, finished after). Autodiff turns
each loop into its mirror image for the backward. The values equal the plain matmuls up to
float rounding of the summation order (tests/test_collective_matmul.py). Only `tensor` is manual
here (the pipeline's stages are already): data and fsdp stay with the compiler, so FSDP gathers
the weights as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jax.tree_util import Partial

AXIS = "tensor"
# dot(x, w, contract) -> x's last `contract` dimensions against w's first (jnp.tensordot's), as
# a pytree (a `Partial`): the arrays it holds (FP8 scales) enter the shard_map as its arguments
Dot = Partial


def applies() -> bool:
    """True inside a mesh whose `tensor` axis has more than one device."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.shape.get(AXIS, 1) > 1


def _context() -> tuple[tuple[str, ...] | None, str | tuple[str, ...]]:
    """(the context axis when it splits the sequence, else None; the sequence's split between
    blocks): under context parallelism each context rank gathers and scatters its own positions,
    so the shard_maps are manual over `context` too."""
    mesh = jax.sharding.get_abstract_mesh()
    kinds = dict(zip(mesh.axis_names, mesh.axis_types))
    if mesh.shape.get("context", 1) == 1 or kinds["context"] == jax.sharding.AxisType.Manual:
        return None, AXIS
    return ("context",), ("context", AXIS)


def _shift_left(x: jax.Array, n: int) -> jax.Array:
    """Device j's x goes to device j-1 (the last device's to n-1's neighbour, device n-1 from 0)."""
    return jax.lax.ppermute(x, AXIS, [(j, (j - 1) % n) for j in range(n)])


def _chunk(x: jax.Array, index: jax.Array, size: int) -> jax.Array:
    """Sequence chunk `index` of x[B, T, ...], `size` positions long."""
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=1)


def _gather_local(dots, x_BtD, *weights):
    """Local view: x[B, T/n, D] (this device's chunk), weights [D, ...local out dims]."""
    n, me = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    t = x_BtD.shape[1]
    outs = [jnp.zeros((x_BtD.shape[0], t * n, *w.shape[1:]), x_BtD.dtype) for w in weights]
    chunk = x_BtD
    for step in range(n):
        # The chunk in hand came from device me + step: it is sequence chunk (me + step) % n.
        following = _shift_left(chunk, n) if step < n - 1 else None  # in flight meanwhile
        where = ((me + step) % n) * t
        chunk, *ws = _step_weights(chunk, weights)
        ys = [dot(chunk, w, 1) for dot, w in zip(dots, ws)]
        # Tie the received chunk to this step's products: the next step's matmuls then follow
        # this step's, so XLA cannot merge them all into one matmul after the last permute.
        ys, chunk = jax.lax.optimization_barrier((ys, following))
        outs = [jax.lax.dynamic_update_slice_in_dim(o, y, where, axis=1) for o, y in zip(outs, ys)]
    return tuple(outs)


def _scatter_local(dot, h_BT_, w):
    """Local view: h[B, T, ...contracting, local] and w[...contracting, D] -> out[B, T/n, D]."""
    n, me = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    t = h_BT_.shape[1] // n
    contract = h_BT_.ndim - 2
    # Device me's running sum at step s is for chunk me + 1 + s; after n - 1 moves left, the sum
    # that ends here is this device's own chunk, with every device's part added once.
    total = dot(_chunk(h_BT_, (me + 1) % n, t), w, contract)
    for step in range(1, n):
        moving = _shift_left(total, n)  # in flight while this step's matmul runs
        # The chunk waits for the previous sum, so the matmuls stay one per step (unmerged).
        chunk, _ = jax.lax.optimization_barrier((_chunk(h_BT_, (me + 1 + step) % n, t), total))
        chunk, w_step = _step_weights(chunk, (w,))
        total = moving + dot(chunk, w_step, contract)
    return total


# jax 0.11 and later: see _step_weights (on jax 0.10.2 the barrier left 2% more exposed)
_TIE_WEIGHTS = jax.__version_info__ >= (0, 11)


def _step_weights(chunk: jax.Array, weights: Sequence[jax.Array]) -> tuple[jax.Array, ...]:
    """(chunk, *weights) through one barrier: in the backward their cotangents pass one too, so
    each step's weight gradient (chunk^T dY) stays a matmul of its own. Without it, XLA (jax
    0.12) merged the weight gradients of a loop into matmuls over concatenated chunks, each
    waiting for several permutes, which then ran back to back with no matmul beside them:
    synchronous, 17% of llama3_70b_pp8's tensor permutes (8% with the barrier; docs/performance.md,
    "jax 0.12")."""
    if not _TIE_WEIGHTS:
        return (chunk, *weights)
    return tuple(jax.lax.optimization_barrier((chunk, *weights)))


def gather_matmuls(x_BTD: jax.Array, *weights: jax.Array, dots: Sequence[Dot] | None = None
                   ) -> tuple[jax.Array, ...]:
    """x[B, T_tensor, D] times each weight [D, X_tensor, ...] -> outputs [B, T, X_tensor, ...],
    the all-gather of x over the sequence overlapped with the matmuls. `dots`: how each weight's
    chunk products are computed (`jnp.tensordot` unless given: the model's FP8 matmuls), their
    arrays replicated over tensor."""
    ctx, seq = _context()
    w_specs = tuple(P(None, AXIS, *[None] * (w.ndim - 2)) for w in weights)
    out_specs = tuple(P(None, ctx, AXIS, *[None] * (w.ndim - 2)) for w in weights)
    dots = dots or [Partial(jnp.tensordot)] * len(weights)
    run = jax.shard_map(_gather_local, in_specs=(P(), P(None, seq, None), *w_specs),
                        out_specs=out_specs, axis_names={AXIS, *(ctx or ())}, check_vma=False)
    return run(list(dots), x_BTD, *weights)


def matmul_scatter(h: jax.Array, w: jax.Array, dot: Dot = Partial(jnp.tensordot)) -> jax.Array:
    """h[B, T, X_tensor, ...] times w[X_tensor, ..., D] summed over X -> out[B, T_tensor, D], the
    reduce-scatter over the sequence overlapped with the matmuls (chunk products by `dot`)."""
    ctx, seq = _context()
    h_spec = P(None, ctx, AXIS, *[None] * (h.ndim - 3))
    w_spec = P(AXIS, *[None] * (w.ndim - 1))
    run = jax.shard_map(_scatter_local, in_specs=(P(), h_spec, w_spec),
                        out_specs=P(None, seq, None), axis_names={AXIS, *(ctx or ())},
                        check_vma=False)
    return run(dot, h, w)
