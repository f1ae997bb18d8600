"""Attention under context parallelism: each rank's queries against K and V gathered over
`context`, causal by true position, packed documents kept apart.

`xla` masks by segment ids and natural positions over all keys (the reference); `cudnn` runs each
of a rank's two pieces as a diagonal block and a prefix window, merged by their log-sum-exps.
V may have another head size than q and k (latent attention): the output has v's.
docs/operations.md, "Attention over context ranks", says why a gather and not a ring.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtron import parallel
from jaxtron.ops import attention as kernels
from jaxtron.parallel import context

AXIS = context.AXIS


def attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, impl: str = "xla") -> jax.Array:
    """Causal attention of a balanced batch whose sequence is split over `context`: q, k, v
    [B, T, heads, H] (v's H may differ from q's and k's; the output has v's) and segment ids
    [B, T] in balanced order. Runs per device in a `shard_map` over every axis not already
    manual (the pipeline's stages are)."""
    mesh = jax.sharding.get_abstract_mesh()
    manual = jax.sharding.AxisType.Manual
    free = {name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind != manual}
    q_spec = parallel.spec_here(("act_batch", "act_ctx", "act_heads", None))
    kv_spec = parallel.spec_here(("act_batch", "act_ctx", "act_kv_heads", None))
    local = _sealed if impl == "cudnn" else _xla_local
    run = jax.shard_map(functools.partial(local, ways=mesh.shape[AXIS]),
                        in_specs=(q_spec, kv_spec, kv_spec, P(*q_spec[:2])), out_specs=q_spec,
                        axis_names=free, check_vma=False)
    return run(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT)


def _gather(x: jax.Array) -> jax.Array:
    """This rank's [b, 2c, ...] -> every rank's [b, T, ...], balanced order."""
    return jax.lax.all_gather(x, AXIS, axis=1, tiled=True)


def _xla_local(q, k, v, segments, *, ways: int) -> jax.Array:
    """q[b, 2c, n, H] of this rank against the gathered keys, masked by natural position."""
    segments_all = _gather(segments)
    t = segments_all.shape[1]
    position = jnp.asarray(_order(t, ways))  # natural position of each balanced one
    mine = jax.lax.dynamic_slice_in_dim(position, jax.lax.axis_index(AXIS) * q.shape[1],
                                        q.shape[1])
    mask = ((segments[:, :, None] == segments_all[:, None, :])
            & (position[None, None, :] <= mine[None, :, None]))
    return kernels.masked_attention(q, _gather(k), _gather(v), mask[:, None, None])


@functools.lru_cache(maxsize=None)
def _order(t: int, ways: int) -> np.ndarray:
    """`context.order`, made once per shape."""
    return context.order(t, ways)


# ------------------------------------------------------------------------------------------------
# cuDNN: two fused calls per piece, merged; the backward given the merged statistics.


def _cudnn():
    from jax._src.cudnn import fused_attention_stablehlo as fa  # the kernels, with statistics
    return fa


def _mask_type(fa, padded: bool, causal: bool):
    if padded:
        return fa.MaskType.PADDING_CAUSAL if causal else fa.MaskType.PADDING
    return fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK


def cudnn_forward(q, k, v, bias, q_len, kv_len, causal: bool):
    """cuDNN's fused attention forward: (out [B, T, N, v's H], log-sum-exp [B, N, T] float32 of
    the scores scaled by q's H). `bias` [B, 1, T, S] or None; `q_len`/`kv_len` [B] (padding mask:
    rows and keys past them are out) or None; `causal`: top-left causal mask. jax.nn's entry
    would refuse a v head size other than q's; this one takes it (cuDNN's latent attention)."""
    fa = _cudnn()
    out, lse = fa.dot_product_attention(q, k, v, bias=bias, q_seqlen=q_len, kv_seqlen=kv_len,
                                        scale=q.shape[-1] ** -0.5,
                                        mask_type=_mask_type(fa, q_len is not None, causal),
                                        return_residual=True)
    return out, lse


def cudnn_backward(q, k, v, bias, q_len, kv_len, causal: bool, out, lse, d_out):
    """cuDNN's fused attention backward from a given output and log-sum-exp: (dq, dk, dv). The
    bias gets no gradient (it is a mask)."""
    fa = _cudnn()
    unused = jnp.zeros(0, q.dtype)
    grads = fa._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused if bias is None else bias, unused if q_len is None else q_len,
        unused if kv_len is None else kv_len, unused, unused, unused, unused, lse, out, d_out,
        scale=q.shape[-1] ** -0.5, seed=42, dropout_rate=0.0,
        variadic_args=(bias is not None, False),
        mask_type=_mask_type(fa, q_len is not None, causal),
        layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None, **_no_score_mod(fa))
    return tuple(grads[:3])


