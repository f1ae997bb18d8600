"""A layer's projections as its matmuls run over the mesh: weights gathered over fsdp in the
compute dtype (or quantized to FP8 before the gather), and the tensor-parallel matmuls plain or
as collective matmuls overlapped with the sequence's all-gather / reduce-scatter.

`project_in` is column-parallel (x[B, T, D] times weights [D, ...]: q, k, v; gate, up),
`project_out` row-parallel (h[B, T, ...] times w[..., D]: o, down). Weights come as stored
`nnx.Param`s, whose logical axes say how they are sharded (parallel.RULES).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.tree_util import Partial

from jaxtron.config import ModelConfig
from jaxtron.ops import fp8
from jaxtron.parallel import collective_matmul, constrain

# the weights' axes split over fsdp (parallel.RULES) that their use gathers: the model width,
# and latent attention's compressed width (jaxtron/model/deepseek.py)
GATHERED = ("embed", "latent")


def gathered(param: nnx.Param, cfg: ModelConfig, dtype=None) -> jax.Array:
    """A layer's weight in the compute dtype with its `embed` dimension whole: gathered over
    fsdp here, at its use inside the layer's remat, so that the backward's recomputed forward
    and its gradient matmuls share one gather (left to each matmul, the collective matmuls'
    shard_maps above all, the backward gathered it twice). Not under remat=none: there the
    gathered copy would be kept for the backward, every layer's. docs/performance.md has the
    measured bytes. `dtype`: another than the compute dtype (a router's float32)."""
    w = param[...].astype(dtype or cfg.dtype)
    axes = _gathered_axes(param, cfg)
    return w if axes is None else constrain(w, axes)


def _stored_axes(param: nnx.Param) -> tuple[str, ...] | None:
    """A weight's logical axes as one layer holds it (inside the scan over layers)."""
    axes, ndim = tuple(param.get_metadata().get("out_sharding") or ()), param[...].ndim
    if len(axes) == ndim + 1 and axes[0] in ("layers", "stack"):
        axes = axes[1:]
    return axes if len(axes) == ndim else None


def _gathered_axes(param: nnx.Param, cfg: ModelConfig) -> tuple[str | None, ...] | None:
    """Where `gathered` pins a weight: its axes with `embed` whole; None under remat=none."""
    axes = _stored_axes(param)
    if cfg.remat == "none" or axes is None:
        return None
    return tuple(None if axis in GATHERED else axis for axis in axes)


def _weights(cfg: ModelConfig, params, sites: fp8.Sites | None = None
             ) -> tuple[tuple[jax.Array, ...], tuple]:
    """The layer's weights as its matmuls read them, and with model.fp8 their scales: gathered
    in the compute dtype (`gathered`), or quantized before their gather (`fp8.weight`), each
    stored weight's amax observed into its history (`sites`, `fp8.observed_scale`)."""
    if cfg.fp8 == "none":
        return tuple(gathered(p, cfg) for p in params), (None,) * len(params)
    stored = [p[...] for p in params]
    delayed = cfg.fp8 == "delayed"
    scales = tuple(fp8.observed_scale(w, h, delayed) for w, h in zip(stored, sites.w))
    return tuple(fp8.weight(w, s, cfg.dtype, _stored_axes(p), _gathered_axes(p, cfg))
                 for p, w, s in zip(params, stored, scales)), scales


def _dots(cfg: ModelConfig, x: jax.Array, w_scales: tuple, sites: fp8.Sites | None = None
          ) -> list[Partial]:
    """One `dot(x, w, contract)` per weight, for products of x with each: `jnp.tensordot`, or
    with model.fp8 an FP8 matmul with x's scale taken here over the whole of x (tensorwise) or
    from its history (delayed), and each weight's (`_weights`)."""
    if cfg.fp8 == "none":
        return [Partial(jnp.tensordot)] * len(w_scales)
    x_scale = fp8.observed_scale(x, sites.x, cfg.fp8 == "delayed")
    if cfg.fp8 == "tensorwise":
        return [fp8.bound_dot(x_scale, s) for s in w_scales]
    return [fp8.bound_dot(x_scale, s, fp8.history_scale(h, fmt=fp8.BACKWARD))
            for s, h in zip(w_scales, sites.g)]


def project_in(cfg: ModelConfig, overlapped: bool, x_BTD: jax.Array, params,
               sites: fp8.Sites | None):
    """x[B, T, D] times each weight [D, ...]: outputs [B, T, ...] with the weights' split over
    tensor; `overlapped`: as collective matmuls, each step's matmul beside the next step's
    permute of the sequence's all-gather."""
    weights, scales = _weights(cfg, params, sites)
    dots = _dots(cfg, x_BTD, scales, sites)
    if overlapped:
        outputs = collective_matmul.gather_matmuls(
            x_BTD, *weights, dots=dots, regather=cfg.remat in collective_matmul.REGATHER)
    else:
        outputs = tuple(dot(x_BTD, w, 1) for dot, w in zip(dots, weights))
    return fp8.observe_outputs(sites, outputs)


def project_out(cfg: ModelConfig, overlapped: bool, h: jax.Array, param: nnx.Param,
                sites: fp8.Sites | None) -> jax.Array:
    """h[B, T, ...] times w[..., D] summed over the middle dimensions: [B, T, D];
    `overlapped`: its reduce-scatter over the sequence in steps beside the matmul's."""
    (w,), scales = _weights(cfg, (param,), sites)
    (dot,) = _dots(cfg, h, scales, sites)
    if overlapped:
        y = collective_matmul.matmul_scatter(h, w, dot=dot)
    else:
        y = dot(h, w, h.ndim - 2)
    return fp8.observe_outputs(sites, (y,))[0]
