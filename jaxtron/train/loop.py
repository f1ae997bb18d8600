"""The training loop: feed, step, checkpoint, evaluate, log; preemption and non-finite steps.

`train(cfg)` reads top to bottom in its parts: the set-up and mesh (`_set_up`: every check,
before anything is allocated), the input (`_Input`), run directory and writers, what the start
says (`_say_start`), the attempt's context (`RunContext.begin`), the state (restored or born
sharded), the step compiled once (`_compile`), the loop (`_loop`); at exit, the attempt's goodput
account (jaxtron/train/goodput.py). Around it: a profiler trace of run.profile_steps, and JAX's
persistent compilation cache in run.compile_cache (jaxtron/train/compile_cache.py).
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import jax
from jax.sharding import Mesh

from jaxtron import cli, parallel
from jaxtron import config as config_lib
from jaxtron import data as data_lib
from jaxtron.checkpoint import Checkpoints, RunDirLock
from jaxtron.config import Config, ConfigError
from jaxtron.data import prepared
from jaxtron.data.rows import local_rows
from jaxtron.lifecycle import Preemption
from jaxtron.model import check_remat, head_sizes, moe
from jaxtron.ops import attention as attention_lib
from jaxtron.ops import context_attention
from jaxtron.parallel import pipeline
from jaxtron.plan import autofit, costs, memory
from jaxtron.plan.setup import Setup, set_up
from jaxtron.step import compile_eval, evaluate, global_batch
from jaxtron.train import bad_hosts, compile_cache, distributed, doctor, goodput
from jaxtron.train import metrics as metrics_lib
from jaxtron.train import profile as profile_lib
from jaxtron.train import run_dir as run_dir_lib
from jaxtron.train.local_tier import LocalTier
from jaxtron.train.run_dir import check_paths
from jaxtron.train.start import initial_state
from jaxtron.train.stragglers import Stragglers, Verdict
from jaxtron.train.watchdog import Watchdog


def train(cfg: Config, devices: list | None = None, started: float | None = None, *,
          paths_checked: bool = False, hosts: doctor.Hosts | None = None) -> list[dict]:
    """Train per `cfg`, resuming from the latest checkpoint in run.dir; returns the logged rows.
    `started` (a time.time()) opens this attempt's goodput account: by default when its Python
    started (goodput.process_start), or when the run's previous attempt ended if later (an
    earlier call in this process). `paths_checked`: the caller ran check_paths (`jaxtron train`,
    before the processes join). `hosts`: where the processes run, as the caller's preflight found
    them (default: found here, a collective with several processes)."""
    run_dir = Path(cfg.run.dir)
    if not paths_checked:
        check_paths(cfg)  # a refused start writes nothing
    if started is None:
        started = max(goodput.process_start(), goodput.previous_end(run_dir))
    compile_cache.use(cfg.run.compile_cache)  # before anything compiles
    memory.limit_heaps()  # before the input, the state and the checkpoint threads allocate
    devices = jax.devices() if devices is None else devices
    setup, mesh = _set_up(cfg, devices)  # every check, before anything is allocated or compiled
    hosts = doctor.Hosts.here() if hosts is None else hosts
    cfg = setup.cfg
    feed = _Input.of(cfg, mesh)  # checked against the model before run.dir is written

    # Run directory and writers: every check above passed. The refusals left (no checkpoint
    # reads back) come with the state: what this start added to run.dir is removed again then.
    is_main = jax.process_index() == 0
    fresh = not run_dir.exists()  # made by this start: removed again if it fails before a step
    lock = RunDirLock(run_dir) if is_main else None  # a second run stops here, writing nothing
    held = set(os.listdir(run_dir)) if is_main else set()  # what run.dir held before this start
    log = metrics_lib.MetricsWriter(run_dir, cfg.train.steps, cfg.run.progress,
                                    cfg.run.tensorboard, is_main)
    _say_start(log, setup, devices, hosts.per_host, feed)
    run = RunContext.begin(cfg, mesh, devices, log, feed, started)
    outcome = "done"
    try:
        with jax.set_mesh(mesh), run.preemption:
            # State: restored from the latest checkpoint, else born sharded; the step compiled.
            if cfg.checkpoint.local_dir:  # a collective: every process's directory is checked
                run = dataclasses.replace(run, local=LocalTier(cfg.checkpoint, run_dir,
                                                               hosts.nodes, log.info))
                log.info(run.local.describe())
            if is_main:
                bad_hosts.write_hosts(run_dir, list(hosts.nodes))
            run.watchdog.tick("restoring or creating the state")  # Orbax's barriers
            state, start, tokens_seen = initial_state(cfg, setup.plan, setup.tx, mesh,
                                                      ckpt=run.ckpt, batches=feed.batches,
                                                      info=log.info, local=run.local)
            run.watchdog.pause()  # compiling: this process's own work, as long as it takes
            if start >= cfg.train.steps:
                log.info(f"nothing to do: step {start} >= train.steps={cfg.train.steps}")
                return []
            if is_main:  # the state is in place: this config is the run's from here on
                (run_dir / "config.yaml").write_text(config_lib.to_yaml(cfg))
            step_fn, eval_fn = _compile(setup, run, state, devices[0].platform)
            run = dataclasses.replace(run, stragglers=Stragglers.of(cfg.run, hosts.nodes, start))
            run_dir_lib.check_kept(run_dir)
            history = _loop(cfg, run, step_fn, eval_fn, state, start, tokens_seen)
    except BaseException as e:
        distributed.end_if_lost(e)  # another process is gone: one line, exit 75, no clean-up
        outcome = _outcome(e, run.account)
        raise
    finally:
        try:
            _finish(run, run_dir, outcome)
        except OSError as e:  # a full disk: the error that ended the loop is the one to report
            if outcome == "done":
                raise
            print(f"warning: goodput.json was not updated ({e.strerror})", flush=True)
        finally:
            run.watchdog.close()
            log.close()
            if lock:
                lock.release()
            if fresh and is_main and outcome != "done" and not run.account.last_step:
                shutil.rmtree(run_dir, ignore_errors=True)  # a refused start leaves no run.dir
            elif outcome == REFUSED and is_main:
                run_dir_lib.remove_added(run_dir, held)
    log.info(run_dir_lib.next_commands(cfg.run.dir))  # after the goodput account: the last words
    return history


REFUSED = "refused"  # a start stopped by bad input (a ConfigError) before its loop: no attempt


def _outcome(e: BaseException, account: goodput.Attempt) -> str:
    """How the attempt ended, for goodput.json (a refused start is not recorded)."""
    if isinstance(e, StragglerStop):
        return "straggler"
    if isinstance(e, Preempted):
        return "preempted"
    if isinstance(e, KeyboardInterrupt):
        return "stopped before training"
    if isinstance(e, ConfigError) and account.loop_start is None:
        return REFUSED
    return f"failed: {type(e).__name__}"


def _set_up(cfg: Config, devices: list) -> tuple[Setup, Mesh]:
    """The run's set-up (plan/setup.py) and mesh on `devices`, after every check that needs no
    allocation: the host's memory, run.dir's free space, the remat policy on this device, and the
    attention kernel against the reference (run.attention_check)."""
    setup = set_up(cfg, len(devices), devices[0].platform, autofit.usable_here(devices))
    cfg = setup.cfg
    memory.check_host(setup.plan, devices, cfg)  # before anything is allocated
    if no_room := doctor.check_disk(cfg.run.dir, setup.plan.checkpoint_bytes()):
        raise ConfigError(no_room[0])  # every save would fail: the first one ends the run
    check_remat(cfg.model, devices[0])
    mesh = parallel.make_mesh(cfg.mesh, devices)
    if _kernel_checked(cfg):
        sizes = head_sizes(cfg.model)  # a ConfigError below: one line, exit 2
        attention_lib.self_check(cfg.model.attention, sizes=sizes,
                                 window=cfg.model.sliding_window)
        if cfg.model.attention == "cudnn" and cfg.mesh.context > 1:  # its split form too
            attention_lib.self_check("cudnn", kernel=context_attention.simulated(2),
                                     form=" (split over mesh.context)", sizes=sizes)
    return setup, mesh


def _kernel_checked(cfg: Config) -> bool:
    return cfg.model.attention != "xla" and cfg.model.attention_check


@dataclass(frozen=True)
class _Input:
    """The run's batches, checked against the model (sources, mixture, tokenizer), and what a
    start says of them."""

    batches: data_lib.BatchIterator
    eval_batches: list[dict]
    rows: int  # rows of each global batch this process builds
    corpus: str  # one line naming the data
    warnings: list[str]

    @classmethod
    def of(cls, cfg: Config, mesh: Mesh) -> _Input:
        # Each process builds only the rows of the global batches its devices hold (of the
        # same packing plan on every process); global_batch gives each device its shard.
        rows = local_rows(mesh, cfg.train.batch_size, cfg.train.seq_len)
        batches, evals = data_lib.make_input(cfg.data, cfg.train, cfg.model.vocab_size, rows)
        unused_vocab = prepared.unused_vocab(cfg.data, cfg.model)
        corpus = data_lib.corpus_summary(cfg.data, cfg.model.vocab_size)
        eval_short = data_lib.eval_warning(evals, cfg.train)
        unread = prepared.unread(cfg.data, cfg.train)  # the dry run's warnings, the run's too
        warnings = [w for w in (unused_vocab, eval_short, unread) if w]
        return cls(batches, evals, len(rows), corpus, warnings)


def _say_start(log: metrics_lib.MetricsWriter, setup: Setup, devices: list, per_host: int,
               feed: _Input) -> None:
    """What a start logs before the state: the run, its warnings, flags, mesh over the hosts,
    size, the `auto` choice, the kernel check, the pipeline and the input."""
    cfg, plan = setup.cfg, setup.plan
    log.info(f"run: {Path(cfg.run.dir)} (its resolved config in config.yaml)")
    for warning in [*config_lib.check_warnings(cfg), *feed.warnings]:
        log.info(f"warning: {warning}")
    log.info(f"xla flags: {' '.join(os.environ.get('XLA_FLAGS', '').split()) or 'none'}")
    shape = parallel.describe(plan.mesh_sizes)
    log.info(f"mesh: {shape} over {cli.plural(len(devices), devices[0].device_kind + ' device')}")
    need = autofit.layout_need(cfg, len(devices), setup.usable)
    for line in parallel.describe_hosts(plan.mesh_sizes, per_host, need):
        if not line.startswith("warning"):  # the preflight checks (jaxtron/train/doctor.py) warn
            log.info(line)
    log.info(f"parameters: {moe.describe_params(cfg.model, plan.num_params)}")
    if setup.chosen:
        log.info(setup.chosen)
    if _kernel_checked(cfg):
        log.info(f"attention: {cfg.model.attention} agrees with the xla reference on a packed "
                 "batch (forward and gradient)")
    if plan.pipe:
        log.info(pipeline.describe(plan.pipe, cfg.pipeline.schedule, plan.accumulation))
    log.info(feed.corpus)
    log.info(f"input: {feed.rows} of {cfg.train.batch_size} rows per step", every_process=True)


def _compile(setup: Setup, run: RunContext, state: dict,
             platform: str) -> tuple[Callable, Callable]:
    """The train step compiled once for `state` (in a thread a signal can interrupt: Ctrl-C
    stops here without saving), and the eval step."""
    run.preemption.before_training()
    run.log.info("compiling the train step (Ctrl-C stops here without saving)")
    with run.watch.time("compile"), compile_cache.events() as events:
        lowered = setup.lower(run.mesh, state)
        step_fn = _compiled(lowered.compile, setup.options(platform), run.preemption)
    cache = ""  # whether run.compile_cache had it, if it is on
    if events:
        cache = " (and stored in " if "misses" in events else " (loaded from "
        cache += "run.compile_cache)"
    run.log.info(f"compiled the train step in {run.watch.totals['compile']:.1f} s{cache}")
    run.watchdog.tick("running the first step (all processes compile it first)")
    return step_fn, compile_eval(setup.plan, run.mesh, setup.cfg.train.loss_chunk)


def _evaluate(run: RunContext, eval_fn: Callable, step: int, state: dict) -> bool:
    """Evaluate and log; True when a signal came meanwhile (one process: the evaluation is left
    unfinished, for the stop to save now rather than after every eval batch)."""
    jax.block_until_ready(state)  # the step's device work is the step's time, not eval's
    if "eval" not in run.watch.totals:  # the first: compiling it is the longest silence
        run.log.info(f"evaluating at step {step} on {len(run.eval_batches)} held-out batches "
                     "(compiling the eval step first)")
    alone = jax.process_count() == 1  # several: jax's sync point picks the step all stop at
    with run.watch.time("eval"):  # not a step's time (StepWindow leaves it out)
        def stopped() -> bool:  # asked before each batch
            run.watchdog.tick(f"evaluating at step {step}")
            return alone and run.preemption.signal is not None

        loss = evaluate(eval_fn, state["params"], run.eval_batches, run.mesh, stopped)
    if loss is None:
        run.log.info(f"evaluation at step {step} left unfinished: a signal came")
    else:
        run.log.write_eval(step, loss)
    return loss is None


def _compiled(compile: Callable, options: dict, preemption: Preemption) -> Callable:
    """compile(options) in a thread, so that a signal during a long compile (minutes for a large
    model) stops the start at once instead of after it; the main thread waits and watches."""
    done: dict = {}

    def work() -> None:
        try:
            done["compiled"] = autofit.compile_with(compile, options)
        except BaseException as e:  # noqa: BLE001 - raised again in the main thread
            done["error"] = e

    thread = threading.Thread(target=work, name="compile", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.1)
        preemption.before_training()
    if "error" in done:
        raise done["error"]
    return done["compiled"]


def _finish(run: RunContext, run_dir: Path, outcome: str) -> None:
    """End the attempt: close an open trace, wait for the last checkpoint write, then account for
    the attempt in run_dir/goodput.json and report all attempts on stdout and TensorBoard."""
    run.account.end_loop()
    run.profile.stop()
    with run.watch.time("checkpoint"):
        try:
            run.ckpt.close()  # the last async save is on disk before we return, also on error
        finally:
            if run.local is not None:
                run.local.close()
    record = run.account.record(outcome)
    if not run.log.is_main or outcome == REFUSED or not run_dir.is_dir():
        return  # a refused start writes nothing; a removed run.dir is not made again
    records = goodput.append(run_dir, record, run.log.info)
    summary = goodput.summarize(records)
    if record["last_step"] != record["resumed_from"]:  # a start that failed ends on its error
        run.log.info(goodput.format_summary(summary))
        for line in goodput.format_failures(records):
            run.log.info(line)
    run.log.scalars("goodput", summary, record["last_step"] or 0)


class NonFiniteError(RuntimeError):
    """Training met a NaN/inf loss or gradient and train.on_nonfinite says to stop."""


class Preempted(RuntimeError):
    """SIGTERM/SIGINT/SIGHUP arrived; a checkpoint of the current step was saved."""


class StragglerStop(Preempted):
    """A host straggled and run.on_straggler=stop: the step was saved, the host listed."""


@dataclass(frozen=True)
class RunContext:
    """What the loop uses besides the state and its compiled steps: where it runs, its input,
    and what it reports to."""

    mesh: Mesh
    ckpt: Checkpoints
    log: metrics_lib.MetricsWriter
    batches: data_lib.BatchIterator
    eval_batches: list[dict]
    cost: costs.StepCost
    watch: metrics_lib.Stopwatch
    preemption: Preemption
    account: goodput.Attempt
    profile: profile_lib.Profile
    watchdog: Watchdog
    local: LocalTier | None = None  # checkpoint.local_dir's tier, made once the run is checked
    stragglers: Stragglers | None = None  # several hosts: their own work per step compared

    @classmethod
    def begin(cls, cfg: Config, mesh: Mesh, devices: list, log: metrics_lib.MetricsWriter,
              feed: _Input, started: float) -> RunContext:
        """The context of an attempt that `started` (goodput's account opens then)."""
        run_dir, watch = Path(cfg.run.dir), metrics_lib.Stopwatch()
        is_main = jax.process_index() == 0
        return cls(mesh, Checkpoints(cfg.checkpoint, run_dir), log, feed.batches,
                   feed.eval_batches, costs.StepCost.of(cfg, devices), watch, Preemption(),
                   goodput.Attempt(watch, started, run_dir if is_main else None, log.info),
                   profile_lib.Profile(cfg.run, run_dir, log, watch),
                   Watchdog(cfg.run.stuck_timeout_s if jax.process_count() > 1 else 0))


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
        raise NonFiniteError(f"{cli.plural(skips, 'non-finite step')} in a row up to step {step}, "
                             "more than train.max_nonfinite_skips="
                             f"{cfg.train.max_nonfinite_skips}; stopped")


def _loop(cfg: Config, run: RunContext, step_fn: Callable, eval_fn: Callable, state: dict,
          start: int, tokens_seen: int) -> list[dict]:
    """Steps start+1 .. train.steps: feed, step, checkpoint, evaluate, log."""
    steps, watch, batches, preemption = cfg.train.steps, run.watch, run.batches, run.preemption
    history, previous, window = [], None, metrics_lib.StepWindow(watch, start)
    run.account.start_loop(start)
    run.log.begin(start)
    run.log.info(_what_follows(cfg, start))
    for step in range(start + 1, steps + 1):
        run.watchdog.tick(f"training step {step}")
        run.profile.before(step, state)
        with watch.time("data"):  # overlaps the previous step, which runs asynchronously
            batch = global_batch(next(batches), run.mesh, cfg.train.batch_size)
        if run.stragglers is not None:
            run.stragglers.add(watch.last)  # this host's wait for its own input
        state, pending = step_fn(state, batch)
        run.ckpt.check()  # a background write that failed stops the run now, not `every` steps on
        if run.local is not None:
            run.local.check()
        run.account.last_step = step
        run.profile.after(step, (state, pending))
        tokens_seen += run.cost.tokens
        if previous is not None:
            _check_finite(cfg, run, *previous)
        previous = (step, pending)
        stop = preemption.requested(step)
        run.log.tick(step)
        if step % cfg.train.log_every == 0 or step == steps:
            fetched = jax.device_get(pending)  # host sync point
            row = costs.make_row(step, fetched, window.close(step), run.cost, tokens_seen)
            history.append(row)
            run.log.write(row)
            run_dir_lib.check_kept(Path(cfg.run.dir))  # removed: stop now, not at the next save
            run.account.persist()  # goodput.json holds this attempt also if it is killed
        straggler = _stragglers(cfg, run, step, pending)
        if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == steps) \
                and not stop:  # a stop saves at once: preemption's grace is seconds
            stop = _evaluate(run, eval_fn, step, state)
        # A straggler to leave out is saved for at once: locally when there is a local tier.
        persistent = run.ckpt.due(step, steps) or stop or bool(straggler and run.local is None)
        if persistent or (run.local is not None and (run.local.due(step) or straggler)):
            _check_finite(cfg, run, step, pending)  # never save a state that met a NaN under "stop"
            meta = {"step": step, "loss": float(pending["loss"]),  # waits for the step to finish
                    "tokens_seen": tokens_seen, "time": time.time(),
                    "config": config_lib.to_yaml(cfg),
                    "layer_order": pipeline.config_order(cfg, run.mesh.shape["stage"]).tolist()}
            run.account.saved(step)  # the step has finished: a resume from here redoes what follows
            tier = "checkpoint" if persistent else "local checkpoint"
            run.watchdog.tick(f"saving {tier} {step}")
            with watch.time("checkpoint"):  # only the save's own blocking part
                if persistent:
                    run.ckpt.save(step, state, batches, meta)
                    memory.release_freed()  # the previous save's host copies, freed by now
                else:  # its thread returns the host copies' pages itself, once written
                    run.local.save(step, state, batches.get_state(), meta)
            if not persistent:
                run.local.blocked_s += watch.last
            if persistent or run.local.saves == 1:  # local ones are frequent: the first said
                run.log.info(f"{tier} {step}: the loop was blocked {watch.last:.2f} s "
                             "(the write goes on in the background)")
        if straggler:
            _leave_out(cfg, run, step, straggler)
        if stop:  # `jaxtron train` says it, in one line
            with watch.time("checkpoint"):
                run.ckpt.wait()  # "checkpoint saved" only once it is
            why = f"signal {preemption.signal}" if preemption.signal else "a preemption notice"
            raise Preempted(f"preempted by {why} at step {step}")
    run.watchdog.tick("writing the last checkpoint")
    with watch.time("checkpoint"):
        run.ckpt.wait()  # the last save is on disk before "done" is said
        if run.local is not None:
            run.local.wait()
    for phase in ("data", "checkpoint", "eval"):
        run.log.scalar(f"time/{phase}_s", watch.totals.get(phase, 0.0), steps)
    final = f"final loss {history[-1]['loss']:.4f}, " if history else ""
    if run.local is not None and run.local.saves:
        local = run.local
        run.log.info(f"local checkpoints: {local.saves} saved in the background in "
                     f"{local.written_s / local.saves:.3f} s each, the peer's copy included; the "
                     f"loop blocked {local.blocked_s:.3f} s in all "
                     f"({local.blocked_s / local.saves:.4f} s each)")
    run.log.info(f"done: step {steps}, {final}waited {watch.totals.get('data', 0.0):.1f} s for "
                 f"data, {watch.totals.get('checkpoint', 0.0):.1f} s blocked on checkpoints")
    return history


