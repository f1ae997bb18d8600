"""Tensor-parallel matmuls overlapped with their collectives (collective matmul).

The sequence-parallel all-gather before a column-parallel matmul (`gather_matmuls`) and the
reduce-scatter after a row-parallel one (`matmul_scatter`) become |tensor| steps of a matmul
beside a collective-permute, which XLA runs together; each backward is the other ring written out.
docs/operations.md, "Collective matmul", says how.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P
from jax.tree_util import Partial

AXIS = "tensor"
BATCH = ("data", "fsdp", "expert")  # the batch's splits: act_batch in parallel.mesh.RULES
SCATTERED = "scattered"  # the name of matmul_scatter's output, for the remat policies
GATHERED = "gathered"  # the name of gather_matmuls' outputs, for the remat policies
# The remat policies under which gather_matmuls' backward gathers x again: those that keep the
# matmuls' outputs (measured on 8 H100s, llama3_8b TP8, 8 x 8192 rows, save_dots: peak 53.1 ->
# 38.7 GiB, tensor traffic exposed 42.8 -> 6.1 GiB; 2.1 with the outputs kept too, GATHERED).
# Under the others the recomputed forward's ring brings the chunks, and a second ring cost the
# 128k preset 79 GiB more traffic exposed.
REGATHER = ("none", "save_dots", "offload_dots")
# dot(x, w, contract) -> x's last `contract` dimensions against w's first (jnp.tensordot's), as
# a pytree (a `Partial`): the arrays it holds (FP8 scales) enter the shard_map as its arguments
Dot = Partial


def _context() -> tuple[tuple[str, ...] | None, str | tuple[str, ...]]:
    """(the context axis when it splits the sequence, else None; the sequence's split between
    blocks): under context parallelism each context rank gathers and scatters its own positions,
    so the shard_maps are manual over `context` too."""
    mesh = jax.sharding.get_abstract_mesh()
    kinds = dict(zip(mesh.axis_names, mesh.axis_types))
    if mesh.shape.get("context", 1) == 1 or kinds["context"] == jax.sharding.AxisType.Manual:
        return None, AXIS
    return ("context",), ("context", AXIS)


def _batch(rows: int) -> tuple[str, ...] | None:
    """("fsdp",) where the shard_maps take the batch's fsdp split over as well: each step's
    weight-gradient sum is then this device's own, added up over fsdp once per weight, where the
    partitioner had reduced each step's (an all-reduce per step: llama3_70b TP8 x FSDP8, 127.5
    GiB per step where the gradient's one reduce-scatter is 16.4). Only where fsdp is the batch's
    one split (data and expert 1): where data splits it too the sum over data waits until the
    step's last microbatch, which a manual axis would bring into every call. None: the rows stay
    the partitioner's."""
    mesh = jax.sharding.get_abstract_mesh()
    sizes, kinds = mesh.shape, dict(zip(mesh.axis_names, mesh.axis_types))
    fsdp = sizes.get("fsdp", 1)
    if fsdp == 1 or kinds["fsdp"] == jax.sharding.AxisType.Manual or rows % fsdp:
        return None
    return None if any(sizes.get(a, 1) > 1 for a in BATCH if a != "fsdp") else ("fsdp",)


def _shift_left(x: jax.Array, n: int) -> jax.Array:
    """Device j's x goes to device j-1 (the last device's to n-1's neighbour, device n-1 from 0)."""
    return jax.lax.ppermute(x, AXIS, [(j, (j - 1) % n) for j in range(n)])


def _chunk(x: jax.Array, index: jax.Array, size: int) -> jax.Array:
    """Sequence chunk `index` of x[B, T, ...], `size` positions long."""
    return jax.lax.dynamic_slice_in_dim(x, index * size, size, axis=1)


def _ring_gather(chunk: jax.Array, products, absorb, state):
    """Every device's sequence chunk in turn, this device's first: at step s the chunk in hand is
    chunk (me + s) % n, and `products(s, chunk)` are computed while the next one travels in (a
    collective-permute per step); then `absorb(s, products, state) -> state`."""
    n = jax.lax.axis_size(AXIS)
    for step in range(n):
        following = _shift_left(chunk, n) if step < n - 1 else None  # in flight meanwhile
        found = products(step, chunk)
        # Tie the received chunk to this step's products: the next step's matmuls then follow
        # this step's, and XLA can merge neither them nor their sums into matmuls that wait for
        # several permutes (which would then run back to back, synchronous).
        found, chunk = jax.lax.optimization_barrier((found, following))
        state = absorb(step, found, state)
    return state


