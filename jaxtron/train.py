"""The training loop: feed, step, checkpoint, evaluate, log; preemption and non-finite steps.

`train(cfg)` reads top to bottom: mesh and plan (every check, before anything is allocated), run
directory and writers, input, state (restored or born sharded), the step compiled once, the loop.
"""

from __future__ import annotations

import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh

from jaxtron import attention as attention_lib
from jaxtron import config as config_lib
from jaxtron import data as data_lib
from jaxtron import metrics as metrics_lib
from jaxtron import parallel, pipeline
from jaxtron.checkpoint import Checkpoints
from jaxtron.config import Config
from jaxtron.model import check_remat
from jaxtron.optim import make_optimizer
from jaxtron.state import initial_state, make_plan
from jaxtron.step import abstract_batch, compile_eval, compile_step, evaluate, global_batch


def train(cfg: Config, devices: list | None = None) -> list[dict]:
    """Train per `cfg`, resuming from the latest checkpoint in run.dir; returns the logged rows."""
    # Mesh and plan: every check runs here, before anything is allocated or compiled.
    devices = jax.devices() if devices is None else devices
    cfg = attention_lib.configure(cfg, devices[0].platform)
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
    if cfg.model.attention != "xla" and cfg.model.attention_check:
        attention_lib.self_check(cfg.model.attention)  # a ConfigError: one line, exit 2
        log.info(f"attention: {cfg.model.attention} agrees with the xla reference on a packed "
                 "batch (forward and gradient)")
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
    run = RunContext(mesh, Checkpoints(cfg.checkpoint, run_dir), log, batches, eval_batches,
                     metrics_lib.StepCost.of(cfg, devices))
    try:
        with jax.set_mesh(mesh), Preemption() as run.preemption:
            state, start, tokens_seen = initial_state(cfg, plan, tx, mesh, ckpt=run.ckpt,
                                                      batches=batches, info=log.info)
            if start >= cfg.train.steps:
                log.info(f"nothing to do: step {start} >= train.steps={cfg.train.steps}")
                return []
            with run.watch.time("compile"):
                lowered = compile_step(cfg, plan, tx, mesh).lower(state, abstract_batch(cfg, mesh))
                run.step_fn = lowered.compile()
            log.info(f"compiled the train step in {run.watch.totals['compile']:.1f} s")
            run.eval_fn = compile_eval(plan, mesh, cfg.train.loss_chunk)
            return _loop(cfg, run, state, start, tokens_seen)
    finally:
        run.ckpt.close()  # the last async save is on disk before we return, also on error
        log.close()


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
    """What the loop uses besides the state: where it runs, its input, what it calls, and what it
    reports to. The compiled functions and the preemption flag are filled in as they are made."""

    mesh: Mesh
    ckpt: Checkpoints
    log: metrics_lib.MetricsWriter
    batches: data_lib.BatchIterator
    eval_batches: list[dict]
    cost: metrics_lib.StepCost
    watch: metrics_lib.Stopwatch = field(default_factory=metrics_lib.Stopwatch)
    preemption: Preemption | None = None
    step_fn: Callable | None = None
    eval_fn: Callable | None = None


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


def _loop(cfg: Config, run: RunContext, state: dict, start: int, tokens_seen: int) -> list[dict]:
    """Steps start+1 .. train.steps: feed, step, checkpoint, evaluate, log."""
    steps, watch, batches, preemption = cfg.train.steps, run.watch, run.batches, run.preemption
    history, last_time, last_step, previous = [], time.perf_counter(), start, None
    for step in range(start + 1, steps + 1):
        with watch.time("data"):  # overlaps the previous step, which runs asynchronously
            batch = global_batch(next(batches), run.mesh)
        state, pending = run.step_fn(state, batch)
        tokens_seen += run.cost.tokens
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
            row = metrics_lib.make_row(step, fetched, (now - last_time) / (step - last_step),
                                       run.cost)
            history.append(row)
            run.log.write(row)
            last_time, last_step = now, step
        if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == steps):
            with watch.time("eval"):
                loss = evaluate(run.eval_fn, state["params"], run.eval_batches, run.mesh)
                run.log.write_eval(step, loss)
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

