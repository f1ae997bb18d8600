"""State born sharded, the pure train step, and the training loop.

The state is a plain dict pytree {params, opt_state, step}; params are the model's NNX state as a
pure dict, merged with a static graphdef inside the jitted step (no nnx.jit on the hot path).
"""

from __future__ import annotations

import functools
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jaxtron import config as config_lib
from jaxtron import data as data_lib
from jaxtron import metrics as metrics_lib
from jaxtron import model as model_lib
from jaxtron import parallel
from jaxtron import pipeline
from jaxtron.checkpoint import Checkpoints, restore_from
from jaxtron.config import Config
from jaxtron.model import Transformer, abstract_model, check_remat, count_params
from jaxtron.optim import lr_schedule, make_optimizer, schedule_count

BATCH_KEYS = ("tokens", "targets", "segment_ids", "positions")


# ---------------------------------------------------------------- plan: shapes, specs, memory
@dataclass(frozen=True)
class Plan:
    """Everything known before allocating: structure, shardings, sizes."""

    graphdef: Any
    abstract: dict  # {params, opt_state, step} of ShapeDtypeStructs
    specs: dict  # the same tree of mesh PartitionSpecs
    mesh_sizes: dict[str, int]
    num_params: int
    pipe: pipeline.Pipeline | None  # the layers' pipeline over mesh.stage, None for one stage
    accumulation: int  # sequential gradient-accumulation steps: microbatches, or pipeline passes
    layer_order: np.ndarray  # stored index -> model layer (pipeline.layer_order)

    def bytes_per_device(self, part: str) -> int:
        return parallel.bytes_per_device(self.abstract[part], self.specs[part], self.mesh_sizes)


def make_plan(cfg: Config, tx: optax.GradientTransformation, num_devices: int) -> Plan:
    """Validate the layout against `num_devices` and derive every shape and sharding."""
    model_lib.check(cfg.model)
    sizes = parallel.mesh_shape(cfg.mesh, num_devices)
    pipeline.check(cfg, sizes["stage"])
    parallel.check_layout(cfg, sizes)
    graphdef, abstract_state = nnx.split(abstract_model(cfg.model))
    params = nnx.to_pure_dict(abstract_state)
    param_specs = parallel.mesh_specs(parallel.logical_specs(abstract_state))
    parallel.check_divisible(params, param_specs, sizes)
    opt_state = jax.eval_shape(tx.init, params)
    opt_specs = optax.tree_map_params(
        tx, lambda _, s: s, opt_state, param_specs,
        transform_non_params=lambda _: P(), is_leaf=lambda x: isinstance(x, P),
    )
    scalar = jax.ShapeDtypeStruct((), jnp.int32)
    abstract = {"params": params, "opt_state": opt_state, "step": scalar, "nonfinite": scalar}
    specs = {"params": param_specs, "opt_state": opt_specs, "step": P(), "nonfinite": P()}
    pipe = pipeline.from_config(cfg, sizes["stage"])
    accumulation = cfg.pipeline.passes if pipe else cfg.train.microbatches
    return Plan(graphdef, abstract, specs, sizes, count_params(params), pipe, accumulation,
                pipeline.config_order(cfg, sizes["stage"]))


def init_state(cfg: Config, plan: Plan, tx: optax.GradientTransformation, mesh: Mesh) -> dict:
    """Initialise the state directly into its shardings: no full copy on any one device."""

    def init() -> dict:
        params = nnx.to_pure_dict(nnx.state(Transformer(cfg.model, nnx.Rngs(cfg.train.seed))))
        model_order = np.arange(cfg.model.num_layers)
        params["layers"] = pipeline.reorder(params["layers"], model_order, plan.layer_order)
        return fresh_state(params, tx)

    return jax.jit(init, out_shardings=parallel.named(plan.specs, mesh))()


