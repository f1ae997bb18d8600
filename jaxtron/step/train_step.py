"""The step: the loss (summed over real tokens), its gradient with accumulation over microbatches,
the pure train step, and its compilation with explicit shardings and state donation. Also the
global batch as sharded arrays, the same for every process layout.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtron import parallel
from jaxtron.config import Config, ConfigError
from jaxtron.data.rows import local_rows
from jaxtron.model import deepseek, moe
from jaxtron.ops import fp8, layer_ops
from jaxtron.parallel import pipeline
from jaxtron.step.optim import lr_schedule, schedule_count
from jaxtron.step.state import Plan

BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions")



def loss_sums(params: dict, graphdef: Any, batch: dict, pipe: pipeline.Pipeline | None = None,
              chunk: int = 0, histories: dict | None = None, with_stats: bool = False,
              ops: layer_ops.LayerOps | None = None):
    """Summed next-token cross-entropy over real (non-padding) tokens, and their count.

    A mixture of experts adds model.moe.aux_coef x the load-balancing loss and z_coef x the
    z-loss, each summed over tokens (moe.objective): the mean objective is the cross-entropy plus
    the weighted router losses, and a sum over rows, so microbatches add up to the whole batch.
    With model.mtp_depth, model.mtp_coef / depth x the multi-token-prediction modules' summed
    cross-entropy joins it too (stats mtp_entropy and mtp_tokens; deepseek.py).
    `with_stats`: (objective sum, (count, cross-entropy sum, the router sums moe.step_sums of
    this batch, {} for a dense model)).

    With `chunk` > 0 the LM head and the cross-entropy run over chunks of `chunk` positions
    (jaxtron/ops/vocab.py): only one chunk's float32 logits exist at a time, forward and backward.
    Under a mesh the head is gathered in the compute dtype and its gradient leaves by one
    reduce-scatter; without one the compiler partitions plain ops. Same value and gradient.
    `histories`: the FP8 amax histories the model reads (model.fp8; jaxtron/ops/fp8.py).
    `ops`: the operations set (Plan.ops); none: the ambient mesh's, with the layers through
    `pipe`'s stages when given."""
    model = nnx.merge(graphdef, params, *([] if histories is None else [histories]))
    ops = ops or layer_ops.here(model.cfg, pipe)
    if ops.pipe is not None and ops.pipe.explicit:  # 1F1B: the loss inside the ticks
        total, entropy, stats, batch = model.staged_loss(batch, ops, chunk)
        count = jnp.sum(batch["segment_ids"] != 0)
        return (total, (count, entropy, stats)) if with_stats else (total, count)
    depth = model.cfg.mtp_depth
    x_BTD, batch, layer_stats = model.hidden(deepseek.mtp_batch(batch, depth) if depth else batch,
                                             ops)
    mtp_DBTD = layer_stats.pop("mtp", None)
    mask_BT = batch["segment_ids"] != 0
    total = ops.head_loss(model, x_BTD, batch["targets"], mask_BT, chunk)
    count, entropy, stats = jnp.sum(mask_BT), total, {}
    if layer_stats:
        stats = moe.step_sums(layer_stats, jnp.sum(mask_BT, axis=1))
        total = total + moe.objective(stats, model.cfg)
    if mtp_DBTD is not None:  # model.mtp_depth: each depth's cross-entropy through the head
        valid = [batch[f"mtp_valid/{k}"] != 0 for k in range(depth)]
        stats["mtp_entropy"] = sum(ops.head_loss(model, mtp_DBTD[k], batch[f"mtp_targets/{k}"],
                                                 valid[k], chunk) for k in range(depth))
        stats["mtp_tokens"] = sum(jnp.sum(v) for v in valid).astype(jnp.float32)
        total = total + model.cfg.mtp_coef / depth * stats["mtp_entropy"]
    return (total, (count, entropy, stats)) if with_stats else (total, count)


