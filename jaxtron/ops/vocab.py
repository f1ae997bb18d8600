"""The two ends of the model that touch the vocabulary: the embedding lookup, and the LM head with
the cross-entropy, summed over real tokens in chunks of positions so that the float32 logits
[tokens, vocab] never exist whole.

Under a mesh each is a `custom_vjp` of `shard_map`s with its collectives written out, so that the
tables travel like every other weight; docs/operations.md, "The embedding and the head", lists
them.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtron import parallel


def chunks(seq_len: int, chunk: int) -> int:
    """How many equal chunks of at most `chunk` positions split seq_len (1: no chunking)."""
    if chunk <= 0 or chunk >= seq_len:
        return 1
    return seq_len // next(n for n in range(chunk, 0, -1) if seq_len % n == 0)


def _split(a: jax.Array, parts: int) -> jax.Array:
    """[B, T, ...] -> [C, B, T/C, ...]: chunk c holds positions c*T/C ... (c+1)*T/C - 1."""
    return a.reshape(a.shape[0], parts, a.shape[1] // parts, *a.shape[2:]).swapaxes(0, 1)


def _merge(a: jax.Array) -> jax.Array:
    """The inverse of `_split`."""
    a = a.swapaxes(0, 1)
    return a.reshape(a.shape[0], a.shape[1] * a.shape[2], *a.shape[3:])


def logits(x_BTD: jax.Array, head_DV: jax.Array, softcap: float = 0.0) -> jax.Array:
    """float32 logits [B, T, V] of hidden states under the head; with `softcap` > 0 (Gemma 2's
    model.logit_softcap) z -> softcap * tanh(z / softcap)."""
    z = jnp.einsum("btd,dv->btv", x_BTD, head_DV, preferred_element_type=jnp.float32)
    return softcap * jnp.tanh(z / softcap) if softcap else z


def cross_entropy(x_BTD, head_DV, targets_BT, mask_BT, softcap: float = 0.0) -> jax.Array:
    """Summed cross-entropy of the logits of x under the head, over the masked positions."""
    logits_BTV = parallel.constrain(logits(x_BTD, head_DV, softcap),
                                    ("act_batch_io", None, "act_vocab"))
    logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    # the target's logit as a masked sum, not a gather: inside the 1F1B ticks' shard_map (stage
    # manual) XLA's partitioner aborted on the gather with tensor and fsdp beside the stages
    vocab_V = jnp.arange(logits_BTV.shape[-1])
    target_BT = jnp.sum(jnp.where(vocab_V == targets_BT[..., None], logits_BTV, 0.0), axis=-1)
    return jnp.sum(jnp.where(mask_BT, logz_BT - target_BT, 0.0))


def plain_total(x_BTD, head_DV, targets_BT, mask_BT, chunk: int,
                softcap: float = 0.0, strided: bool = False) -> jax.Array:
    """The summed loss over chunks of `chunk` positions, each rematerialized in the backward.
    `strided`: chunk c holds every C-th position from c (else positions c*T/C on), so that
    where the positions are split over devices (sequence parallelism) each holds its share of
    every chunk and the loop's chunk is a slice of each device's own positions. 1f1b's last
    stage takes it (parallel/half_ticks.py): with contiguous chunks, each on one device, XLA
    gathered all of x for every chunk, 16x the bytes at 4096 positions in chunks of 256. The
    whole ticks' pieces keep contiguous chunks: strided, XLA ran their head's forward once more
    (llama3_70b_pp8: +0.5% of the step's matmuls, for 5 GiB less tensor traffic exposed)."""
    parts = chunks(x_BTD.shape[1], chunk)
    if parts == 1:
        return cross_entropy(x_BTD, head_DV, targets_BT, mask_BT, softcap)

    @jax.checkpoint
    def body(total, chunk_xs):
        return total + cross_entropy(*chunk_xs[:1], head_DV, *chunk_xs[1:], softcap), None

    def split(a):  # [B, T, ...] -> [C, B, T/C, ...]
        if not strided:
            return _split(a, parts)
        return jnp.moveaxis(a.reshape(a.shape[0], a.shape[1] // parts, parts, *a.shape[2:]), 2, 0)

    return jax.lax.scan(body, jnp.zeros((), jnp.float32),
                        (split(x_BTD), split(targets_BT), split(mask_BT)))[0]


# ------------------------------------------------------------------------------------------------
# Under a mesh: every mesh axis manual, collectives written out.


def _axes(name: str) -> tuple[str, ...]:
    """The mesh axes RULES gives a logical axis, as a tuple."""
    entry = parallel.spec((name,))[0]
    return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


class _Layout:
    """Mesh axes of the head, the rows and the vocab split, from RULES. `tied`: the head is the
    embedding table W[V, D] (else W[D, V])."""

    def __init__(self, tied: bool):
        self.tied = tied
        self.rows = _axes("act_batch_io")  # x[B_rows, T_(ctx,seq), D]
        # context ranks hold different positions, tokens and targets included; within one, the
        # sequence parallel axes split its positions between blocks
        self.ctx = _axes("act_ctx")
        self.seq = tuple(a for a in _axes("act_seq") if a not in self.ctx)
        self.vocab = _axes("vocab")  # the stored head's vocab dimension
        self.kept = _axes("act_vocab")  # ... still split while computing logits
        self.embed = _axes("embed")
        if self.vocab[:len(self.kept)] != self.kept:
            raise ValueError(f"RULES: act_vocab {self.kept} must lead vocab {self.vocab}")
        self.gathered = self.vocab[len(self.kept):]
        # Tokens split over an axis the head is not split over: its gradient sums there whole.
        self.summed = tuple(a for a in self.rows + self.ctx if a not in self.vocab + self.embed)
        v_dim, d_dim = (0, 1) if tied else (1, 0)
        self.v_dim, self.d_dim = v_dim, d_dim
        names = ["", ""]
        names[v_dim], names[d_dim] = "vocab", "embed"
        self.head_spec = parallel.spec(tuple(names))
        self.x_spec = P(self.rows or None, self.ctx + self.seq or None, None)
        self.row_spec = P(self.rows or None, self.ctx or None)
        self.total_spec = P(self.rows + self.ctx or None)  # each device's summed loss [1]


def _gather_table(w, layout: _Layout, dtype) -> jax.Array:
    """This device's table shard -> the table with vocab split over act_vocab only, in the
    compute dtype and the stored orientation ([V/t, D] tied, else [D, V/t])."""
    w = w.astype(dtype)
    for axis in reversed(layout.gathered):
        w = jax.lax.all_gather(w, axis, axis=layout.v_dim, tiled=True)
    for axis in reversed(layout.embed):
        w = jax.lax.all_gather(w, axis, axis=layout.d_dim, tiled=True)
    return w


def _gather_head(w, layout: _Layout, dtype) -> jax.Array:
    """The LM head [D, V/|act_vocab|] in the compute dtype."""
    table = _gather_table(w, layout, dtype)
    return table.T if layout.tied else table


def _scatter_head_grad(g_DV, layout: _Layout) -> jax.Array:
    """The full head gradient [D, V/|act_vocab|] of this device's rows -> its shard of the
    gradient summed over every row."""
    g = g_DV.T if layout.tied else g_DV
    for axis in layout.embed:
        g = jax.lax.psum_scatter(g, axis, scatter_dimension=layout.d_dim, tiled=True)
    for axis in layout.gathered:
        g = jax.lax.psum_scatter(g, axis, scatter_dimension=layout.v_dim, tiled=True)
    return jax.lax.psum(g, layout.summed) if layout.summed else g


def _seq_ways(layout: _Layout) -> int:
    return math.prod(jax.lax.axis_size(a) for a in layout.seq)


def _chunk_order(a, ways: int, parts: int) -> jax.Array:
    """Whole rows [b, T, ...] -> [C, b, T/C, ...] in the order the chunks are gathered: chunk c
    holds, from each of the `ways` sequence shards in turn, its c-th share."""
    b, t = a.shape[:2]
    a = a.reshape(b, ways, parts, t // (ways * parts), *a.shape[2:])
    return a.swapaxes(1, 2).reshape(b, parts, t // parts, *a.shape[4:]).swapaxes(0, 1)


def _gather_seq(x, layout: _Layout) -> jax.Array:
    """[b, n, ...] shares of the sequence shards -> [b, n * ways, ...], shard-major."""
    for axis in reversed(layout.seq):
        x = jax.lax.all_gather(x, axis, axis=1, tiled=True)
    return x


def _scatter_seq(x, layout: _Layout) -> jax.Array:
    """The inverse of `_gather_seq` for partial sums: summed, each shard keeps its share."""
    for axis in layout.seq:
        x = jax.lax.psum_scatter(x, axis, scatter_dimension=1, tiled=True)
    return x


def _index(axes: tuple[str, ...]) -> jax.Array:
    """This device's position along `axes` taken together (the first one major)."""
    index = 0
    for axis in axes:
        index = index * jax.lax.axis_size(axis) + jax.lax.axis_index(axis)
    return index


def _vocab_offset(width: int, layout: _Layout) -> jax.Array:
    """Where this device's vocab slice of `width` entries starts."""
    return _index(layout.kept) * width


def _chunk_logits(x_bcD, head_DV, layout: _Layout, softcap: float):
    logits_bcV = logits(x_bcD, head_DV, softcap)
    top = jax.lax.stop_gradient(jnp.max(logits_bcV, axis=-1))
    top = jax.lax.pmax(top, layout.kept) if layout.kept else top
    sums = jnp.sum(jnp.exp(logits_bcV - top[..., None]), axis=-1)
    sums = jax.lax.psum(sums, layout.kept) if layout.kept else sums
    return logits_bcV, top + jnp.log(sums)


def _forward_local(x, w, targets, mask, *, layout: _Layout, parts: int, dtype, softcap: float):
    """This device's rows: (its summed loss [1], logsumexp [C, b, T/C] in chunk order).

    Chunk c is gathered over the sequence shards from each one's c-th share of positions, so
    only one chunk of x is ever whole on a device (the loss does not care about order)."""
    head_DV = _gather_head(w, layout, dtype)
    offset = _vocab_offset(head_DV.shape[1], layout)
    ways = _seq_ways(layout)

    def body(total, chunk_xs):
        x_part, targets_bc, mask_bc = chunk_xs
        logits_bcV, lse_bc = _chunk_logits(_gather_seq(x_part, layout), head_DV, layout, softcap)
        local = targets_bc - offset
        mine = (local >= 0) & (local < head_DV.shape[1])
        picked = jnp.take_along_axis(logits_bcV, jnp.where(mine, local, 0)[..., None], -1)[..., 0]
        picked = jnp.where(mine, picked, 0.0)
        picked = jax.lax.psum(picked, layout.kept) if layout.kept else picked
        return total + jnp.sum(jnp.where(mask_bc, lse_bc - picked, 0.0)), lse_bc

    order = functools.partial(_chunk_order, ways=ways, parts=parts)
    total, lse = jax.lax.scan(body, jnp.zeros((), jnp.float32),
                              (_split(x, parts), order(targets), order(mask)))
    return total[None], lse


def _backward_local(x, w, targets, mask, lse, g, *, layout: _Layout, parts: int, dtype,
                    softcap: float):
    """This device's rows: (dx [b, T/|seq|, D], its shard of dW summed over all rows); through
    the soft cap's tanh where there is one."""
    head_DV = _gather_head(w, layout, dtype)
    offset = _vocab_offset(head_DV.shape[1], layout)
    vocab = jnp.arange(head_DV.shape[1])
    ways = _seq_ways(layout)

    def chunk_grads(x_part, targets_bc, mask_bc, lse_bc):
        x_bcD = _gather_seq(x_part, layout)
        logits_bcV = logits(x_bcD, head_DV, softcap)
        probs_bcV = jnp.exp(logits_bcV - lse_bc[..., None])
        hit_bcV = (targets_bc - offset)[..., None] == vocab
        scale_bc = jnp.where(mask_bc, g, 0.0)
        dlogits_bcV = (probs_bcV - hit_bcV) * scale_bc[..., None]
        if softcap:  # d(c tanh(z / c))/dz = 1 - tanh^2
            dlogits_bcV = dlogits_bcV * (1 - jnp.square(logits_bcV / softcap))
        dlogits_bcV = dlogits_bcV.astype(dtype)
        dx_bcD = jnp.einsum("bcv,dv->bcd", dlogits_bcV, head_DV, preferred_element_type=jnp.float32)
        dhead_DV = jnp.einsum("bcd,bcv->dv", x_bcD, dlogits_bcV, preferred_element_type=dtype)
        # Each tensor rank holds the part from its vocab slice: summed, each keeps its share.
        return dhead_DV, _scatter_seq(dx_bcD.astype(dtype), layout)

    order = functools.partial(_chunk_order, ways=ways, parts=parts)
    xs = (_split(x, parts), order(targets), order(mask), lse)
    # Chunk by chunk in Python, the head's gradient summed as it goes; each chunk's inputs wait
    # for the sum so far (an optimization barrier), so that the compiler cannot compute every
    # chunk's [D, V] product first and hold them all. (A scan would be double-buffered by
    # xla.preset=gpu: two sums.)
    dhead_DV, dx = None, []
    for c in range(parts):
        inputs = [a[c] for a in xs]
        if dhead_DV is not None:
            inputs, dhead_DV = jax.lax.optimization_barrier((inputs, dhead_DV))
        part_DV, dx_c = chunk_grads(*inputs)
        dhead_DV = part_DV if dhead_DV is None else dhead_DV + part_DV
        dx.append(dx_c)
    dw = _scatter_head_grad(dhead_DV.astype(dtype), layout)
    return _merge(jnp.stack(dx)), dw.astype(w.dtype)


def sharded_total(x_BTD, w, targets_BT, mask_BT, chunk: int, tied: bool,
                  softcap: float = 0.0) -> jax.Array:
    """The summed loss under the context mesh; `w` the stored head (lm_head [D, V] or, `tied`,
    the embedding table [V, D]); x[B, T, D] in the compute dtype; the logits soft-capped at
    `softcap` > 0."""
    layout = _Layout(tied)
    shape = jax.sharding.get_abstract_mesh().shape
    ways = math.prod(shape[a] for a in layout.seq)
    local = x_BTD.shape[1] // math.prod(shape[a] for a in layout.ctx)  # a context rank's
    # Chunks of at most `chunk` positions, each taking the same share of every sequence shard.
    parts = chunks(local // ways, max(chunk // ways, 1) if chunk > 0 else 0)
    options = {"layout": layout, "parts": parts, "dtype": x_BTD.dtype, "softcap": softcap}
    in_specs = (layout.x_spec, layout.head_spec, layout.row_spec, layout.row_spec)
    lse_spec = P(None, layout.rows or None, layout.ctx or None)
    forward = jax.shard_map(functools.partial(_forward_local, **options), in_specs=in_specs,
                            out_specs=(layout.total_spec, lse_spec), check_vma=False)
    backward = jax.shard_map(functools.partial(_backward_local, **options),
                             in_specs=(*in_specs, lse_spec, P()),
                             out_specs=(layout.x_spec, layout.head_spec), check_vma=False)

    @jax.custom_vjp
    def total(x, w, targets, mask):
        return jnp.sum(forward(x, w, targets, mask)[0])

    def fwd(x, w, targets, mask):
        totals, lse = forward(x, w, targets, mask)
        return jnp.sum(totals), (x, w, targets, mask, lse)

    def bwd(residuals, g):
        x, w, targets, mask, lse = residuals
        dx, dw = backward(x, w, targets, mask, lse, g.astype(jnp.float32))
        return dx, dw, None, None

    total.defvjp(fwd, bwd)
    return total(x_BTD, w, targets_BT, mask_BT)


def _lookup_local(w, tokens, *, layout: _Layout, dtype):
    """This device's rows: x[b, T/|seq|, D], rows of its vocab slice summed over tensor."""
    table_VD = _gather_table(w, layout, dtype)  # the embedding table is stored [V, D]
    local = tokens - _vocab_offset(table_VD.shape[0], layout)
    mine = (local >= 0) & (local < table_VD.shape[0])
    x = jnp.where(mine[..., None], table_VD[jnp.where(mine, local, 0)], 0)
    for axis in layout.seq:  # every token's row is on exactly one tensor rank
        x = jax.lax.psum_scatter(x, axis, scatter_dimension=1, tiled=True)
    return x


def _lookup_grad_local(w, tokens, dx, *, layout: _Layout, dtype):
    """This device's shard of the table's gradient, summed over every row. The sequence shards of
    dx pass round the tensor ring (one in hand at a time, never all of them), each adding the
    rows of its tokens that fall in this device's vocab slice."""
    width = w.shape[layout.v_dim] * math.prod(jax.lax.axis_size(a) for a in layout.gathered)
    local = tokens - _vocab_offset(width, layout)
    rows = jnp.where((local >= 0) & (local < width), local, width)  # out of range: dropped
    ways, me = _seq_ways(layout), _index(layout.seq)
    n = dx.shape[1]
    grad_VD = jnp.zeros((width, dx.shape[-1]), jnp.float32)
    for step in range(ways):
        source = (me + step) % ways  # the shard in hand came from `step` devices on
        rows_bn = jax.lax.dynamic_slice_in_dim(rows, source * n, n, axis=1)
        grad_VD = grad_VD.at[rows_bn.reshape(-1)].add(
            dx.reshape(-1, dx.shape[-1]).astype(jnp.float32), mode="drop")  # summed in float32
        if step < ways - 1:
            dx = _shift_seq(dx, layout, ways)
    return _scatter_head_grad(grad_VD.astype(dtype).T, layout).astype(w.dtype)


def _shift_seq(x, layout: _Layout, ways: int) -> jax.Array:
    """Sequence shard j's x goes to shard j-1 (over the flattened sequence axes)."""
    return jax.lax.ppermute(x, layout.seq, [(j, (j - 1) % ways) for j in range(ways)])


def sharded_embed(table_VD, tokens_BT, dtype) -> jax.Array:
    """x[B, T, D] (rows over act_batch_io, sequence over tensor) of the tokens under the context
    mesh; `table_VD` the stored embedding table."""
    layout = _Layout(tied=True)
    options = {"layout": layout, "dtype": jnp.dtype(dtype)}
    lookup = jax.shard_map(functools.partial(_lookup_local, **options),
                           in_specs=(layout.head_spec, layout.row_spec), out_specs=layout.x_spec,
                           check_vma=False)
    grad = jax.shard_map(functools.partial(_lookup_grad_local, **options),
                         in_specs=(layout.head_spec, layout.row_spec, layout.x_spec),
                         out_specs=layout.head_spec, check_vma=False)

    @jax.custom_vjp
    def embed(w, tokens):
        return lookup(w, tokens)

    def fwd(w, tokens):
        return lookup(w, tokens), (w, tokens)

    def bwd(residuals, dx):
        w, tokens = residuals
        return grad(w, tokens, dx), None

    embed.defvjp(fwd, bwd)
    return embed(table_VD, tokens_BT)
