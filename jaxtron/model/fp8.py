"""FP8 matmuls with per-tensor scales, for Hopper's FP8 tensor cores (`model.fp8`).

A projection x[..., K] @ w[K, ...] in FP8: x and w are divided by a scale, clipped and rounded to
float8_e4m3fn (3 mantissa bits, range +-448), multiplied as FP8 with a result in the compute
dtype (what a remat policy that keeps matmul outputs keeps: a float32 one doubled those bytes),
and the product multiplied back by both scales in float32. In the backward the incoming
gradient is rounded the same way to float8_e5m2 (2 mantissa bits, range +-57344: gradients need
range more than precision) and meets the FP8 operands the forward kept, in two more FP8 matmuls.
The master weights, the optimizer and every other op are unchanged.

Scales (`scale`): amax / the format's largest value, so that the tensor's largest magnitude lands
on the format's largest. `tensorwise` takes amax from the tensor at this step (the forward's x and
w before their matmul, the gradient in the backward).

On a GPU, XLA compiles a `dot` of FP8 operands to an FP8 GEMM (a Triton GEMM fusion or cuBLASLt's
FP8 matmul, whichever autotuning picks); on CPUs it runs the same rounding and multiplies in
float32, so the numerics can be checked anywhere. The residuals the backward needs are the FP8
operands: half the bytes of the compute dtype's.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from jaxtron.parallel import constrain

MODES = ("none", "tensorwise")
FORWARD = jnp.float8_e4m3fn  # weights and activations
BACKWARD = jnp.float8_e5m2  # gradients


def scale(x: jax.Array, fmt=FORWARD) -> jax.Array:
    """float32 scalar s with max|x| / s = the format's largest value (1 for an all-zero x)."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
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
def dot(x: jax.Array, w: jax.Array, contract: int, x_scale: jax.Array, w_scale: jax.Array
        ) -> jax.Array:
    """`jnp.tensordot(x, w, contract)` in FP8: x's last `contract` dimensions against w's first,
    x and w quantized with the given scales (`scale`), the result in x's dtype. The backward
    scales the gradient by its own amax, over the gradient as this program holds it: inside a
    shard_map (the collective matmuls' steps) this device's chunk, with no collective."""
    return _dot_fwd(x, w, contract, x_scale, w_scale)[0]


def _contracting(x_ndim: int, contract: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(range(x_ndim - contract, x_ndim)), tuple(range(contract))


def _dot_fwd(x, w, contract, x_scale, w_scale):
    x_q, w_q = quantize(x, x_scale, FORWARD), quantize(w, w_scale, FORWARD)
    y = _scaled_dot(x_q, w_q, x_scale * w_scale, _contracting(x.ndim, contract), x.dtype)
    return y, (x_q, w_q, x_scale, w_scale, jnp.zeros((), w.dtype))  # w's dtype, for dw


def _dot_bwd(contract, residuals, g):
    x_q, w_q, x_scale, w_scale, w_like = residuals
    g_scale = scale(g, BACKWARD)
    g_q = quantize(g, g_scale, BACKWARD)
    a = x_q.ndim - contract  # x[A..., K...], w[K..., N...], g[A..., N...]
    n = w_q.ndim - contract
    # dx[A..., K...] = g . w over N; dw[K..., N...] = x . g over A
    dx = _scaled_dot(g_q, w_q, g_scale * w_scale,
                     (tuple(range(a, a + n)), tuple(range(contract, contract + n))), g.dtype)
    dw = _scaled_dot(x_q, g_q, x_scale * g_scale, (tuple(range(a)), tuple(range(a))), w_like.dtype)
    return dx, dw, jnp.zeros_like(x_scale), jnp.zeros_like(w_scale)


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