def loss_and_grads(params: dict, graphdef: Any, batch: dict, microbatches: int,
                   pipe: pipeline.Pipeline | None = None, chunk: int = 0,
                   histories: dict | None = None, ops: layer_ops.LayerOps | None = None):
    """(mean cross-entropy, the gradient of the mean objective, extras): with microbatches > 1
    the sums and gradients over microbatches in a scan (each one a pass through the pipeline
    when `pipe` is set). extras["fp8"]: the FP8 amaxes observed, the larger of each microbatch's;
    they (`fp8.observed_scale`, `observe_grad`) are the gradient with respect to `histories`;
    None without them, and under a pipeline, whose iterations would add them up. extras["moe"]:
    the router sums (moe.step_sums) added over microbatches, {} for a dense model; extras
    ["tokens"]: the real tokens. Every term is a sum over rows, so the objective and its
    gradient are the same for any microbatch count."""
    observe = histories is not None and pipe is None

    def grad_fn(micro):
        fn = functools.partial(loss_sums, graphdef=graphdef, batch=micro, pipe=pipe, chunk=chunk,
                               with_stats=True, ops=ops)
        (part, (n, entropy, stats)), grads = jax.value_and_grad(
            lambda p, h: fn(p, histories=h), argnums=(0, 1) if observe else 0,
            has_aux=True)(params, histories)
        g, seen = grads if observe else (grads, None)
        return entropy, n, g, (seen, stats)

    if microbatches == 1:
        total, count, grads, (observed, stats) = grad_fn(batch)
    else:
        # Row i*M + m goes to microbatch m: every device keeps its own rows, nothing moves.
        def split(x_BT):
            b, t = x_BT.shape
            x = x_BT.reshape(b // microbatches, microbatches, t).swapaxes(0, 1)
            return parallel.constrain(x, (None, "act_batch", None))

        def accumulate(carry, micro):
            part, n, g, (seen, stats) = grad_fn(micro)
            total, count, grads, (observed, summed) = carry
            return (total + part, count + n, jax.tree.map(jnp.add, grads, g),
                    (fp8.combine(observed, seen), jax.tree.map(jnp.add, summed, stats))), None

        zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32),
                 jax.tree.map(jnp.zeros_like, params),
                 (jax.tree.map(jnp.zeros_like, histories) if observe else None,
                  moe.zero_stats(params)))
        (total, count, grads, (observed, stats)), _ = jax.lax.scan(accumulate, zeros,
                                                                   jax.tree.map(split, batch))
    tokens = count
    count = jnp.maximum(count, 1).astype(jnp.float32)
    return (total / count, jax.tree.map(lambda g: g / count, grads),
            {"fp8": observed, "moe": stats, "tokens": tokens})


def empty_histories(histories: dict) -> dict | None:
    """Zeros of the plan's FP8 amax histories (Plan.histories), None without FP8: what a step
    reads under tensorwise (the amaxes' way out), and where scales come from each tensor's own
    amax."""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), histories) if histories else None


def _histories_in(state: dict, histories: dict) -> dict | None:
    """The FP8 amax histories a step reads: the state's (model.fp8=delayed), else empty ones."""
    return state["fp8"] if "fp8" in state else empty_histories(histories)


def train_step(state: dict, batch: dict, *, graphdef, tx, schedule, microbatches: int,
               pipe: pipeline.Pipeline | None = None, chunk: int = 0,
               histories: dict | None = None, capacity: bool = False,
               ops: layer_ops.LayerOps | None = None, balance: float = 0.0):
    """One optimizer update. Pure: the caller jits it once and donates `state`.

    A non-finite loss or gradient leaves params and optimizer state (and FP8 histories) as they
    were and counts the skip in `nonfinite` (consecutive skips); the host decides whether to go
    on. `histories`: the plan's abstract FP8 amax histories (Plan.histories). `capacity`: the
    experts have one (model.moe.capacity_factor), so the dropped share is a metric. `ops`: the
    operations set the model calls (Plan.ops). `balance`: model.moe.bias_update_speed, the step
    by which the experts' balancing biases move after the update (moe.rebalanced).
    """
    seen_by = _histories_in(state, histories)
    loss, grads, extras = loss_and_grads(state["params"], graphdef, batch, microbatches, pipe,
                                         chunk, seen_by, ops)
    observed = extras["fp8"]
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    params = optax.apply_updates(state["params"], updates)
    if balance:
        params = moe.rebalanced(params, extras["moe"]["picked"], balance)
    new_state = {
        "params": keep(params, state["params"]),
        "opt_state": keep(opt_state, state["opt_state"]),
        "step": state["step"] + 1,
        "nonfinite": jnp.where(finite, 0, state["nonfinite"] + 1),
    }
    if "fp8" in state:
        new_state["fp8"] = keep(fp8.advance(state["fp8"], observed), state["fp8"])
    # The rate optax applied: its schedule counts applied updates, so skipped steps do not count.
    lr = schedule(schedule_count(state["opt_state"]))
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr,
               "nonfinite": new_state["nonfinite"]}
    if observed is not None:
        metrics.update(fp8.statistics(seen_by, observed, delayed="fp8" in state))
    sums = extras["moe"]
    if sums and ops is not None and ops.pipe is not None:  # each layer's load at its index
        sums = {**sums, "picked": pipeline.in_model_order(sums["picked"], ops.pipe,
                                                          ops.cfg.staged_layers)}
    metrics.update(moe.metrics(sums, extras["tokens"], capacity,
                               ops.cfg.moe.first_dense if ops else 0))
    return new_state, metrics


