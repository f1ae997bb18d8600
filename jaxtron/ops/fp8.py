"""FP8 matmuls with per-tensor scales, for Hopper's FP8 tensor cores (`model.fp8`).

Operands are scaled and rounded to float8_e4m3fn (the backward's gradient to float8_e5m2),
multiplied in FP8 and scaled back; `tensorwise` scales by this step's amax, `delayed` by the
amax history kept in the train state (`History`), which the step's own amaxes feed.
docs/operations.md, "FP8 matmuls", says how and why.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.tree_util import Partial

from jaxtron.parallel import constrain

MODES = ("none", "tensorwise", "delayed")
FORWARD = jnp.float8_e4m3fn  # weights and activations
BACKWARD = jnp.float8_e5m2  # gradients


def scale(x: jax.Array, fmt=FORWARD) -> jax.Array:
    """float32 scalar s with max|x| / s = the format's largest value (1 for an all-zero x)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    largest = float(jnp.finfo(fmt).max)
    return jax.lax.stop_gradient(jnp.where(amax > 0, amax / largest, 1.0))


def history_scale(history: jax.Array, fmt=FORWARD) -> jax.Array:
    """The delayed scale: the largest amax in `history` [H] / `fmt`'s largest value, 1 while the
    history is all zeros (a run's first step). Read from the history alone, so that no cast
    waits on its tensor's own amax."""
    amax = jnp.max(jax.lax.stop_gradient(history))
    largest = float(jnp.finfo(fmt).max)
    return jax.lax.stop_gradient(jnp.where(amax > 0, amax / largest, 1.0))


def quantize(x: jax.Array, s: jax.Array, fmt) -> jax.Array:
    """x / s rounded to `fmt` (saturating at its largest value, never inf)."""
    largest = float(jnp.finfo(fmt).max)
    return jnp.clip(x.astype(jnp.float32) / s, -largest, largest).astype(fmt)


