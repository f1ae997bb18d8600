"""Pipeline parallelism over the `stage` mesh axis, inside one SPMD program.

The stacked layers are split into S stages of R repeats; M microbatches go through an iteration
loop in which every stage runs at once and the activations move one stage on (`_iteration`).
gpipe (R = 1) and circular (R > 1); the backward is autodiff of the loop. Weights are gathered
over fsdp once per pass, and kept in stage order (`layer_order`, `reorder`). docs/operations.md,
"The pipeline", has the schedule, its bubble and the storage order.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxtron import parallel
from jaxtron.config import Config, ConfigError, schema
from jaxtron.parallel import constrain

SCHEDULES = ("gpipe", "circular", "1f1b", "interleaved_1f1b", "zb_h1")
EXPLICIT = schema.EXPLICIT_SCHEDULES  # the loss and backward in the ticks (one_f_one_b)
REPEATED = ("circular", "interleaved_1f1b")  # the schedules with `repeats` virtual stages
GRAD_SUMS = ("sharded", "whole")


@dataclass(frozen=True)
class Pipeline:
    stages: int  # S
    repeats: int  # R: layer groups per stage (1 for gpipe)
    microbatches: int  # M: per pass through the pipeline
    dtype: str = "float32"  # the layers' compute dtype: stage weights are gathered in it
    grad_sum: str = "sharded"  # sharded | whole: the stage weights' gradient over fsdp (config)
    schedule: str = "gpipe"

    @property
    def explicit(self) -> bool:
        """The 1F1B schedules: forward and backward in one loop of ticks (one_f_one_b.py)."""
        return self.schedule in EXPLICIT

    @property
    def iterations(self) -> int:
        """The loop's trip count: M*R + S-1 iterations of a stage's forward (gpipe, circular;
        the backward as many again), M*R + (R+1)*S - 2 ticks of a forward and a backward, or
        for 1f1b pairs of half ticks from -half_lead(S) to 2M + 3S - 4 (half_ticks.py: the last
        stage keeps its piece of the last input gradient in the last)."""
        if self.schedule == "1f1b":
            return (half_lead(self.stages) + 2 * self.microbatches + 3 * self.stages - 2) // 2
        if self.explicit:
            return self.microbatches * self.repeats + (self.repeats + 1) * self.stages - 2
        return self.microbatches * self.repeats + self.stages - 1

    @property
    def bubble(self) -> float:
        """Fraction of each stage's time that is idle: (S-1) / (M*R + S-1), on every schedule
        (the 1F1B ticks skip the work a stage does not have, so the first and last S-1 forward
        and backward ticks take a forward or a backward only) but zb_h1, whose S-1 ticks
        before stage 0's first backward leave their weight gradients W to the stage's idle
        last ticks: (S-1)(F+B) idle of M(F+B+W) + (S-1)(F+B), 2(S-1) / (3M + 2(S-1)) with a
        forward, an input gradient and a weight gradient alike (one_f_one_b.py)."""
        work = self.microbatches * self.repeats
        if self.schedule == "zb_h1":
            return 2 * (self.stages - 1) / (3 * work + 2 * (self.stages - 1))
        return (self.stages - 1) / (work + self.stages - 1)


def half_lead(stages: int) -> int:
    """1f1b's half ticks before stage 0's first forward (half_ticks.py): the last stage's
    piece of microbatch 0 leaves at half tick -S; even, so that the halves keep their parity."""
    return stages + stages % 2


def describe(pipe: Pipeline, schedule: str, passes: int) -> str:
    """One log line: the schedule and its bubble fraction."""
    s, r, m = pipe.stages, pipe.repeats, pipe.microbatches
    looped = f" x {r} repeats" if r > 1 else ""
    ticks = f", {pipe.iterations} ticks" if pipe.explicit else ""
    if schedule == "1f1b":
        ticks = f", {pipe.iterations} ticks of two halves"
    formula = (f"2(S-1)/(3M+2(S-1)) = {2 * (s - 1)}/{3 * m + 2 * (s - 1)}"
               if schedule == "zb_h1" else f"(S-1)/(R*M+S-1) = {s - 1}/{m * r + s - 1}")
    return (f"pipeline: {schedule}, {s} stages{looped}, {m} microbatches per pass x "
            f"{passes} pass{'es' if passes > 1 else ''}{ticks}: bubble {pipe.bubble:.4f} = "
            f"{formula}")


def from_config(cfg: Config, stages: int) -> Pipeline | None:
    """The pipeline a config asks for on `stages` stages; None when there is one stage."""
    if stages == 1:
        return None
    repeats = cfg.pipeline.repeats if cfg.pipeline.schedule in REPEATED else 1
    return Pipeline(stages, repeats, cfg.train.microbatches // cfg.pipeline.passes,
                    cfg.model.dtype, cfg.pipeline.grad_sum, cfg.pipeline.schedule)


def check(cfg: Config, stages: int) -> None:
    """Schedule, repeats, passes and microbatches against the stage count (before compiling)."""
    p, layers, micro = cfg.pipeline, cfg.model.staged_layers, cfg.train.microbatches
    if p.schedule not in SCHEDULES:
        raise ConfigError(f"pipeline.schedule={p.schedule} is not one of {', '.join(SCHEDULES)}")
    if p.grad_sum not in GRAD_SUMS:
        raise ConfigError(f"pipeline.grad_sum={p.grad_sum} is not one of {', '.join(GRAD_SUMS)}")
    if p.repeats < 1 or p.passes < 1:
        raise ConfigError("pipeline.repeats and pipeline.passes must be at least 1")
    if p.schedule not in REPEATED and p.repeats != 1:
        raise ConfigError(f"pipeline.repeats={p.repeats} needs pipeline.schedule=circular or "
                          "interleaved_1f1b")
    if micro % p.passes:
        raise ConfigError(f"train.microbatches={micro} is not divisible by "
                          f"pipeline.passes={p.passes}")
    if stages == 1:
        return
    repeats = p.repeats if p.schedule in REPEATED else 1
    if layers % (stages * repeats):
        dense = (f" less model.moe.first_dense={cfg.model.moe.first_dense}"
                 if cfg.model.moe.first_dense else "")
        raise ConfigError(f"model.num_layers={cfg.model.num_layers}{dense} is not divisible by "
                          f"mesh.stage={stages} x pipeline.repeats={repeats}; change the stage "
                          "count or repeats")
    per_pass = micro // p.passes
    if p.schedule == "circular" and per_pass < stages:
        raise ConfigError(
            f"the circular schedule needs at least mesh.stage={stages} microbatches per pass, got "
            f"train.microbatches={micro} / pipeline.passes={p.passes} = {per_pass}; raise "
            "train.microbatches")
    if p.schedule in EXPLICIT and cfg.train.seq_len % stages:
        raise ConfigError(f"the {p.schedule} schedule shares each microbatch's loss out over "
                          f"the stages by positions: train.seq_len={cfg.train.seq_len} must be "
                          f"a multiple of mesh.stage={stages}")
    if p.schedule == "interleaved_1f1b" and per_pass % stages:
        raise ConfigError(
            f"the interleaved_1f1b schedule runs microbatches in groups of mesh.stage={stages}, "
            f"got train.microbatches={micro} / pipeline.passes={p.passes} = {per_pass}; make "
            f"it a multiple of {stages}")


def layer_order(num_layers: int, stages: int, repeats: int) -> np.ndarray:
    """order[i] = the model layer stored at index i: stage s's groups s, S+s, ... side by side."""
    per_group = num_layers // (stages * repeats)
    logical = np.arange(num_layers).reshape(repeats, stages, per_group)
    return logical.transpose(1, 0, 2).reshape(-1)