def _ring_scatter(inputs, part, state):
    """The sum over devices of every device's part for this device's sequence chunk: at step s
    this device adds its part for chunk (me + 1 + s) % n, `part(s, inputs(s), state) -> (part,
    state)`, to the running sum that arrived, which then moves on. After n - 1 moves left, the
    sum that ends here is for this device's own chunk, every device's part added once."""
    n = jax.lax.axis_size(AXIS)
    total, state = part(0, inputs(0), state)
    for step in range(1, n):
        moving = _shift_left(total, n)  # in flight while this step's matmuls run
        # This step's inputs (and the sums so far) wait for the previous sum: the matmuls stay
        # one per step, none merged with another step's.
        (found, state), _ = jax.lax.optimization_barrier(((inputs(step), state), total))
        y, state = part(step, found, state)
        # The sum's add stays out of the matmul: XLA (jax 0.12) fused it into the GEMM as an
        # epilogue, and the GEMM then waited for the permute it was to hide
        # (docs/performance.md, "jax 0.12 against 0.10.2").
        total = moving + jax.lax.optimization_barrier(y)
    return total, state


def _pullback(dot: Dot, x: jax.Array, w: jax.Array, contract: int, g: jax.Array):
    """(dot's arrays, x, w) cotangents of dot(x, w, contract) for the output's cotangent g: the
    dot's own backward (FP8's included); its forward product is unused, and dropped."""
    _, pull = jax.vjp(lambda d, a, b: d(a, b, contract), dot, x, w)
    return pull(g)


def _add(total, part):
    return part if total is None else jax.tree.map(jnp.add, total, part)


# The local views below run inside a shard_map over `tensor`: x[B, T/n, D] is this device's
# chunk, h[B, T, ...] the whole sequence, the weights split over tensor along their output
# (gather) or contracting (scatter) dimensions. Each is a custom VJP whose backward is itself a
# collective matmul. Autodiff's transpose of the loops carried no barriers (a barrier's zero
# cotangents do not pass it), and jax 0.12's XLA then ran the backward's permutes back to back,
# their matmuls after them (docs/performance.md, "jax 0.12 against 0.10.2"). This device's
# index is a residual: read again in the backward (axis_index) inside a pipeline's stages under
# remat=full, jax 0.10.2's SPMD partitioner aborted on the slices it placed.

@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _gather_local(regather, dots, x_BtD, *weights):
    """-> for each weight, x gathered over the sequence times it: [B, T, ...local out dims].
    `regather`: the backward gathers x's chunks again (gather_matmuls)."""
    return _gather_forward(regather, dots, x_BtD, *weights)[0]


def _gather_forward(regather, dots, x_BtD, *weights):
    n, me = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    t = x_BtD.shape[1]
    outs = [jnp.zeros((x_BtD.shape[0], t * n, *w.shape[1:]), x_BtD.dtype) for w in weights]

    def products(step, chunk):
        return chunk, [dot(chunk, w, 1) for dot, w in zip(dots, weights)]

    def absorb(step, found, state):
        (chunk, ys), (outs, chunks) = found, state
        where = ((me + step) % n) * t  # the chunk in hand came from device me + step
        outs = [jax.lax.dynamic_update_slice_in_dim(o, y, where, axis=1) for o, y in zip(outs, ys)]
        return outs, chunks if regather else (*chunks, chunk)

    outs, chunks = _ring_gather(x_BtD, products, absorb, (outs, ()))
    return tuple(outs), (dots, x_BtD if regather else chunks, weights, me)


def _gather_backward(regather, residuals, g_outs):
    """dx: sum_w g_w W_w^T reduce-scattered over the sequence by `_ring_scatter`; each weight's
    gradient summed over the chunks on the way, the chunks the forward's, or with `regather`
    gathered again beside it: this device's own first, as in the forward, so that every permute
    has a step's matmuls beside it (dw pairs chunk c of x with chunk c of g, in any order)."""
    dots, x, weights, me = residuals
    n = jax.lax.axis_size(AXIS)
    t = (x if regather else x[0]).shape[1]

    def inputs(step):  # the sum in hand at step s is for chunk (me + 1 + s) % n
        for_dx = [_chunk(g, (me + 1 + step) % n, t) for g in g_outs]
        return for_dx, [_chunk(g, (me + step) % n, t) for g in g_outs] if regather else for_dx

    def part(step, g_cs, state):
        (for_dx, for_dw), (sums, chunks) = g_cs, state
        if regather:  # x's chunk (me + step) % n in hand, the next one in flight meanwhile
            x_c, following = chunks, _shift_left(chunks, n) if step < n - 1 else None
        else:  # the forward's step s held chunk (me + s) % n
            x_c, following = chunks[(1 + step) % n], chunks
        pulled = [_pullback(dot, x_c, w, 1, g) for dot, w, g in zip(dots, weights, for_dw)]
        if for_dx is not for_dw:  # dx of a dot does not read x: only its g . w^T is kept
            dx_pulled = [_pullback(dot, x_c, w, 1, g) for dot, w, g in zip(dots, weights, for_dx)]
        else:
            dx_pulled = pulled
        dx = functools.reduce(jnp.add, [d_x for _, d_x, _ in dx_pulled])
        return dx, (_add(sums, [(d_dot, d_w) for d_dot, _, d_w in pulled]), following)

    dx, (sums, _) = _ring_scatter(inputs, part, (None, x))
    return ([d_dot for d_dot, _ in sums], dx, *[d_w for _, d_w in sums])