def _scaled_dot(a_q, b_q, s, contracting, dtype) -> jax.Array:
    """a_q . b_q over the given dimensions as an FP8 matmul, its result in `dtype` (the compute
    dtype: what a remat policy that keeps matmul outputs keeps), times s in float32."""
    out = jax.lax.dot_general(a_q, b_q, (contracting, ((), ())), preferred_element_type=dtype)
    return (out.astype(jnp.float32) * s).astype(dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def dot(x: jax.Array, w: jax.Array, contract: int, x_scale: jax.Array, w_scale: jax.Array,
        g_scale: jax.Array | None = None) -> jax.Array:
    """`jnp.tensordot(x, w, contract)` in FP8: x's last `contract` dimensions against w's first,
    x and w quantized with the given scales (`scale`), the result in x's dtype. The backward
    scales the gradient by `g_scale` (delayed: from its history), or where that is None by the
    gradient's own amax (tensorwise), over the gradient as this program holds it: inside a
    shard_map (the collective matmuls' steps) this device's chunk, with no collective."""
    return _dot_fwd(x, w, contract, x_scale, w_scale, g_scale)[0]


def _contracting(x_ndim: int, contract: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(range(x_ndim - contract, x_ndim)), tuple(range(contract))


def _dot_fwd(x, w, contract, x_scale, w_scale, g_scale):
    x_q, w_q = quantize(x, x_scale, FORWARD), quantize(w, w_scale, FORWARD)
    y = _scaled_dot(x_q, w_q, x_scale * w_scale, _contracting(x.ndim, contract), x.dtype)
    # w's dtype, for dw; g_scale None (tensorwise): the gradient's own amax, decided here at
    # trace time, so that a given scale's cast never waits on the gradient's reduction
    return y, (x_q, w_q, x_scale, w_scale, g_scale, jnp.zeros((), w.dtype))


def _dot_bwd(contract, residuals, g):
    x_q, w_q, x_scale, w_scale, given, w_like = residuals
    g_scale = scale(g, BACKWARD) if given is None else given
    g_q = quantize(g, g_scale, BACKWARD)
    a = x_q.ndim - contract  # x[A..., K...], w[K..., N...], g[A..., N...]
    n = w_q.ndim - contract
    # dx[A..., K...] = g . w over N; dw[K..., N...] = x . g over A
    dx = _scaled_dot(g_q, w_q, g_scale * w_scale,
                     (tuple(range(a, a + n)), tuple(range(contract, contract + n))), g.dtype)
    dw = _scaled_dot(x_q, g_q, x_scale * g_scale, (tuple(range(a)), tuple(range(a))), w_like.dtype)
    return (dx, dw, jnp.zeros_like(x_scale), jnp.zeros_like(w_scale),
            None if given is None else jnp.zeros_like(given))


dot.defvjp(_dot_fwd, _dot_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4))
def _weight(w, w_scale, dtype, stored: tuple[str, ...] | None, gathered: tuple[str, ...] | None):
    return _weight_fwd(w, w_scale, dtype, stored, gathered)[0]


def _weight_fwd(w, w_scale, dtype, stored, gathered):
    w_q = quantize(w, w_scale, FORWARD)
    if gathered is not None:
        w_q = constrain(w_q, gathered)  # the all-gather moves FP8: half the bytes of bf16
    return (w_q.astype(jnp.float32) * w_scale).astype(dtype), jnp.zeros((), w.dtype)


def _weight_bwd(dtype, stored, gathered, w_like, g):
    if stored is not None:
        g = constrain(g, stored)  # reduce-scattered straight to the weight's own sharding
    return g.astype(w_like.dtype), jnp.zeros((), jnp.float32)


_weight.defvjp(_weight_fwd, _weight_bwd)


def weight(w: jax.Array, w_scale: jax.Array, dtype, stored: tuple[str, ...] | None = None,
           gathered: tuple[str, ...] | None = None) -> jax.Array:
    """A stored weight w (the float32 master, sharded by its logical axes `stored`) as `dot`
    reads it: quantized to e4m3 with `w_scale`, all-gathered to the logical axes `gathered`
    (None: left to the compiler) in FP8, and returned in `dtype` (every value on the FP8 grid,
    so that `dot` quantizes it again exactly). Its gradient passes straight through, pinned to
    `stored` (the reduce-scatter's layout)."""
    return _weight(w, w_scale, jnp.dtype(dtype), stored, gathered)


class Sites(NamedTuple):
    """The histories of one group of projections that read the same input: the input's [H],
    and per weight the weight's and its output gradient's."""

    x: jax.Array
    w: tuple[jax.Array, ...]
    g: tuple[jax.Array, ...]


class History(nnx.Variable):
    """Amax histories of a layer's FP8 tensors, [tensors, H] with the newest in slot 0: the
    train state's "fp8" under model.fp8=delayed (H = model.fp8_history), a one-slot tree of
    zeros each step under tensorwise (where they only carry the amaxes out for the metrics)."""


def histories(mode: str, length: int, inputs: int, weights: int) -> dict[str, History]:
    """A module's amax histories under model.fp8=`mode` (none: none): its matmuls' `inputs`,
    `weights` and their output gradients, `length` (model.fp8_history) slots each under
    delayed, one under tensorwise. The module holds them as attributes fp8_x, fp8_w, fp8_g."""
    if mode == "none":
        return {}
    slots = length if mode == "delayed" else 1
    make = lambda rows: History(jnp.zeros((rows, slots), jnp.float32),
                                out_sharding=(None, None), eager_sharding=False)
    return {"fp8_x": make(inputs), "fp8_w": make(weights), "fp8_g": make(weights)}


def sites(module: nnx.Module, x_row: int, w_rows: range) -> Sites | None:
    """The histories (`histories`) of a module's projections that read input `x_row` with
    weights `w_rows`; None without FP8."""
    if not hasattr(module, "fp8_x"):
        return None
    x, w, g = module.fp8_x[...], module.fp8_w[...], module.fp8_g[...]
    return Sites(x[x_row], tuple(w[i] for i in w_rows), tuple(g[i] for i in w_rows))


def bound_dot(x_scale: jax.Array, w_scale: jax.Array, g_scale: jax.Array | None = None
              ) -> Partial:
    """`dot(x, w, contract)` with its scales bound, as a pytree a collective matmul carries
    into its shard_map."""
    if g_scale is None:
        return Partial(_bound_dot, x_scale=x_scale, w_scale=w_scale)
    return Partial(_bound_dot, x_scale=x_scale, w_scale=w_scale, g_scale=g_scale)


def _bound_dot(x, w, contract, *, x_scale, w_scale, g_scale=None):
    return dot(x, w, contract, x_scale, w_scale, g_scale)


def observe_outputs(sites: Sites | None, outputs: tuple) -> tuple:
    """Projections' outputs with their gradients' amaxes observed (`observe_grad`)."""
    if sites is None:
        return outputs
    return tuple(observe_grad(y, h) for y, h in zip(outputs, sites.g))


def _observation(history: jax.Array, amax: jax.Array) -> jax.Array:
    return jnp.zeros_like(history).at[0].set(amax.astype(history.dtype))


def observed_scale(x: jax.Array, history: jax.Array, delayed: bool) -> jax.Array:
    """The e4m3 scale of x: its own (`scale`), or with `delayed` its history's
    (`history_scale`, which does not read x). The gradient with respect to `history` [H] is x's
    amax in slot 0 (how the amax leaves the step: under delayed the amax's only use, taken
    beside the matmul); x gets none, as from a scale anywhere."""
    return _observed_scale(jax.lax.stop_gradient(x), history, delayed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _observed_scale(x, history, delayed):
    return _observed_scale_fwd(x, history, delayed)[0]


def _observed_scale_fwd(x, history, delayed):
    s = history_scale(history) if delayed else scale(x)
    return s, (jnp.max(jnp.abs(x)).astype(jnp.float32), history)


def _observed_scale_bwd(delayed, residuals, g):
    amax, history = residuals
    return None, _observation(history, amax)


_observed_scale.defvjp(_observed_scale_fwd, _observed_scale_bwd)


@jax.custom_vjp
def observe_grad(y: jax.Array, history: jax.Array) -> jax.Array:
    """y unchanged; the gradient with respect to `history` [H] is the amax of y's gradient in
    slot 0."""
    return y


def _observe_grad_fwd(y, history):
    return y, history


def _observe_grad_bwd(history, g):
    return g, _observation(history, jnp.max(jnp.abs(g)))


observe_grad.defvjp(_observe_grad_fwd, _observe_grad_bwd)


def combine(a, b):
    """Two microbatches' observations (amax trees) as one: the larger amax of each tensor."""
    return jax.tree.map(jnp.maximum, a, b)


def advance(histories, observed):
    """The histories one step on: each tensor's amax of this step (the gradient of
    `observed_scale` and `observe_grad`) in slot 0, the older ones shifted back, the oldest
    dropped."""
    return jax.tree.map(lambda h, o: jnp.concatenate([o[..., :1], h[..., :-1]], axis=-1),
                        histories, observed)


KINDS = ("x", "w", "g")  # the History variables' names end in these: inputs, weights, gradients


def statistics(histories, observed, delayed: bool = False) -> dict[str, jax.Array]:
    """Per kind (inputs x, weights w, gradients g), over every projection of every layer: the
    largest amax this step, the largest and the smallest scale the step's matmuls used (under
    `delayed` from the histories before this step, 1 where one is empty; under tensorwise the
    amaxes' own), and the share of tensors whose amax passed their scale's range (values
    clipped; 0 under tensorwise)."""
    flat = jax.tree_util.tree_flatten_with_path(histories)[0]
    seen = jax.tree.leaves(observed)
    out = {}
    for kind in KINDS:
        fmt = BACKWARD if kind == "g" else FORWARD
        largest = float(jnp.finfo(fmt).max)
        pairs = [(h, o) for (path, h), o in zip(flat, seen)
                 if str(getattr(path[-1], "key", path[-1])).endswith("_" + kind)]
        if not pairs:
            continue
        amax = jnp.concatenate([o[..., 0].reshape(-1) for _, o in pairs])
        held = jnp.concatenate([jnp.max(h, axis=-1).reshape(-1) for h, _ in pairs])
        # an empty history: scale 1 under delayed (`history_scale`), the amax's own under tensorwise
        bound = jnp.where(held > 0, held, largest if delayed else amax)
        scales = jnp.where(bound > 0, bound / largest, 1.0)
        out[f"fp8_amax_{kind}"] = jnp.max(amax)
        out[f"fp8_scale_max_{kind}"] = jnp.max(scales)
        out[f"fp8_scale_min_{kind}"] = jnp.min(scales)
        out[f"fp8_clipped_{kind}"] = jnp.mean((amax > bound).astype(jnp.float32))
    return out