def fresh_state(params: dict, tx: optax.GradientTransformation) -> dict:
    """The train state around `params`: new optimizer state, step 0."""
    zero = jnp.zeros((), jnp.int32)
    return {"params": params, "opt_state": tx.init(params), "step": zero, "nonfinite": zero}


def fresh_state_around(params: dict, tx: optax.GradientTransformation, shardings: dict) -> dict:
    """fresh_state on restored params, in `shardings`; the params are donated, so the state takes
    over their buffers instead of holding a second copy."""
    return jax.jit(functools.partial(fresh_state, tx=tx), out_shardings=shardings,
                   donate_argnums=0)(params)


# ---------------------------------------------------------------- the step
def loss_sums(params: dict, graphdef: Any, batch: dict,
              pipe: pipeline.Pipeline | None = None) -> tuple[jax.Array, jax.Array]:
    """Summed next-token cross-entropy over real (non-padding) tokens, and their count."""
    model = nnx.merge(graphdef, params)
    run_layers = None if pipe is None else functools.partial(pipeline.run, pipe=pipe)
    logits_BTV = model(batch["tokens"], batch["positions"], batch["segment_ids"], run_layers)
    logz_BT = jax.nn.logsumexp(logits_BTV, axis=-1)
    target_BT = jnp.take_along_axis(logits_BTV, batch["targets"][..., None], axis=-1)[..., 0]
    mask_BT = batch["segment_ids"] != 0
    return jnp.sum(jnp.where(mask_BT, logz_BT - target_BT, 0.0)), jnp.sum(mask_BT)


def loss_and_grads(params: dict, graphdef: Any, batch: dict, microbatches: int,
                   pipe: pipeline.Pipeline | None = None):
    """Mean loss and its gradient; with microbatches > 1, summed over microbatches in a scan
    (each one a pass through the pipeline when `pipe` is set)."""
    grad_fn = jax.value_and_grad(functools.partial(loss_sums, pipe=pipe), has_aux=True)
    if microbatches == 1:
        (total, count), grads = grad_fn(params, graphdef, batch)
    else:
        # Row i*M + m goes to microbatch m: every device keeps its own rows, nothing moves.
        def split(x_BT):
            b, t = x_BT.shape
            x = x_BT.reshape(b // microbatches, microbatches, t).swapaxes(0, 1)
            return parallel.constrain(x, (None, "act_batch", None))

        def accumulate(carry, micro):
            (part, n), g = grad_fn(params, graphdef, micro)
            return jax.tree.map(jnp.add, carry, (part, n, g)), None

        zeros = (jnp.zeros((), jnp.float32), jnp.zeros((), jnp.int32),
                 jax.tree.map(jnp.zeros_like, params))
        (total, count, grads), _ = jax.lax.scan(accumulate, zeros, jax.tree.map(split, batch))
    count = jnp.maximum(count, 1).astype(jnp.float32)
    return total / count, jax.tree.map(lambda g: g / count, grads)


def train_step(state: dict, batch: dict, *, graphdef, tx, schedule, microbatches: int,
               pipe: pipeline.Pipeline | None = None):
    """One optimizer update. Pure: the caller jits it once and donates `state`.

    A non-finite loss or gradient leaves params and optimizer state as they were and counts the
    skip in `nonfinite` (consecutive skips); the host decides whether to go on.
    """
    loss, grads = loss_and_grads(state["params"], graphdef, batch, microbatches, pipe)
    grad_norm = optax.tree.norm(grads)
    updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = {
        "params": keep(optax.apply_updates(state["params"], updates), state["params"]),
        "opt_state": keep(opt_state, state["opt_state"]),
        "step": state["step"] + 1,
        "nonfinite": jnp.where(finite, 0, state["nonfinite"] + 1),
    }
    # The rate optax applied: its schedule counts applied updates, so skipped steps do not count.
    lr = schedule(schedule_count(state["opt_state"]))
    metrics = {"loss": loss, "grad_norm": grad_norm, "lr": lr,
               "nonfinite": new_state["nonfinite"]}
    return new_state, metrics


def compile_step(cfg: Config, plan: Plan, tx, mesh: Mesh):
    """jit with explicit in/out shardings and state donation."""
    step_fn = functools.partial(
        train_step, graphdef=plan.graphdef, tx=tx,
        schedule=lr_schedule(cfg.optim, cfg.train.steps), microbatches=plan.accumulation,
        pipe=plan.pipe,
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


def compile_eval(plan: Plan, mesh: Mesh):
    """Summed loss and token count of one batch under the current params (no update)."""
    fn = functools.partial(loss_sums, graphdef=plan.graphdef, pipe=plan.pipe)
    batch_sharding = NamedSharding(mesh, parallel.batch_spec())
    return jax.jit(
        lambda params, batch: fn(params, batch=batch),
        in_shardings=(parallel.named(plan.specs["params"], mesh),
                      {k: batch_sharding for k in BATCH_KEYS}),
        out_shardings=NamedSharding(mesh, P()),
    )


def evaluate(eval_fn, params: dict, eval_batches: list[dict], mesh: Mesh) -> float:
    """Mean next-token loss over the held-out batches (the same batches every time)."""
    sums = jax.device_get([eval_fn(params, global_batch(b, mesh)) for b in eval_batches])
    total = sum(float(s) for s, _ in sums)
    count = sum(int(n) for _, n in sums)
    return total / max(count, 1)


def global_batch(batch: dict, mesh: Mesh) -> dict:
    """The global numpy batch (the same on every process) -> one jax.Array per key, sharded over
    the batch axes. Each local device takes its own shard out of the global rows, so any mesh
    over any process layout works, also where a batch shard spans processes (pipeline stages or
    tensor ranks on other hosts)."""
    sharding = NamedSharding(mesh, parallel.batch_spec())

    def put(rows: np.ndarray) -> jax.Array:
        return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])

    return {k: put(batch[k]) for k in BATCH_KEYS}


