"""Each layer's weights gathered over fsdp one layer ahead (model.weights_ahead): the scan over
the layers carries layer i+1's gathered weights while layer i runs, so their gather runs beside
layer i's kernels instead of at the start of layer i+1, where nothing can hide it. The carried
weights are the remat body's inputs: the backward reads them as saved, gathers nothing again,
and reduce-scatters their gradients during the layer below's backward. docs/performance.md has
the measured bytes.
"""

from __future__ import annotations

import functools
import math
from typing import Callable, Mapping

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.ops import projections
from jaxtron.parallel import constrain


def applies(cfg: ModelConfig, sizes: Mapping[str, int]) -> bool:
    """Where `embed` is split (fsdp, context, expert: parallel.RULES), under remat (without, the
    gathered weights are kept for the backward anyway) and without FP8, which quantizes each
    weight with its stored amax before the gather."""
    split = math.prod(sizes.get(axis, 1) for axis in ("fsdp", "context", "expert")) > 1
    return cfg.weights_ahead and split and cfg.remat != "none" and cfg.fp8 == "none"


def scan(cfg: ModelConfig, body: Callable, x, stacked, names: tuple[str, ...]):
    """`jax.lax.scan(body, x, stacked)` with each layer's weights that are split over `embed`
    fetched a layer ahead: those named in `names` (the projections) in the compute dtype as
    `projections.gathered` makes them, the others (a router) as stored."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(stacked, is_leaf=_is_variable)
    variables = [var for _, var in leaves]
    ahead = [i for i, var in enumerate(variables)
             if isinstance(var, nnx.Param) and set(projections.GATHERED) & set(_axes(var))]
    dtypes = [cfg.dtype if getattr(leaves[i][0][-1], "key", None) in names
              else variables[i][...].dtype for i in ahead]

    def fetch(values, like):  # `like`: the variables fetched, for their axes
        return [projections.gathered(var.replace(value=v), cfg, dtype)
                for var, v, dtype in zip(like, values, dtypes)]

    def step(carry, xs):
        x, fetched = carry
        layer_state, upcoming = xs
        layer_vars = jax.tree_util.tree_leaves(layer_state, is_leaf=_is_variable)
        following = fetch(upcoming, [layer_vars[i] for i in ahead])
        for i, w in zip(ahead, fetched):
            stored = _axes(layer_vars[i])[-w.ndim:]
            layer_vars[i] = layer_vars[i].replace(value=_scattered_gradient(w, stored))
        x, stats = body(x, jax.tree_util.tree_unflatten(treedef, layer_vars))
        return (x, following), stats

    stored = [variables[i][...] for i in ahead]
    first = fetch([w[0] for w in stored], [variables[i] for i in ahead])
    upcoming = [jnp.roll(w, -1, axis=0) for w in stored]  # the last layer fetches layer 0's
    (x, _), stats = jax.lax.scan(step, (x, first), (stacked, upcoming))
    return x, stats


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _scattered_gradient(w: jax.Array, axes: tuple) -> jax.Array:
    """w, its gradient reduce-scattered to `axes` (the stored weight's) where it is made: else
    the carried weight's gradient is summed whole to match the carry (an all-reduce, twice the
    bytes) and sliced a layer later."""
    return w


def _scattered_fwd(w, axes):
    return w, None


def _scattered_bwd(axes, _, g):
    return (constrain(g, axes),)


_scattered_gradient.defvjp(_scattered_fwd, _scattered_bwd)


def _is_variable(x) -> bool:
    return isinstance(x, nnx.Variable)


def _axes(var: nnx.Variable) -> tuple:
    return tuple(var.get_metadata().get("out_sharding") or ())
