"""What both 1F1B programs do on a stage, the whole ticks (one_f_one_b.py) and the half ticks
(half_ticks.py): run one item's layers, skip the work a stage has none of in a tick, form a
mixture of experts' router objective on the last stage, and carry the router's statistics
(`Flow`) with the activations and their gradient."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtron.parallel import pieces


def meshed() -> bool:
    return not jax.sharding.get_abstract_mesh().empty


def skips(permutes: bool) -> bool:
    """Whether a stage skips the work it has none of in a tick (`lax.cond`), as it does on
    GPUs. Not on CPU devices when its layers hold collective permutes: a CPU collective permute
    waits for every device its pairs name, the other stages' too, which skipped it."""
    device = getattr(jax.sharding.get_abstract_mesh(), "abstract_device", None)
    platform = device.platform if device is not None else jax.default_backend()
    return not (permutes and platform == "cpu")


def when(skip: bool, pred, f: Callable, g: Callable, *args):
    """f(*args) where pred holds, else g(*args): only the one taken runs, with `skip` (else
    both run and the other is dropped)."""
    if skip:
        return jax.lax.cond(pred, f, g, *args)
    return jax.tree.map(lambda a, b: jnp.where(pred, a, b), f(*args), g(*args))


def stage_fn(layers_fn: Callable) -> Callable:
    """(w, x, positions, segment_ids, repeat) -> layers_fn's (x, statistics) through the
    stage's layers of one repeat (`repeat` picks its layer group out of w [L', R, ...])."""

    def run(w, x_bTD, positions_bT, segments_bT, repeat):
        pick = lambda a: jax.lax.dynamic_index_in_dim(a, repeat, 0, False)
        select = jax.checkpoint(lambda layer: jax.tree.map(pick, layer),
                                policy=jax.checkpoint_policies.nothing_saveable)
        return layers_fn(w, x_bTD, positions_bT, segments_bT, select=select)

    return run


def setting(layers_fn: Callable, w: Any, inputs_MbPD: jax.Array, rows: list, router: Any,
            skip: bool, stages: int) -> tuple:
    """What both 1F1B programs set up on a stage: (its index on `stage`, the microbatch's
    pieces (pieces.Pieces), `when` with `skip`, the stage function, a zero input [b, T, ...],
    the primals of its forward, the statistics' Flow)."""
    positions_MbT, segments_MbT, targets_MbT, _ = rows
    cut = pieces.Pieces(targets_MbT.shape[2], stages)
    run = stage_fn(layers_fn)
    zero_x = jnp.zeros((*inputs_MbPD.shape[1:2], cut.seq, *inputs_MbPD.shape[3:]),
                       inputs_MbPD.dtype)
    primals = (w, zero_x, positions_MbT[0], segments_MbT[0], jnp.zeros((), jnp.int32))
    flow = Flow(router, jax.eval_shape(run, *primals)[1])
    return (jax.lax.axis_index("stage"), cut, functools.partial(when, skip), run, zero_x,
            primals, flow)


def objective(router: Any, totals: dict, mask_bT: jax.Array):
    """The router objective of a microbatch from its statistics summed over every layer:
    (value, its parts, its gradient in those sums)."""
    tokens_b = jnp.sum(mask_bT, axis=-1)
    (value, parts), vjp = jax.vjp(lambda s: router.objective(s, tokens_b), totals)
    return value, parts, vjp((jnp.ones_like(value), jax.tree.map(jnp.zeros_like, parts)))[0]


def constrained(a: jax.Array, spec: P) -> jax.Array:
    """A stage weight's gradient [L', R, ...] laid out as its weight's `spec` says (split over
    fsdp for grad_sum=sharded: a reduce-scatter each tick)."""
    if not meshed():
        return a
    return jax.lax.with_sharding_constraint(a, P(None, None, *spec[1:]))


@dataclass(frozen=True)
class Flow:
    """A stage's statistics (a mixture of experts' router sums, [L', ...] per leaf; `router`'s
    `rows` per row [L', b, ...]) as the ticks move them: summed over the layers (`added`) with
    the activations to the last stage, their gradient (`spread` over the layers) back with the
    activations' gradient, and logged per layer and repeat [R, L', ...], the rows summed."""

    router: Any
    shapes: dict  # one stage's statistics, abstract

    def _rows(self, key) -> bool:
        return self.router is not None and key in self.router.rows

    def zeros(self) -> dict:
        return {k: jnp.zeros(a.shape, a.dtype) for k, a in self.shapes.items()}

    def zeros_summed(self) -> dict:
        return {k: jnp.zeros(a.shape[1:], a.dtype) for k, a in self.shapes.items()}

    def zeros_logged(self, repeats: int) -> dict:
        return {k: jnp.zeros((repeats, a.shape[0], *a.shape[2 if self._rows(k) else 1:]),
                             a.dtype) for k, a in self.shapes.items()}

    def zeros_parts(self, b: int) -> dict:
        """The router objective's parts, zeros ({} without a router)."""
        if self.router is None:
            return {}
        parts = jax.eval_shape(lambda s: self.router.objective(s, jnp.zeros((b,)))[1],
                               self.zeros_summed())
        return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), parts)

    def added(self, sums: dict, stats: dict) -> dict:
        return {k: sums[k] + jnp.sum(stats[k], axis=0) for k in sums}

    def spread(self, d_sums: dict) -> dict:
        return {k: jnp.broadcast_to(d_sums[k][None], a.shape).astype(a.dtype)
                for k, a in self.shapes.items()}

    def logged(self, acc: dict, stats: dict, repeat) -> dict:
        """acc [R, L', ...] with this item's statistics added at its repeat (zeros where the
        stage had no forward)."""
        per_layer = {k: jnp.sum(a, axis=1) if self._rows(k) else a for k, a in stats.items()}
        return {k: acc[k].at[repeat].add(per_layer[k]) for k in acc}