# ---------------------------------------------------------------- the loop
def train(cfg: Config, devices: list | None = None) -> list[dict]:
    """Train per `cfg`, resuming from the latest checkpoint in run.dir; returns the logged rows."""
    # Mesh and plan: every check runs here, before anything is allocated or compiled.
    devices = jax.devices() if devices is None else devices
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    plan = make_plan(cfg, tx, len(devices))
    check_remat(cfg.model, devices[0])
    mesh = parallel.make_mesh(cfg.mesh, devices)

    # Run directory and writers.
    run_dir = Path(cfg.run.dir)
    is_main = jax.process_index() == 0
    if is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.yaml").write_text(config_lib.to_yaml(cfg))
    log = metrics_lib.MetricsWriter(run_dir, cfg.train.steps, cfg.run.progress,
                                    cfg.run.tensorboard, is_main)
    log.info(config_lib.to_yaml(cfg).rstrip())
    log.info(f"mesh: {plan.mesh_sizes} over {len(devices)} {devices[0].device_kind} devices")
    log.info(f"parameters: {plan.num_params:,}")
    if plan.pipe:
        log.info(pipeline.describe(plan.pipe, cfg.pipeline.schedule, plan.accumulation))

    # Input: checked against the model before anything compiles.
    data_lib.check_dataset(cfg.data, cfg.model.vocab_size)
    # Every process reads the same global batches; global_batch gives each device its shard.
    batches = data_lib.make_batches(cfg.data, cfg.train, cfg.model.vocab_size)
    eval_batches = []
    if cfg.train.eval_every:
        eval_batches = data_lib.make_eval_batches(cfg.data, cfg.train, cfg.model.vocab_size)
    log.info(data_lib.corpus_summary(cfg.data, cfg.model.vocab_size))

    # State: restored from the latest checkpoint, else born sharded; the step compiled once.
    run = RunContext(mesh, devices, Checkpoints(cfg.checkpoint, run_dir), log,
                     metrics_lib.Stopwatch())
    try:
        with jax.set_mesh(mesh), Preemption() as preemption:
            state, start, tokens_seen = initial_state(cfg, plan, tx, run, batches)
            if start >= cfg.train.steps:
                log.info(f"nothing to do: step {start} >= train.steps={cfg.train.steps}")
                return []
            with run.watch.time("compile"):
                step_fn = compile_step(cfg, plan, tx, mesh).lower(state, abstract_batch(cfg, mesh))
                step_fn = step_fn.compile()
            log.info(f"compiled the train step in {run.watch.totals['compile']:.1f} s")
            eval_fn = compile_eval(plan, mesh)
            return _loop(cfg, run, state, step_fn, eval_fn, batches, eval_batches, start,
                         tokens_seen, preemption)
    finally:
        run.ckpt.close()  # the last async save is on disk before we return, also on error
        log.close()