def _no_score_mod(fa) -> dict:
    """The backward primitive's `score_mod` parameter (flex attention, jax 0.12 on), none here;
    jax 0.10 and 0.11 have no such parameter."""
    parameters = inspect.signature(fa._dot_product_attention_bwd_impl).parameters
    return {"score_mod": None} if "score_mod" in parameters else {}


def _pieces(x: jax.Array) -> jax.Array:
    """[b, 2c, ...] -> [2b, c, ...]: the rank's two pieces side by side as rows."""
    return x.reshape(x.shape[0] * 2, x.shape[1] // 2, *x.shape[2:])


def _unpieces(x: jax.Array) -> jax.Array:
    return x.reshape(x.shape[0] // 2, x.shape[1] * 2, *x.shape[2:])


class _Prefix:
    """Where each piece's first document started, per row, from the gathered segment ids:
    `start` a0 [b] (a natural position), `length` jc - a0 [b], `rows` n0 [b] (its rows in the
    piece), `window` L (static: the longest prefix a piece j can have), `has` [b, c] (rows that
    see a prefix)."""

    def __init__(self, segments_piece, natural_segments, piece: jax.Array, window: int):
        c = segments_piece.shape[1]
        first = segments_piece[:, 0]
        self.start = jnp.argmax(natural_segments == first[:, None], axis=1).astype(jnp.int32)
        self.length = piece * c - self.start
        self.rows = jnp.sum(segments_piece == first[:, None], axis=1).astype(jnp.int32)
        self.window = window
        self.has = (jnp.arange(c)[None] < self.rows[:, None]) & (self.length[:, None] > 0)

    def take(self, kv_natural_padded):
        return jax.vmap(lambda x, a: jax.lax.dynamic_slice_in_dim(x, a, self.window))(
            kv_natural_padded, self.start)

    def put(self, g_window, total: int):
        """A window's gradient [b, L, ...] -> [b, total, ...] zero outside it."""
        zeros = jnp.zeros((total, *g_window.shape[2:]), g_window.dtype)
        return jax.vmap(lambda g, a: jax.lax.dynamic_update_slice_in_dim(zeros, g, a, 0))(
            g_window, self.start)

    def kv_len(self):
        return jnp.maximum(self.length, 1)


def _prefixes(segments, segments_all, rank, ways: int) -> list[_Prefix]:
    """The rank's two pieces' prefixes, from its segment ids and everyone's (balanced order)."""
    c = segments.shape[1] // 2
    natural = context.to_natural(segments_all, ways)
    return [_Prefix(segments[:, :c], natural, rank, (ways - 1) * c),
            _Prefix(segments[:, c:], natural, 2 * ways - 1 - rank, (2 * ways - 1) * c)]


def _padded_natural(x_all, ways: int, pad: int):
    """Everyone's [b, T, ...] in balanced order -> natural order, `pad` zero positions after."""
    x = context.to_natural(x_all, ways)
    return jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2))


def _diagonal_bias(segments, dtype):
    same = _pieces(segments)[:, :, None] == _pieces(segments)[:, None, :]
    return jnp.where(same, jnp.asarray(0, dtype), jnp.finfo(dtype).min / 2)[:, None]


def _merge(parts):
    """[(out [b, c, N, H], lse [b, N, c])] -> the merged (out float32, lse)."""
    lse = functools.reduce(jnp.logaddexp, [part_lse for _, part_lse in parts])
    out = sum(o.astype(jnp.float32) * jnp.exp(part_lse - lse).transpose(0, 2, 1)[..., None]
              for o, part_lse in parts)
    return out, lse


