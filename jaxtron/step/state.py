"""The train state: the plan (shapes, shardings, sizes) known before anything is allocated, the
state born sharded, and a restored state put into this run's layer order (where a run starts:
jaxtron/train/start.py).

The state is a plain dict pytree {params, opt_state, step, nonfinite}, with model.fp8=delayed
also {fp8}: the projections' amax histories (jaxtron/ops/fp8.py). params (and fp8) are the
model's NNX state as pure dicts, merged with a static graphdef inside the jitted step.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from jaxtron import model as model_lib
from jaxtron import parallel
from jaxtron.config import Config
from jaxtron.model import abstract_model, count_params
from jaxtron.ops import fp8, layer_ops
from jaxtron.parallel import pipeline


@dataclass(frozen=True)
class Plan:
    """Everything known before allocating: structure, shardings, sizes."""

    graphdef: Any
    abstract: dict  # {params, opt_state, step, nonfinite[, fp8]} of ShapeDtypeStructs
    specs: dict  # the same tree of mesh PartitionSpecs
    mesh_sizes: dict[str, int]
    num_params: int
    pipe: pipeline.Pipeline | None  # the layers' pipeline over mesh.stage, None for one stage
    accumulation: int  # sequential gradient-accumulation steps: microbatches, or pipeline passes
    layer_order: np.ndarray  # stored index -> model layer (pipeline.layer_order)
    # The FP8 amax histories the model reads (model.fp8 != none; else empty), whether or not
    # they are train state (delayed) or zeros each step (tensorwise): ShapeDtypeStructs
    histories: dict
    ops: layer_ops.LayerOps  # the operations the model calls on this mesh (jaxtron/ops/)

    def bytes_per_device(self, part: str) -> int:
        return parallel.bytes_per_device(self.abstract[part], self.specs[part], self.mesh_sizes)

    def checkpoint_bytes(self) -> int:
        """One checkpoint's size: the params and optimizer state, whole (each shard once)."""
        leaves = jax.tree.leaves((self.abstract["params"], self.abstract["opt_state"]))
        return sum(leaf.size * leaf.dtype.itemsize for leaf in leaves)


def make_plan(cfg: Config, tx: optax.GradientTransformation, num_devices: int) -> Plan:
    """Validate the layout against `num_devices` and derive every shape and sharding."""
    model_lib.check(cfg.model)
    sizes = parallel.mesh_shape(cfg.mesh, num_devices)
    pipeline.check(cfg, sizes["stage"])
    parallel.check_layout(cfg, sizes)
    graphdef, abstract_state, history_state = nnx.split(abstract_model(cfg.model), nnx.Param,
                                                        fp8.History)
    params = nnx.to_pure_dict(abstract_state)
    histories = nnx.to_pure_dict(history_state)
    param_specs = parallel.mesh_specs(parallel.logical_specs(abstract_state))
    parallel.check_divisible(params, param_specs, sizes, cfg.model)
    opt_state = jax.eval_shape(tx.init, params)
    opt_specs = map_params(lambda _, s: s, opt_state, param_specs, lambda _: P())
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    abstract = {"params": params, "opt_state": opt_state, "step": scalar, "nonfinite": scalar}
    specs = {"params": param_specs, "opt_state": opt_specs, "step": P(), "nonfinite": P()}
    if cfg.model.fp8 == "delayed":  # small ([layers, tensors, history]): replicated
        abstract["fp8"], specs["fp8"] = histories, jax.tree.map(lambda _: P(), histories)
    pipe = pipeline.from_config(cfg, sizes["stage"])
    accumulation = cfg.pipeline.passes if pipe else cfg.train.microbatches
    return Plan(graphdef, abstract, specs, sizes, count_params(params), pipe, accumulation,
                pipeline.config_order(cfg, sizes["stage"]), histories,
                layer_ops.build(cfg.model, sizes, pipe))


def map_params(fn, opt_state, tree: dict, non_params) -> Any:
    """`fn(leaf, tree's leaf)` on each optimizer-state leaf that is a parameter's (a moment or
    momentum: its path ends with that parameter's path), `non_params(leaf)`
    on the rest (counts, coefficients). By path, unlike optax.tree_map_params, because optax's
    partitioned states (Muon's and AdamW's parts) hold masked subtrees."""
    is_leaf = lambda x: isinstance(x, P)
    by_path = {tuple(k.key for k in path): value
               for path, value in jax.tree_util.tree_leaves_with_path(tree, is_leaf=is_leaf)}

    def one(path, leaf):
        keys = []
        for key in reversed(path):  # the trailing run of dict keys: the parameter's path
            if not isinstance(key, jax.tree_util.DictKey):
                break
            keys.insert(0, key.key)
        found = tuple(keys)
        return fn(leaf, by_path[found]) if found in by_path else non_params(leaf)

    return jax.tree_util.tree_map_with_path(one, opt_state)


def init_state(cfg: Config, plan: Plan, tx: optax.GradientTransformation, mesh: Mesh) -> dict:
    """Initialise the state directly into its shardings: no full copy on any one device."""

    def init() -> dict:
        model = model_lib.build(cfg.model, nnx.Rngs(cfg.train.seed))
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
        model_order = np.arange(cfg.model.num_layers)
        params["layers"] = pipeline.reorder(params["layers"], model_order, plan.layer_order)
        return fresh_state(params, tx, plan.abstract.get("fp8"))

    return jax.jit(init, out_shardings=parallel.named(plan.specs, mesh))()


def fresh_state(params: dict, tx: optax.GradientTransformation, histories: dict | None = None
                ) -> dict:
    """The train state around `params`: new optimizer state, step 0, and with `histories` (the
    abstract FP8 amax histories of model.fp8=delayed) empty ones."""
    zero = jnp.zeros((), jnp.int32)
    state = {"params": params, "opt_state": tx.init(params), "step": zero, "nonfinite": zero}
    if histories is not None:
        state["fp8"] = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), histories)
    return state


def fresh_state_around(params: dict, tx: optax.GradientTransformation, shardings: dict,
                       histories: dict | None = None) -> dict:
    """fresh_state on restored params, in `shardings`; the params are donated, so the state takes
    over their buffers instead of holding a second copy."""
    return jax.jit(functools.partial(fresh_state, tx=tx, histories=histories),
                   out_shardings=shardings, donate_argnums=0)(params)



def in_layer_order(state: dict, meta: dict, plan: Plan, tx, shardings, info) -> dict:
    """A restored state with its stacked layers (params and optimizer moments) permuted from
    the checkpoint's storage order (meta["layer_order"]) to this run's (pipeline.layer_order)."""
    saved = np.asarray(meta.get("layer_order", range(plan.layer_order.size)))
    if np.array_equal(saved, plan.layer_order):
        return state
    is_layer = jax.tree_util.tree_map_with_path(lambda path, _: path[0].key == "layers",
                                                plan.abstract["params"])

    def permute(state: dict) -> dict:
        move = lambda x, layer: pipeline.reorder(x, saved, plan.layer_order) if layer else x
        out = {**state, "params": jax.tree.map(move, state["params"], is_layer)}
        if "opt_state" in state:  # absent when only the weights were restored
            out["opt_state"] = map_params(move, state["opt_state"], is_layer, lambda x: x)
        return out

    info("layers reordered from the checkpoint's pipeline layout to this run's")
    # Donated: the permuted state takes the restored one's buffers, never two copies at once.
    return jax.jit(permute, out_shardings={k: shardings[k] for k in state},
                   donate_argnums=0)(state)