def initial_state(cfg: Config, plan: Plan, tx, run: "RunContext",
                  batches) -> tuple[dict, int, int]:
    """(state, step, tokens seen): the newest readable checkpoint of run.dir, else
    checkpoint.restore, else fresh weights."""
    shardings = parallel.named(plan.specs, run.mesh)
    restored = run.ckpt.restore_latest(plan.abstract, shardings, batches, run.log.info)
    if restored is not None:
        step, state, meta = restored
        state = in_layer_order(state, meta, plan, tx, shardings, run.log.info)
        run.log.info(f"resumed from {run.ckpt.manager.directory} step {step} "
                     f"(loss {meta['loss']:.4f}, {meta['tokens_seen']:,} tokens seen)")
        return state, step, meta["tokens_seen"]
    if not cfg.checkpoint.restore:
        return init_state(cfg, plan, tx, run.mesh), 0, 0
    state, meta = restore_from(cfg.checkpoint.restore, plan.abstract, shardings, batches,
                               cfg.checkpoint.weights_only)
    if cfg.checkpoint.weights_only:
        params = in_layer_order(state, meta, plan, tx, shardings, run.log.info)["params"]
        state = fresh_state_around(params, tx, shardings)
        run.log.info(f"weights from {cfg.checkpoint.restore}; optimizer and data start fresh")
        return state, 0, 0
    state = in_layer_order(state, meta, plan, tx, shardings, run.log.info)
    run.log.info(f"started from {cfg.checkpoint.restore} (step {meta['step']})")
    return state, int(meta["step"]), meta["tokens_seen"]


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
            out["opt_state"] = optax.tree_map_params(tx, move, state["opt_state"], is_layer,
                                                     transform_non_params=lambda x: x)
        return out

    info("layers reordered from the checkpoint's pipeline layout to this run's")
    # Donated: the permuted state takes the restored one's buffers, never two copies at once.
    return jax.jit(permute, out_shardings={k: shardings[k] for k in state},
                   donate_argnums=0)(state)


class NonFiniteError(RuntimeError):
    """Training met a NaN/inf loss or gradient and train.on_nonfinite says to stop."""


class Preempted(RuntimeError):
    """SIGTERM/SIGINT arrived; a checkpoint of the current step was saved."""


class Preemption:
    """SIGTERM/SIGINT -> a flag the loop reads at step boundaries. Under jax.distributed JAX's
    own notifier owns SIGTERM and its sync point makes every process stop at the same step."""

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "Preemption":
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        self.signal = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def requested(self, step: int) -> bool:
        if jax.process_count() > 1:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.signal is not None


@dataclass
class RunContext:
    """What the loop uses besides the state: where, and what it reports to."""

    mesh: Mesh
    devices: list
    ckpt: Checkpoints
    log: metrics_lib.MetricsWriter
    watch: metrics_lib.Stopwatch


def abstract_batch(cfg: Config, mesh: Mesh) -> dict:
    """Shapes and shardings of one global batch (for ahead-of-time compilation)."""
    sharding = NamedSharding(mesh, parallel.batch_spec())
    shape = (cfg.train.batch_size, cfg.train.seq_len)
    return {k: jax.ShapeDtypeStruct(shape, jnp.int32, sharding=sharding) for k in BATCH_KEYS}