def _forward(q, k, v, segments, k_all, v_all, segments_all, rank, ways):
    """One rank: (out [b, 2c, N, H], the merged log-sum-exp [b, 2, N, c]), given its own q, k,
    v and segment ids and everyone's K, V and segment ids (gathered, balanced order)."""
    prefixes = _prefixes(segments, segments_all, rank, ways)
    c, pad = segments.shape[1] // 2, prefixes[1].window
    bias = _diagonal_bias(segments, q.dtype)
    out_d, lse_d = cudnn_forward(_pieces(q), _pieces(k), _pieces(v), bias, None, None, True)
    out_d, lse_d = _unpieces(out_d), lse_d.reshape(q.shape[0], 2, *lse_d.shape[1:])
    k_nat, v_nat = (_padded_natural(x, ways, pad) for x in (k_all, v_all))
    outs, lses = [], []
    for i, prefix in enumerate(prefixes):
        rows = slice(i * c, (i + 1) * c)
        out_p, lse_p = cudnn_forward(q[:, rows], prefix.take(k_nat), prefix.take(v_nat), None,
                                     prefix.rows, prefix.kv_len(), False)
        out, lse = _merge([(out_d[:, rows], lse_d[:, i]),
                           (jnp.where(prefix.has[..., None, None], out_p, 0),
                            jnp.where(prefix.has[:, None, :], lse_p, -jnp.inf))])
        outs.append(out)
        lses.append(lse)
    return jnp.concatenate(outs, 1).astype(q.dtype), jnp.stack(lses, 1)


def _backward(q, k, v, segments, k_all, v_all, segments_all, rank, ways, out, lse, d_out):
    """One rank's gradients: dq, and of its own k and v (the diagonal calls'), and of everyone's
    K and V (the prefix windows', float32, balanced order: summed over the ranks)."""
    prefixes = _prefixes(segments, segments_all, rank, ways)
    c, pad = segments.shape[1] // 2, prefixes[1].window
    bias = _diagonal_bias(segments, q.dtype)
    dq, dk, dv = cudnn_backward(_pieces(q), _pieces(k), _pieces(v), bias, None, None, True,
                                _pieces(out), lse.reshape(-1, *lse.shape[2:]), _pieces(d_out))
    dq, dk, dv = _unpieces(dq).astype(jnp.float32), _unpieces(dk), _unpieces(dv)
    k_nat, v_nat = (_padded_natural(x, ways, pad) for x in (k_all, v_all))
    total = k_nat.shape[1]
    dk_nat = jnp.zeros(k_nat.shape, jnp.float32)
    dv_nat = jnp.zeros(v_nat.shape, jnp.float32)
    dq_parts = []
    for i, prefix in enumerate(prefixes):
        rows = slice(i * c, (i + 1) * c)
        d_rows = jnp.where(prefix.has[..., None, None], d_out[:, rows], 0).astype(d_out.dtype)
        dq_p, dk_w, dv_w = cudnn_backward(q[:, rows], prefix.take(k_nat), prefix.take(v_nat),
                                          None, prefix.rows, prefix.kv_len(), False,
                                          out[:, rows], lse[:, i], d_rows)
        dq_parts.append(jnp.where(prefix.has[..., None, None], dq_p, 0))
        dk_nat = dk_nat + prefix.put(dk_w.astype(jnp.float32), total)
        dv_nat = dv_nat + prefix.put(dv_w.astype(jnp.float32), total)
    dq = (dq + jnp.concatenate(dq_parts, 1)).astype(q.dtype)
    balanced = lambda g: context.to_balanced(g[:, :total - pad], ways)
    return dq, dk, dv, balanced(dk_nat), balanced(dv_nat)


def _gathered(k, v, segments):
    return _gather(k), _gather(v), _gather(segments), jax.lax.axis_index(AXIS)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _cp_cudnn(q, k, v, segments, ways):
    return _forward(q, k, v, segments, *_gathered(k, v, segments), ways)[0]


