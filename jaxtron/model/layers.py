"""The small pieces every layer uses: tagged parameters, RMSNorm, rotary position embeddings."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config import ModelConfig


def param(rngs: nnx.Rngs, cfg: ModelConfig, shape: tuple[int, ...], axes: tuple[str, ...],
           std: float | None = None, value: float | None = None) -> nnx.Param:
    """A parameter tagged with logical axes (the one place that touches NNX sharding metadata)."""
    dtype = jnp.dtype(cfg.param_dtype)
    if value is not None:
        init = jnp.full(shape, value, dtype)
    else:
        init = jax.random.normal(rngs.params(), shape, dtype) * (std or cfg.init_std)
    return nnx.Param(init, out_sharding=axes, eager_sharding=False)


class RMSNorm(nnx.Module):
    """x / rms(x) * (offset + scale) over the last dimension, in float32: d_model wide, or
    `width` (Qwen3's per-head q and k norms, head_size wide). `offset` 0 stores the factor
    itself (Llama); Gemma's norms store it less 1 (`ZeroCentredNorm`)."""

    offset = 0.0

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, width: int = 0):
        self.scale = param(rngs, cfg, (width or cfg.d_model,), ("norm",), value=1.0 - self.offset)
        self.eps = cfg.norm_eps

    def __call__(self, x_BTD: jax.Array) -> jax.Array:
        x = x_BTD.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        factor = self.scale[...].astype(jnp.float32)
        factor = factor + self.offset if self.offset else factor
        return (x * factor).astype(x_BTD.dtype)


class ZeroCentredNorm(RMSNorm):
    """Gemma's RMSNorm: x / rms(x) * (1 + scale), scale stored as transformers stores it."""

    offset = 1.0


def local_rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """The windowed layers' inverse frequencies: of model.rope_local_theta, unscaled (Gemma 3),
    or the global layers' (`rope_frequencies`) when it is 0."""
    if not cfg.rope_local_theta:
        return rope_frequencies(cfg)
    h = rope_dim(cfg)
    return 1.0 / (cfg.rope_local_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))


def rope_dim(cfg: ModelConfig) -> int:
    """Width of the rotated part of a head: MLA's qk_rope_head_dim, else the whole head."""
    return cfg.mla.qk_rope_head_dim if cfg.mla.kv_lora_rank > 0 else cfg.head_size


def _yarn(cfg: ModelConfig) -> bool:
    return cfg.rope_scaling_factor > 0 and cfg.rope_scaling_type == "yarn"


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def rope_frequencies(cfg: ModelConfig) -> jax.Array:
    """Inverse frequencies [rope_dim/2], with Llama-3 or YaRN scaling when `rope_scaling_factor`
    > 0 (YaRN as transformers' `_compute_yarn_parameters`)."""
    h = rope_dim(cfg)
    inv_freq = 1.0 / (cfg.rope_theta ** (jnp.arange(0, h, 2, dtype=jnp.float32) / h))
    if cfg.rope_scaling_factor <= 0:
        return inv_freq
    factor, old_len = cfg.rope_scaling_factor, cfg.rope_original_max_len
    if cfg.rope_scaling_type == "linear":
        return inv_freq / factor
    if _yarn(cfg):
        # The dimension whose wavelength turns `rot` times in old_len; below beta_fast's
        # (short wavelengths) kept, above beta_slow's divided by factor, a ramp between.
        def dim_at(rot: float) -> float:
            return h * math.log(old_len / (rot * 2 * math.pi)) / (2 * math.log(cfg.rope_theta))
        low, high = dim_at(cfg.rope_beta_fast), dim_at(cfg.rope_beta_slow)
        if cfg.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, h - 1)
        high = high + 0.001 if low == high else high
        ramp = jnp.clip((jnp.arange(h // 2, dtype=jnp.float32) - low) / (high - low), 0.0, 1.0)
        return inv_freq / factor * ramp + inv_freq * (1 - ramp)
    low, high = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    smooth = jnp.clip((old_len / wavelen - low) / (high - low), 0.0, 1.0)
    return (1 - smooth) * inv_freq / factor + smooth * inv_freq


def rope_attention_factor(cfg: ModelConfig) -> float:
    """What YaRN multiplies cos and sin by (transformers' `attention_factor`); 1.0 otherwise.
    mscale / mscale_all_dim when both are set, else mscale(factor) with mscale 1."""
    if not _yarn(cfg):
        return 1.0
    factor, m, m_all = cfg.rope_scaling_factor, cfg.rope_mscale, cfg.rope_mscale_all_dim
    if m and m_all:
        return _yarn_mscale(factor, m) / _yarn_mscale(factor, m_all)
    return _yarn_mscale(factor)


def softmax_scale_factor(cfg: ModelConfig) -> float:
    """What DeepSeek-V3 multiplies its softmax scale by under YaRN: mscale(factor,
    mscale_all_dim)^2 when mscale_all_dim is set, else 1.0."""
    if not _yarn(cfg) or not cfg.rope_mscale_all_dim:
        return 1.0
    return _yarn_mscale(cfg.rope_scaling_factor, cfg.rope_mscale_all_dim) ** 2


def apply_rope(x_BTNH: jax.Array, positions_BT: jax.Array, inv_freq: jax.Array) -> jax.Array:
    """Rotate halves (x1, x2) of each head by position-dependent angles (HF Llama layout)."""
    angles_BTh = positions_BT[..., None].astype(jnp.float32) * inv_freq
    cos, sin = jnp.cos(angles_BTh)[:, :, None], jnp.sin(angles_BTh)[:, :, None]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTNH.dtype)