def _check_finite(cfg: Config, run: RunContext, step: int, pending: dict) -> None:
    """Act on a step's non-finite count (fetched one step late, so the device stays busy)."""
    skips = int(pending["nonfinite"])
    if skips == 0:
        return
    if cfg.train.on_nonfinite == "stop":
        raise NonFiniteError(f"non-finite loss or gradient at step {step}; stopped without saving "
                             "(train.on_nonfinite=stop)")
    run.log.info(f"step {step}: non-finite loss or gradient, update skipped ({skips} in a row)")
    if skips > cfg.train.max_nonfinite_skips:
        raise NonFiniteError(f"{skips} non-finite steps in a row up to step {step}, more than "
                             f"train.max_nonfinite_skips={cfg.train.max_nonfinite_skips}; stopped")


def _loop(cfg: Config, run: RunContext, state, step_fn, eval_fn, batches, eval_batches, start,
          tokens_seen: int, preemption: Preemption):
    """Steps start+1 .. train.steps: feed, step, checkpoint, evaluate, log."""
    steps, watch = cfg.train.steps, run.watch
    tokens_per_step = cfg.train.batch_size * cfg.train.seq_len
    flops_per_step = metrics_lib.flops_per_token(cfg.model, cfg.train.seq_len) * tokens_per_step
    history, last_time, last_step, previous = [], time.perf_counter(), start, None
    for step in range(start + 1, steps + 1):
        with watch.time("data"):  # overlaps the previous step, which runs asynchronously
            batch = global_batch(next(batches), run.mesh)
        state, pending = step_fn(state, batch)
        tokens_seen += tokens_per_step
        if previous is not None:
            _check_finite(cfg, run, *previous)
        previous = (step, pending)
        stop = preemption.requested(step)
        if run.ckpt.due(step, steps) or stop:
            _check_finite(cfg, run, step, pending)  # never save a state that met a NaN under "stop"
            meta = {"step": step, "loss": float(pending["loss"]),  # waits for the step to finish
                    "tokens_seen": tokens_seen, "time": time.time(),
                    "config": config_lib.to_yaml(cfg),
                    "layer_order": pipeline.config_order(cfg, run.mesh.shape["stage"]).tolist()}
            with watch.time("checkpoint"):  # only the save's own blocking part
                run.ckpt.save(step, state, batches, meta)
            run.log.info(f"checkpoint {step}: the loop was blocked {watch.last:.2f} s "
                         "(the write goes on in the background)")
        if step % cfg.train.log_every == 0 or step == steps:
            fetched = jax.device_get(pending)  # host sync point
            now = time.perf_counter()
            row = metrics_lib.make_row(
                step, float(fetched["loss"]), float(fetched["lr"]), float(fetched["grad_norm"]),
                (now - last_time) / (step - last_step), tokens_per_step, flops_per_step,
                len(run.devices), run.devices[0].device_kind,
            )
            history.append(row)
            run.log.write(row)
            last_time, last_step = now, step
        if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == steps):
            with watch.time("eval"):
                run.log.write_eval(step, evaluate(eval_fn, state["params"], eval_batches, run.mesh))
            last_time += watch.last  # evaluation time is not training step time
        if stop:
            why = f"signal {preemption.signal}" if preemption.signal else "preemption notice"
            run.log.info(f"{why}: saved step {step}; rerun to resume")
            raise Preempted(f"preempted at step {step}")
    for phase in ("data", "checkpoint", "eval"):
        run.log.scalar(f"time/{phase}_s", watch.totals.get(phase, 0.0), steps)
    final = f"final loss {history[-1]['loss']:.4f}, " if history else ""
    run.log.info(f"done: step {steps}, {final}waited {watch.totals.get('data', 0.0):.1f} s for "
                 f"data, {watch.totals.get('checkpoint', 0.0):.1f} s blocked on checkpoints")
    return history