_gather_local.defvjp(_gather_forward, _gather_backward)


@jax.custom_vjp
def _scatter_local(dot, h_BT_, w):
    """h[B, T, ...contracting, local] times w[...contracting, D] -> out[B, T/n, D]."""
    return _scatter_forward(dot, h_BT_, w)[0]


def _scatter_forward(dot, h_BT_, w):
    n, me = jax.lax.axis_size(AXIS), jax.lax.axis_index(AXIS)
    t, contract = h_BT_.shape[1] // n, h_BT_.ndim - 2
    inputs = lambda step: _chunk(h_BT_, (me + 1 + step) % n, t)
    total, _ = _ring_scatter(inputs, lambda step, h_c, _: (dot(h_c, w, contract), None), None)
    return total, (dot, h_BT_, w, me)


def _scatter_backward(residuals, g_BtD):
    """The output's cotangent gathered over the sequence by `_ring_gather`: each chunk's h
    gradient (g_c W^T) placed at its position, w's summed over the chunks on the way."""
    dot, h_BT_, w, me = residuals
    n = jax.lax.axis_size(AXIS)
    t, contract = g_BtD.shape[1], h_BT_.ndim - 2

    def products(step, g_c):
        return _pullback(dot, _chunk(h_BT_, (me + step) % n, t), w, contract, g_c)

    def absorb(step, found, state):
        (d_dot, d_h, d_w), (dh, sums) = found, state
        dh = jax.lax.dynamic_update_slice_in_dim(dh, d_h, ((me + step) % n) * t, axis=1)
        return dh, _add(sums, (d_dot, d_w))

    dh, (d_dot, d_w) = _ring_gather(g_BtD, products, absorb, (jnp.zeros_like(h_BT_), None))
    return d_dot, dh, d_w


_scatter_local.defvjp(_scatter_forward, _scatter_backward)


def gather_matmuls(x_BTD: jax.Array, *weights: jax.Array, dots: Sequence[Dot] | None = None,
                   regather: bool = False) -> tuple[jax.Array, ...]:
    """x[B, T_tensor, D] times each weight [D, X_tensor, ...] -> outputs [B, T, X_tensor, ...],
    the all-gather of x over the sequence overlapped with the matmuls. `dots`: how each weight's
    chunk products are computed (`jnp.tensordot` unless given: the model's FP8 matmuls), their
    arrays replicated over tensor. `regather`: the backward gathers x's chunks again, beside its
    matmuls, instead of keeping the forward's (the whole sequence per gather; under a remat
    policy that saves the matmuls, recomputed: the forward's ring again with no matmul beside
    its permutes). Kept where the forward is recomputed anyway (REGATHER says where not)."""
    (ctx, seq), rows = _context(), _batch(x_BTD.shape[0])
    w_specs = tuple(P(None, AXIS, *[None] * (w.ndim - 2)) for w in weights)
    out_specs = tuple(P(rows, ctx, AXIS, *[None] * (w.ndim - 2)) for w in weights)
    dots = dots or [Partial(jnp.tensordot)] * len(weights)
    run = jax.shard_map(functools.partial(_gather_local, regather),
                        in_specs=(P(), P(rows, seq, None), *w_specs), out_specs=out_specs,
                        axis_names={AXIS, *(ctx or ()), *(rows or ())}, check_vma=False)
    # named for model.remat=save_dots, which keeps them: recomputed, the ring's permutes ran
    # again (its barriers tie each step's products to the chunk received)
    return tuple(checkpoint_name(y, GATHERED) for y in run(list(dots), x_BTD, *weights))


def matmul_scatter(h: jax.Array, w: jax.Array, dot: Dot = Partial(jnp.tensordot)) -> jax.Array:
    """h[B, T, X_tensor, ...] times w[X_tensor, ..., D] summed over X -> out[B, T_tensor, D], the
    reduce-scatter over the sequence overlapped with the matmuls (chunk products by `dot`)."""
    (ctx, seq), rows = _context(), _batch(h.shape[0])
    h_spec = P(rows, ctx, AXIS, *[None] * (h.ndim - 3))
    w_spec = P(AXIS, *[None] * (w.ndim - 1))
    run = jax.shard_map(_scatter_local, in_specs=(P(), h_spec, w_spec),
                        out_specs=P(rows, seq, None),
                        axis_names={AXIS, *(ctx or ()), *(rows or ())}, check_vma=False)
    # named for model.remat=save_dots, which keeps it: recomputed, it ran the ring's permutes
    # again with the matmuls' saved outputs, nothing beside them
    return checkpoint_name(run(dot, h, w), SCATTERED)