def compile_step(cfg: Config, plan: Plan, tx, mesh: Mesh):
    """jit with explicit in/out shardings and state donation."""
    step_fn = functools.partial(
        train_step, graphdef=plan.graphdef, tx=tx,
        schedule=lr_schedule(cfg.optim, cfg.train.steps), microbatches=plan.accumulation,
        pipe=plan.pipe, chunk=cfg.train.loss_chunk, histories=plan.histories,
        capacity=cfg.model.moe.num_experts > 0 and cfg.model.moe.capacity_factor > 0, ops=plan.ops,
        balance=cfg.model.moe.bias_update_speed,
    )
    state_shardings = parallel.named(plan.specs, mesh)
    batch_sharding = NamedSharding(mesh, parallel.batch_spec())
    replicated = NamedSharding(mesh, P())
    return jax.jit(
        step_fn,
        in_shardings=(state_shardings, {k: batch_sharding for k in BATCH_KEYS}),
        out_shardings=(state_shardings, replicated),
        donate_argnums=0,
    )


def compile_eval(plan: Plan, mesh: Mesh, chunk: int = 0):
    """Summed loss and token count of one batch under the current params (no update). With
    model.fp8 the matmuls scale by each tensor's amax of this batch (empty histories)."""
    fn = functools.partial(loss_sums, graphdef=plan.graphdef, pipe=plan.pipe, chunk=chunk,
                           with_stats=True, ops=plan.ops)

    def sums(params, batch):  # the cross-entropy alone, without the MoE router losses
        _, (count, entropy, _) = fn(params, batch=batch,
                                    histories=empty_histories(plan.histories))
        return entropy, count

    batch_sharding = NamedSharding(mesh, parallel.batch_spec())
    return jax.jit(
        sums,
        in_shardings=(parallel.named(plan.specs["params"], mesh),
                      {k: batch_sharding for k in BATCH_KEYS}),
        out_shardings=NamedSharding(mesh, P()),
    )


def evaluate(eval_fn, params: dict, eval_batches: list[dict], mesh: Mesh,
             stopped: Callable[[], bool] = lambda: False) -> float | None:
    """Mean next-token loss over the held-out batches (the same batches every time); None when
    `stopped()` turns true first (checked per batch, with at most 8 batches in flight)."""
    sums = []
    for batch in eval_batches:
        if stopped():
            return None
        sums.append(eval_fn(params, global_batch(batch, mesh)))
        if len(sums) > 8:
            jax.block_until_ready(sums[-9])
    sums = jax.device_get(sums)
    total = sum(float(s) for s, _ in sums)
    count = sum(int(n) for _, n in sums)
    return total / max(count, 1)


def global_batch(batch: dict, mesh: Mesh, batch_size: int | None = None) -> dict:
    """A numpy batch -> one jax.Array per key, sharded over the batch axes. `batch` holds this
    process's rows (rows.local_rows) of a global batch of `batch_size` rows, or (None) all of
    them. Each local device takes its own shard out of those rows, so any mesh over any process
    layout works, also where a batch shard spans processes (pipeline stages or tensor ranks on
    other hosts)."""
    check_segments(batch["segment_ids"])
    sharding = NamedSharding(mesh, parallel.batch_spec())
    seq_len = batch[BATCH_KEYS[0]].shape[1]
    mine = None if batch_size is None else local_rows(mesh, batch_size, seq_len)
    if mine is not None and len(batch[BATCH_KEYS[0]]) != len(mine):
        raise ValueError(f"a batch of {len(batch[BATCH_KEYS[0]])} rows where this process holds "
                         f"{len(mine)} of {batch_size}")

    def put(rows: np.ndarray) -> jax.Array:
        if mine is None:
            return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])
        return jax.make_array_from_callback((batch_size, seq_len), sharding,
                                            lambda index: rows[mine.positions(index[0]), index[1]])

    return {k: put(batch[k]) for k in BATCH_KEYS}


def check_segments(segment_ids: np.ndarray) -> None:
    """Each document's segment id in a row is one contiguous run (0: padding): what the packer
    makes, and what the context-parallel cuDNN split assumes (its prefix call finds a piece's
    first document by the first occurrence of its id: model.context_attention). A batch made
    elsewhere that reuses an id further along a row is refused before it reaches the model."""
    ids = np.asarray(segment_ids)
    starts = np.ones(ids.shape, bool)
    starts[:, 1:] = ids[:, 1:] != ids[:, :-1]
    rows, cols = np.nonzero(starts & (ids != 0))
    keys = rows.astype(np.int64) * (int(ids.max(initial=0)) + 1) + ids[rows, cols]
    unique, counts = np.unique(keys, return_counts=True)
    if len(unique) != len(keys):
        row, seg = divmod(int(unique[counts > 1][0]), int(ids.max(initial=0)) + 1)
        raise ConfigError(f"segment id {seg} appears in two separate runs of batch row {row}: "
                          "each document's segment_ids must be one contiguous run (number "
                          "documents 1, 2, ... along a row, 0 for padding)")


def abstract_batch(cfg: Config, mesh: Mesh) -> dict:
    """Shapes and shardings of one global batch (for ahead-of-time compilation)."""
    sharding = NamedSharding(mesh, parallel.batch_spec())
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for k in BATCH_KEYS}