def config_order(cfg: Config, stages: int) -> np.ndarray:
    """The storage order of the layers of a run with this config on `stages` stages."""
    pipe = from_config(cfg, stages)
    return layer_order(cfg.model.staged_layers, stages, pipe.repeats if pipe else 1)


def in_model_order(rows: jax.Array, pipe: Pipeline, layers: int) -> jax.Array:
    """Per-layer rows [L, ...] of the `layers` staged layers in storage order (`layer_order`),
    and any rows after them (DeepSeek's multi-token-prediction modules), -> the staged ones in
    model order."""
    order = layer_order(layers, pipe.stages, pipe.repeats)
    return jnp.concatenate([rows[np.argsort(order)], rows[order.size:]])


def reorder(layers: Any, src: np.ndarray, dst: np.ndarray) -> Any:
    """Stacked layer arrays stored in order `src` -> stored in order `dst`."""
    if np.array_equal(src, dst):
        return layers
    where = np.argsort(src)[dst]  # dst[i] sits at src index where[i]
    return jax.tree.map(lambda w: w[where], layers)


@functools.partial(jax.checkpoint, policy=jax.checkpoint_policies.nothing_saveable)
def _from_owner(inputs_SKbTD: jax.Array, t: jax.Array) -> jax.Array:
    """Microbatch t of inputs spread [S, K, ...] over the stages: a masked sum over the stages
    (an all-reduce of one microbatch). Rematerialized: nothing of it is kept per iteration."""
    s, k = inputs_SKbTD.shape[:2]
    local_SbTD = jax.lax.dynamic_index_in_dim(inputs_SKbTD, t % k, 1, False)
    owner = jnp.arange(s) == jnp.minimum(t // k, s - 1)
    masked_SbTD = jnp.where(owner.reshape(s, *[1] * (local_SbTD.ndim - 1)), local_SbTD, 0)
    # In the inputs' dtype (one term is not zero: nothing to round). jnp.sum adds bf16 in f32,
    # and on jax 0.12 the all-reduce then moved f32: twice the bytes, all of them exposed.
    return jax.lax.reduce(masked_SbTD, np.zeros((), masked_SbTD.dtype), jax.lax.add, (0,))


def _microbatches(x: jax.Array, m: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...]; row i*M + j goes to microbatch j, so no row changes device."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def _stage_sharded(w: jax.Array) -> jax.Array:
    """Pin dimension 0 to `stage`, leaving the others as the compiler has them."""
    if jax.sharding.get_abstract_mesh().empty:
        return w
    return jax.lax.with_sharding_constraint(w, P("stage", *[P.UNCONSTRAINED] * (w.ndim - 1)))


def _on_every_stage(fn: Callable[..., tuple[jax.Array, Any]], copies: tuple[str, ...]
                    ) -> Callable[..., tuple[jax.Array, Any]]:
    """fn(weights, repeat, x, micro, positions, segments, valid, sums) over one stage's slices ->
    the same over [S, ...] arrays, every stage at once; weights [S, copies, ...] (one copy per
    device of the `copies` axes), positions and segments [M, b, T], `sums` the stage's statistics
    so far [S, copies, ...] (`_Sums`); returns (x, sums).

    Under a mesh a `shard_map` over `stage` and the `copies` axes: each device runs its own stage
    on its own rows as a plain program (the other axes stay with the compiler), so kernels without
    a batching rule for the stage dimension, such as cuDNN's fused attention, run as they do
    outside the pipeline, and each copy's weight gradient stays on its devices until the
    iterations are done (a weight shared over `data` here would be all-reduced every iteration).
    Without a mesh a vmap."""
    if jax.sharding.get_abstract_mesh().empty:
        def one(w, repeat, x, micro, positions, segments, valid, sums):
            first = lambda a: a[0]
            out, sums = fn(jax.tree.map(first, w), repeat, x, micro, positions, segments, valid,
                           jax.tree.map(first, sums))
            return out, jax.tree.map(lambda a: a[None], sums)
        return jax.vmap(one, in_axes=(0, 0, 0, 0, None, None, 0, 0))

    def local(weights, repeat, x, micro, positions, segments, valid, sums):
        first = lambda a: a[0]
        out, sums = fn(jax.tree.map(lambda a: a[0, 0], weights), first(repeat), first(x),
                       first(micro), positions, segments, first(valid),
                       jax.tree.map(lambda a: a[0, 0], sums))
        return out[None], jax.tree.map(lambda a: a[None, None], sums)

    rows = P("stage", copies)
    return jax.shard_map(local, in_specs=(rows, P("stage"), rows, P("stage"), P(None, copies),
                                          P(None, copies), P("stage"), rows),
                         out_specs=(rows, rows), axis_names={"stage", *copies}, check_vma=False)


@dataclass(frozen=True)
class _Sums:
    """Where the stages add up their layers' statistics (a mixture of experts' router sums) over
    the microbatches, one buffer per statistic [S, C, R, ...] (C the copies of `_copy_axes`, which
    each sum their own rows): a per-row statistic [L', b, ...] (`rows`) keeps every microbatch's
    rows [S, C, R, M, L', b/C, ...], the others are summed [S, C, R, L', ...]. `gathered` puts
    them back as the layers outside a pipeline return them: [L, B, ...] and [L, ...], the layers
    in storage order (`layer_order`), the rows in the batch's order."""

    pipe: Pipeline
    copies: int
    rows: tuple[str, ...]

    def zeros(self, stats: dict) -> dict:
        """Empty buffers for a stage's statistics (abstract [L', ...] leaves)."""
        s, c, r, m = self.pipe.stages, self.copies, self.pipe.repeats, self.pipe.microbatches
        def zero(key, a):
            if key in self.rows:
                layers, b, *rest = a.shape
                return jnp.zeros((s, c, r, m, layers, b // c, *rest), a.dtype)
            return jnp.zeros((s, c, r, *a.shape), a.dtype)
        return {key: zero(key, a) for key, a in stats.items()}

    def added(self, sums: dict, stats: dict, repeat, micro, valid) -> dict:
        """One stage's buffers [R, ...] with its item's statistics added (when `valid`)."""
        def add(key, buf, a):
            if key in self.rows:
                return buf.at[repeat, micro].set(jnp.where(valid, a, buf[repeat, micro]))
            return buf.at[repeat].add(jnp.where(valid, a, jnp.zeros_like(a)))
        return {key: add(key, sums[key], stats[key]) for key in sums}

    def gathered(self, sums: dict) -> dict:
        """[L, B, ...] per-row statistics, [L, ...] the others (the class docstring)."""
        def whole(key, buf):
            s, c, r = buf.shape[:3]
            if key in self.rows:
                m, layers, b = buf.shape[3:6]
                # [S, C, R, M, L', b, ...] -> [S, R, L', C, b, M, ...]: layer s*R*L' + r*L' + l,
                # row (c*b + i)*M + j (microbatch j's row c*b + i, `_microbatches`)
                out = buf.transpose(0, 2, 4, 1, 5, 3, *range(6, buf.ndim))
                return out.reshape(s * r * layers, c * b * m, *buf.shape[6:])
            return jnp.sum(buf, axis=1).reshape(-1, *buf.shape[4:])
        return {key: whole(key, buf) for key, buf in sums.items()}


def _copy_axes(pipe: Pipeline) -> tuple[str, ...]:
    """The mesh axes whose devices each hold their own copy of the stage weights, and sum their
    own gradient over a pass: `data`, and `fsdp` too when the gradient is summed whole."""
    return ("data",) if pipe.grad_sum == "sharded" else ("data", "fsdp")


def _count(axes: tuple[str, ...]) -> int:
    mesh = jax.sharding.get_abstract_mesh()
    return 1 if mesh.empty else math.prod(mesh.shape.get(a, 1) for a in axes)


def _layer_specs(stacked: Any) -> list[P]:
    """Each stacked layer weight's mesh spec [L_stage, ...] (RULES), in leaf order."""
    logical = jax.tree.leaves(nnx.get_partition_spec(stacked), is_leaf=lambda x: isinstance(x, P))
    return [parallel.spec(tuple(names)) for names in logical]


def _copied(w: jax.Array, copies: tuple[str, ...], spec: P) -> jax.Array:
    """Staged [S, L', R, ...] -> [S, C, L', R, ...], one copy per device of the `copies` axes,
    the weight's own dimensions split as `spec` says (else the compiler may gather them). The
    broadcast's transpose sums the copies' gradients once, after the iterations."""
    w = jnp.broadcast_to(w[:, None], (w.shape[0], _count(copies), *w.shape[1:]))
    return _constrained(w, copies, spec)


def _constrained(w: jax.Array, copies: tuple[str, ...], spec: P) -> jax.Array:
    """[S, C, L', R, ...] split over stage, the `copies` axes, and the weight's own `spec`."""
    if jax.sharding.get_abstract_mesh().empty:
        return w
    return jax.lax.with_sharding_constraint(w, P("stage", copies, None, None, *spec[1:]))


def _without_fsdp(spec: P) -> P:
    """`spec` with the ZeRO axes (fsdp, context) dropped: the weight whole over them, still split
    over tensor."""
    zero = ("fsdp", "context")
    drop = lambda axes: (tuple(a for a in axes if a not in zero) or None
                         if isinstance(axes, tuple) else None if axes in zero else axes)
    return P(*map(drop, spec))


def _gathered(w: jax.Array, copies: tuple[str, ...], spec: P, dtype: Any) -> jax.Array:
    """The stage weights whole over fsdp, in the dtype the layers compute with (a layer's norm
    scale, 1-D, keeps its own): gathered once per pass, outside the iteration scan, so the
    iterations do not gather them again (M*R+S-1 all-gathers forward and as many in the
    backward's recompute). No gradient flows here: `_use_gathered` routes it to the sum."""
    if w.ndim > 5:  # [S, C, L', R, ...] of a matrix (or a bias [N, H])
        w = w.astype(dtype)
    return jax.lax.stop_gradient(_constrained(w, copies, _without_fsdp(spec)))


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _use_gathered(copies: tuple[str, ...], spec: P, dtype: Any, total: jax.Array,
                  gathered: jax.Array) -> jax.Array:
    """`gathered` in the forward; in the backward the cotangent goes to `total`, cast to `dtype`
    and laid out as `spec` says, so the scan sums the weight gradient in float32 either split over
    fsdp (`spec` the weight's: a reduce-scatter each iteration) or whole on each device
    (`total` one copy per fsdp device: each sums its own rows' gradient, no collective)."""
    del copies, spec, dtype, total
    return gathered


def _use_gathered_fwd(copies, spec, dtype, total, gathered):
    del copies, spec, dtype, total
    return gathered, None


def _use_gathered_bwd(copies, spec, dtype, _, g):
    return _constrained(g, copies, spec).astype(dtype), None


_use_gathered.defvjp(_use_gathered_fwd, _use_gathered_bwd)


# (stacked, x, positions, segment_ids, select=) -> (x, the layers' statistics stacked [L', ...])
LayerFn = Callable[..., tuple[jax.Array, dict]]


def run(layers_fn: LayerFn, stacked: Any, x_BTD: jax.Array, positions_BT: jax.Array,
        segment_ids_BT: jax.Array, pipe: Pipeline, rows: tuple[str, ...] = ()
        ) -> tuple[jax.Array, dict]:
    """Apply all stacked layers (stored in `layer_order`) to x through the pipeline: (x, the
    layers' statistics as the stacked layers return them outside a pipeline, `_Sums`).

    `layers_fn(stacked, x, positions, segment_ids, select=...)` runs one stage's layers, where
    each stacked layer holds its R repeats' weights [R, ...] and `select` picks the ones this
    iteration runs (inside the layer, so the pick is recomputed in the backward, not saved).
    Its statistics (a mixture of experts' router sums) are per row [L', b, ...] where `rows`
    names them, else summed over the microbatch's rows [L', ...].
    """
    s, r, m = pipe.stages, pipe.repeats, pipe.microbatches
    # [S, L/(S*R), R, ...]: each stage's layers, every layer with its R repeats side by side. The
    # layer scan slices a layer's [R, ...] weights, and the layer picks this iteration's repeat
    # itself (`select`): a pick made here, outside the layers, would be a residual of every
    # iteration, one copy of the stage's weights per iteration in the backward.
    staged = jax.tree.map(
        lambda w: _stage_sharded(
            w.reshape(s, r, w.shape[0] // (s * r), *w.shape[1:]).swapaxes(1, 2)), stacked)
    x_MbTD = _microbatches(x_BTD, m)
    positions_MbT, segments_MbT = _microbatches(positions_BT, m), _microbatches(segment_ids_BT, m)
    names = ("act_stage", None, "act_batch", "act_seq", "act_embed")
    # The inputs stay spread over the stages, [S, K, b, T, D] with K = ceil(M/S): stage s holds
    # microbatches s*K ... s*K+K-1, and each iteration the one stage 0 needs is summed over the
    # stages from its owner (an all-reduce of one microbatch), instead of every stage receiving
    # every microbatch up front.
    k = -(-m // s)
    padded = jnp.pad(x_MbTD, [(0, s * k - m)] + [(0, 0)] * (x_MbTD.ndim - 1))
    inputs_SKbTD = constrain(padded.reshape(s, k, *x_MbTD.shape[1:]), names)
    # The last stage's outputs return to stage 0's slot of a buffer: read back for the next
    # repeat (circular) or as the result.
    buffer_SMbTD = constrain(jnp.zeros((s, *x_MbTD.shape), x_MbTD.dtype), names)
    state_SbTD = constrain(jnp.zeros_like(buffer_SMbTD[:, 0]), names[:1] + names[2:])

    def stage_fn(weights_LR, repeat, x_bTD, micro, positions_MbT, segments_MbT, valid, sums):
        pick = lambda w: jax.lax.dynamic_index_in_dim(w, repeat, 0, False)
        # Recomputed in the backward from the layer's [R, ...] weights, never saved.
        select = jax.checkpoint(lambda layer: jax.tree.map(pick, layer),
                                policy=jax.checkpoint_policies.nothing_saveable)
        out_bTD, stats = layers_fn(weights_LR, x_bTD, positions_MbT[micro], segments_MbT[micro],
                                   select=select)
        return out_bTD, counted.added(sums, stats, repeat, micro, valid)

    # One copy of the stage weights per data replica [S, data, ...] (and, to sum the gradient
    # whole, per fsdp device): its gradient is summed over the iterations on its own devices,
    # then over the copies once, by the broadcast's transpose. The layers read the weights
    # gathered over fsdp once, in the compute dtype (`_gathered`).
    copies = _copy_axes(pipe)
    leaves, tree = jax.tree.flatten(staged)
    specs = [spec if copies == ("data",) else _without_fsdp(spec)
             for spec in _layer_specs(stacked)]
    totals = [_copied(w, copies, spec) for w, spec in zip(leaves, specs)]
    whole = [_gathered(w, copies, spec, pipe.dtype) for w, spec in zip(totals, specs)]
    per_stage = _on_every_stage(stage_fn, copies)
    counted = _Sums(pipe, _count(copies), rows)
    # the statistics' shapes: one stage's layers on one microbatch, traced and not run
    one = lambda w: w[0, 0, :, 0]
    _, stats = jax.eval_shape(lambda: layers_fn(
        jax.tree.unflatten(tree, [one(w) for w in whole]), x_MbTD[0], positions_MbT[0],
        segments_MbT[0]))
    sums = constrain_sums(counted.zeros(stats), copies)

    def stages_fn(weights, repeat, x, micro, valid, sums):
        totals, whole = weights
        used = [_use_gathered(copies, spec, w.dtype, w, g)
                for spec, w, g in zip(specs, totals, whole)]
        return per_stage(jax.tree.unflatten(tree, used), repeat, x, micro, positions_MbT,
                         segments_MbT, valid, sums)

    staged = (totals, whole)
    carry = (state_SbTD, buffer_SMbTD, sums)
    carry, _ = jax.lax.scan(
        lambda c, t: (_iteration(stages_fn, staged, inputs_SKbTD, c, t, pipe), None),
        carry, jnp.arange(pipe.iterations))
    out_MbTD = carry[1][0]
    return out_MbTD.swapaxes(0, 1).reshape(x_BTD.shape), counted.gathered(carry[2])


def constrain_sums(sums: dict, copies: tuple[str, ...]) -> dict:
    """The statistics' buffers [S, C, ...] split over stage and the `copies` axes."""
    if jax.sharding.get_abstract_mesh().empty:
        return sums
    return {key: jax.lax.with_sharding_constraint(buf, P("stage", copies))
            for key, buf in sums.items()}


def _iteration(stages_fn, staged, inputs_SKbTD, carry, t, pipe: Pipeline):
    """One tick of the schedule: every stage runs its current item, then all move one stage on."""
    state_SbTD, buffer_SMbTD, sums = carry
    s, items, m = pipe.stages, pipe.microbatches * pipe.repeats, pipe.microbatches
    stage = jnp.arange(s)
    item = t - stage  # stage s works on item t - s: microbatch item % M in repeat item // M
    # Stage 0's next item: microbatch t from the stage that holds it (first repeat), else the
    # output of its previous repeat from the buffer.
    new_bTD = _from_owner(inputs_SKbTD, t)
    again_SbTD = jax.lax.dynamic_index_in_dim(buffer_SMbTD, t % m, 1, False)
    fresh_SbTD = jnp.where(t < m, new_bTD[None], again_SbTD)
    first = (stage == 0).reshape(s, *[1] * (state_SbTD.ndim - 1))
    inputs_SbTD = jnp.where(first, fresh_SbTD, state_SbTD)
    repeat = jnp.clip(item // m, 0, pipe.repeats - 1)
    out_SbTD, sums = stages_fn(staged, repeat, inputs_SbTD, item % m,
                               (item >= 0) & (item < items), sums)
    moved_SbTD = jnp.roll(out_SbTD, 1, axis=0)  # stage s -> s+1; the last rings back to stage 0
    # Stage 0 now holds the last stage's output of item t-(S-1): keep it for its next repeat, or
    # as the result when it was the last one.
    done = t - (s - 1)
    slot = done % m
    old_SbTD = jax.lax.dynamic_index_in_dim(buffer_SMbTD, slot, 1, False)
    keep = (done >= 0) & (done < items)
    buffer_SMbTD = jax.lax.dynamic_update_index_in_dim(
        buffer_SMbTD, jnp.where(keep, moved_SbTD, old_SbTD), slot, 1)
    return moved_SbTD, buffer_SMbTD, sums