def _stragglers(cfg: Config, run: RunContext, step: int, pending: dict) -> Verdict | None:
    """Every run.straggler_every steps: compare the hosts (a collective, after the step is
    done); name a straggler. The verdict when the run is to stop for it (run.on_straggler)."""
    if run.stragglers is None or not run.stragglers.due(step):
        return None
    verdict = run.stragglers.report(step, pending)
    run.log.scalar("straggler/input_excess_s", verdict.excess_s, step)
    run.log.scalar("straggler/probe_ratio", verdict.probe, step)
    if not verdict.named:
        return None
    run.log.info(verdict.line())
    run.account.straggler(verdict.host)
    return verdict if cfg.run.on_straggler == "stop" else None


def _leave_out(cfg: Config, run: RunContext, step: int, verdict: Verdict) -> None:
    """End the run for a straggler, its step saved: it goes into run.dir/bad_hosts for the
    restart to leave out (scripts/slurm/train.sbatch), and the run exits 75."""
    with run.watch.time("checkpoint"):
        run.ckpt.wait()
        if run.local is not None:
            run.local.wait()
    if run.log.is_main:
        bad_hosts.add(Path(cfg.run.dir), verdict.host,
                      f"straggler at step {step} (run.on_straggler=stop)")
    probe = f", device probe {verdict.probe:.2f}x theirs" if verdict.probe else ""
    raise StragglerStop(f"host {verdict.host} straggled at step {step} (input wait "
                        f"{verdict.excess_s:.3f} s of each {verdict.step_s:.3f} s step above the "
                        f"other hosts' median{probe}; run.on_straggler=stop), listed in "
                        f"{cfg.run.dir}/{bad_hosts.BAD}")


def _what_follows(cfg: Config, start: int) -> str:
    """What the loop will say and when, so that the wait for the first logged step (the first
    steps run the compiled program for the first time) is not a silence."""
    t, saves = cfg.train, cfg.checkpoint.every
    every = lambda n: "every step" if n == 1 else f"every {n} steps"
    line = f"training steps {start + 1}..{t.steps}: the loss {every(t.log_every)} (train.log_every)"
    if t.eval_every:
        line += (f", the held-out loss {every(t.eval_every)} (train.eval_every; the first "
                 "evaluation compiles its step)")
    return line + (f", a checkpoint {every(saves)}" if saves else ", a checkpoint at the end")