def _cp_cudnn_fwd(q, k, v, segments, ways):
    out, lse = _forward(q, k, v, segments, *_gathered(k, v, segments), ways)
    return out, (q, k, v, segments, out, lse)


def _cp_cudnn_bwd(ways, residuals, d_out):
    q, k, v, segments, out, lse = residuals  # K and V gathered again: not kept
    dq, dk, dv, dk_all, dv_all = _backward(q, k, v, segments, *_gathered(k, v, segments), ways,
                                           out, lse, d_out)
    scatter = lambda g: jax.lax.psum_scatter(g, AXIS, scatter_dimension=1, tiled=True)
    dk = (dk.astype(jnp.float32) + scatter(dk_all)).astype(k.dtype)
    dv = (dv.astype(jnp.float32) + scatter(dv_all)).astype(v.dtype)
    return dq, dk, dv, None


_cp_cudnn.defvjp(_cp_cudnn_fwd, _cp_cudnn_bwd)


def _sealed(q, k, v, segments, *, ways: int) -> jax.Array:
    """`_cp_cudnn` behind the two remats of `attention._sealed` (the zero-element placeholders of
    jax's cuDNN calls stay inside the manual program)."""
    kernel = lambda *args: _cp_cudnn(*args, ways)
    inner = jax.checkpoint(kernel, policy=jax.checkpoint_policies.nothing_saveable,
                           prevent_cse=False)
    outer = jax.checkpoint(inner, policy=kernels._from_arrays, prevent_cse=False)
    return outer(q, k, v, segments)


# ------------------------------------------------------------------------------------------------
# The same calls on one device, the ranks simulated (the start-up self-check on a GPU).


def _ranks(x, ways: int):
    """Natural [b, T, ...] -> [C, b, 2c, ...]: each rank's two pieces."""
    x = context.to_balanced(x, ways)
    return jnp.moveaxis(x.reshape(x.shape[0], ways, -1, *x.shape[2:]), 1, 0)


def _from_ranks(x, ways: int):
    """The inverse of `_ranks`."""
    x = jnp.moveaxis(x, 0, 1)
    return context.to_natural(x.reshape(x.shape[0], -1, *x.shape[3:]), ways)


def _ranks_of(ways: int, *xs):
    return [_ranks(x, ways) for x in xs]


def _each_rank(fn, ways: int, own, everyone, *per_rank):
    """fn for every rank in turn (jax's batching rule of the cuDNN call does not take a batched
    bias), its outputs stacked [C, ...]."""
    outs = [fn(*(x[r] for x in own), *everyone, jnp.int32(r), ways, *(x[r] for x in per_rank))
            for r in range(ways)]
    return [jnp.stack(parts) for parts in zip(*outs)]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _simulated(q, k, v, segments, ways):
    return _simulated_fwd(q, k, v, segments, ways)[0]


def _simulated_fwd(q, k, v, segments, ways):
    everyone = [context.to_balanced(x, ways) for x in (k, v, segments)]
    out, lse = _each_rank(_forward, ways, _ranks_of(ways, q, k, v, segments), everyone)
    return _from_ranks(out, ways), (q, k, v, segments, out, lse)


def _simulated_bwd(ways, residuals, d_out):
    q, k, v, segments, out, lse = residuals
    everyone = [context.to_balanced(x, ways) for x in (k, v, segments)]
    dq, dk, dv, dk_all, dv_all = _each_rank(_backward, ways, _ranks_of(ways, q, k, v, segments),
                                            everyone, out, lse, _ranks(d_out, ways))
    add = lambda own, all_: (_from_ranks(own.astype(jnp.float32), ways)
                             + context.to_natural(all_.sum(0), ways)).astype(k.dtype)
    return _from_ranks(dq, ways), add(dk, dk_all), add(dv, dv_all), None


_simulated.defvjp(_simulated_fwd, _simulated_bwd)


def simulated(ways: int):
    """The cuDNN form on one device with `ways` context ranks simulated (each rank's calls in
    turn, their gathers given whole and their reduce-scatters summed): a kernel q, k, v, segments ->
    out in natural order, for the start-up self-check before a context-parallel run."""
    return lambda q, k, v, segments: _simulated(q, k, v, segments, ways)
