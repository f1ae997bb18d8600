"""Orbax checkpoints of the whole run: train state, data-iterator position and metadata.

Saves are asynchronous (the loop goes on while arrays are written) and atomic (Orbax writes to a
temporary directory and renames it when complete). A restore reads into abstract targets that
carry the current mesh's shardings, so no second, unsharded copy of the state is ever made.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any, Callable

import grain
import jax
import orbax.checkpoint as ocp

from jaxtron import lifecycle
from jaxtron.checkpoint import damage, weights
from jaxtron.checkpoint.lock import IN_USE, LOCK_FILE, RunDirLock  # noqa: F401 - where callers find them
from jaxtron.config import CheckpointConfig, ConfigError, DataConfig, ModelConfig

# What a run says of a checkpoint's data against its own (the checkpoint's DataConfig, and the
# checkpoint.restore path or ""): a ConfigError message, or None when they agree.
DataChange = Callable[[DataConfig, str], "str | None"]

DAMAGED_DIR = "damaged_checkpoints"  # run.dir/<this>/<step>-<time>: kept for inspection


class CheckpointSaveError(RuntimeError):
    """A checkpoint that was due was not written."""


class Checkpoints:
    """The run's `checkpoints/` directory: save every `every` steps, keep the latest `keep`."""

    def __init__(self, cfg: CheckpointConfig, run_dir: Path):
        self.every = cfg.every
        self.damaged_dir = (run_dir / DAMAGED_DIR).absolute()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, keep_period=cfg.keep_every or None, create=True,
            enable_async_checkpointing=True, cleanup_tmp_directories=True,  # a failed save's
            # The step directory is made in save() itself: a failure to make it is raised there at
            # once, where Orbax's default would have the writes wait 300 s for a signal of it.
            async_options=ocp.AsyncOptions(create_directories_asynchronously=False),
        )
        _quiet_abandoned_reads()  # a failed write's leftovers are as noisy as a failed read's
        for quiet in (_orbax_errors, _read_only_notes):  # before the manager reads each step's
            logging.getLogger("absl").addFilter(quiet)  # metadata: restore_latest names damage
        self.manager = ocp.CheckpointManager(
            (run_dir / "checkpoints").absolute(), options=options,
            item_names=("state", "data", "meta"),
        )
        self.pending: int | None = None  # the step whose background write is not yet confirmed

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def steps(self) -> list[int]:
        """Complete checkpoints, newest first (Orbax never lists unfinished temporary ones)."""
        return sorted(self.manager.all_steps(), reverse=True)

    def due(self, step: int, last_step: int) -> bool:
        """Save at every `every`-th step and always at the last one."""
        return step == last_step or (self.every > 0 and step % self.every == 0)

    def save(self, step: int, state: dict, batches: grain.DatasetIterator, meta: dict) -> None:
        """Start an async save; `batches` must be positioned at the next batch to train on.
        Raises CheckpointSaveError when Orbax declines to write it (it returns False, for
        instance for a step at or below one already in the directory), when it cannot be
        started, or when the previous save's background write failed (naming that one)."""
        self.wait()  # Orbax would wait for it anyway; a failure is the previous step's
        directory = Path(self.manager.directory)
        if not directory.parent.is_dir():  # removed while the run went on: not made again
            raise CheckpointSaveError(f"checkpoint {step} was not saved: run.dir "
                                      f"{directory.parent} was removed")
        if not directory.is_dir():
            raise self._failed(step, NotADirectoryError(20, "Not a directory"))
        latest = self.manager.latest_step()
        if latest is not None and latest >= step:
            raise CheckpointSaveError(
                f"checkpoint {step} was not saved: {self.manager.directory} already holds step "
                f"{latest}; move that checkpoint aside or set run.dir to a new directory")
        try:
            saved = self.manager.save(step, force=True, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                data=grain.checkpoint.CheckpointSave(batches),
                meta=ocp.args.JsonSave(meta),
            ))
        except Exception as e:  # noqa: BLE001 - one line naming the cause, not Orbax's dump
            raise self._failed(step, e) from None
        if not saved:
            raise CheckpointSaveError(f"checkpoint {step} was not saved: Orbax declined to "
                                      f"write it to {self.manager.directory}")
        self.pending = step

    def check(self) -> None:
        """Raise CheckpointSaveError now if the pending save's background write has already
        failed (cheap: it waits for nothing), so that a run does not train on for `every` steps
        past a checkpoint that will never exist."""
        if self.pending is not None and not self.manager.is_saving_in_progress():
            self.wait()

    def wait(self) -> None:
        """Wait for the pending save to be complete on disk; CheckpointSaveError if it failed."""
        step, self.pending = self.pending, None
        if step is None:
            return
        try:
            self.manager.wait_until_finished()
        except Exception as e:  # noqa: BLE001 - the background write failed
            raise self._failed(step, e) from None

    def _failed(self, step: int, error: BaseException) -> CheckpointSaveError:
        """The one-line error for a save that did not happen. Writes still in flight may end
        while the interpreter shuts down: that is silenced once the line is out."""
        lifecycle.silence_at_exit()
        return CheckpointSaveError(f"checkpoint {step} was not saved: "
                                   f"{save_error(error, Path(self.manager.directory))}")

    def restore(self, step: int, abstract_state: Any, shardings: Any) -> tuple[dict, dict]:
        """Read `step`'s state straight into `shardings`, and its metadata."""
        return _restore(self.manager, step, _target(abstract_state, shardings))

    def restore_latest(self, abstract_state: Any, shardings: Any,
                       resume_input: Callable[[Path], object],
                       warn: Callable[[str], None]) -> tuple[int, dict, dict] | None:
        """The newest checkpoint that reads back whole; `resume_input` is handed its data item's
        directory (the input moves to where it was: data.resume_input).
        Newer damaged checkpoints are skipped with a warning naming them, and moved aside to
        run.dir/damaged_checkpoints/ so that this run can save those steps again. None when there
        are no checkpoints; an error when there are some but none is readable (then nothing is
        moved). That they hold this model was checked by check_start, before run.dir was touched."""
        steps, damaged = self.steps(), []
        _quiet_abandoned_reads()  # before reading: they may land as a failed restore unwinds
        for step in steps:
            step_dir = Path(self.manager.directory) / str(step)
            why = damage.meta_damage(step_dir)  # a missing or garbled file, named as such
            if why is None:  # damaged array data shows in the read, in TensorStore's words
                try:
                    state, meta = self.restore(step, abstract_state, shardings)
                    resume_input(step_dir / "data")
                    self._move_aside(damaged, warn)
                    return step, state, meta
                except Exception as e:  # noqa: BLE001 - any read failure means "not this one"
                    lifecycle.silence_at_exit()  # reads in flight finish into the void
                    why = read_error(e)
            if jax.process_count() > 1:  # the others may have read it: none may go on alone
                raise ConfigError(
                    f"checkpoint {step_dir} is unreadable on process {jax.process_index()} "
                    f"({why}); move it aside and rerun to resume from an older one")
            warn(f"warning: checkpoint {step_dir} is unreadable ({why}); trying an older one")
            damaged.append(step)
        if steps:
            raise ConfigError(none_readable(Path(self.manager.directory), len(steps)))
        return None

    def _move_aside(self, steps: list[int], warn: Callable[[str], None]) -> None:
        """Move damaged step directories out of the manager's way (it refuses to save a step at
        or below the newest one it sees) into damaged_checkpoints/, and rescan."""
        if not steps:
            return
        self.damaged_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("%Y%m%d-%H%M%S")
        for step in steps:
            target = self.damaged_dir / f"{step}-{stamp}"
            shutil.move(Path(self.manager.directory) / str(step), target)
            warn(f"warning: moved damaged checkpoint {step} to {target}")
        self.manager.reload()

    def close(self) -> None:
        """Wait for the last async save to be complete on disk (CheckpointSaveError if not)."""
        try:
            self.wait()
        finally:
            with contextlib.suppress(Exception):  # a failure above is what the user needs
                self.manager.close()


def none_readable(where: Path, count: int, causes: str = "") -> str:
    """The error when none of the `count` checkpoints in `where` reads back."""
    which = (f"the one checkpoint in {where} is unreadable" if count == 1 else
             f"none of the {count} checkpoints in {where} is readable")
    return (f"{which}{causes}; move {'it' if count == 1 else 'them'} aside to start over, or set "
            "run.dir to a new directory")


_SAVE_CAUSES = ("No space left on device", "Disk quota exceeded", "Permission denied",
                "Read-only file system", "Not a directory")  # said as "<cause> (<checkpoints dir>)"


def save_error(e: BaseException, directory: Path) -> str:
    """Why a checkpoint write failed, in a few words: a known OS cause and the directory (the
    innermost cause holds the OS's words after a long spec), else read_error's first line."""
    inner = e
    while inner.__cause__ is not None:
        inner = inner.__cause__
    known = [cause for cause in _SAVE_CAUSES if cause.lower() in str(inner).lower()]
    return f"{known[0].lower()} ({directory})" if known else read_error(e)


def _orbax_errors(record: logging.LogRecord) -> bool:
    """Orbax's ERROR logs of a failed background save (each with a traceback, several per
    failure): not shown; the failure reaches the loop as one CheckpointSaveError line. Nor its
    notes on a damaged step's commit metadata, read as it lists the steps: restore_latest names
    the damage in its own warning."""
    return not ((record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname)
                or record.getMessage().startswith("Metadata file does not exist"))


def read_error(e: BaseException) -> str:
    """Why a checkpoint read failed, in a few words: the innermost cause's first line (Orbax wraps
    TensorStore's 'OUT_OF_RANGE: Error reading ...' in a message holding a whole spec)."""
    while e.__cause__ is not None:
        e = e.__cause__
    text = (str(e).strip().splitlines() or [type(e).__name__])[0]
    text = text.split(". See full TensorStore details")[0]
    return text if len(text) <= 240 else text[:237] + "..."


def _late(error: BaseException | None) -> bool:
    """An abandoned read completing into the event loop its failed restore closed."""
    return isinstance(error, RuntimeError) and str(error) == "Event loop is closed"


def _abandoned(error: BaseException | None) -> bool:
    """An abandoned read's or write's leftovers: its error, never retrieved, or late completion."""
    return any(words in str(error) for words in ("error while reading", "Error writing")) \
        or _late(error)


def _quiet_abandoned_reads() -> None:
    """A failed Orbax restore leaves its other array reads' exceptions unretrieved; asyncio would
    log each one (a TensorStore spec, dozens of lines) when it is collected, burying the one line
    that says what happened; reads still in flight then complete into a closed event loop. The
    failure is reported by the caller, so these are dropped."""
    if getattr(sys.unraisablehook, "quiet_reads", False):
        return
    logging.getLogger("asyncio").addFilter(
        lambda record: "exception was never retrieved" not in record.getMessage())
    unraisable, excepthook = sys.unraisablehook, sys.excepthook

    def quiet_unraisable(info):
        if not _abandoned(info.exc_value):
            unraisable(info)

    def quiet_excepthook(kind, error, traceback):
        if not _late(error):  # a read error that reaches the top is shown
            excepthook(kind, error, traceback)

    quiet_unraisable.quiet_reads = True
    sys.unraisablehook, sys.excepthook = quiet_unraisable, quiet_excepthook


def restore_dir(path: str, model: ModelConfig | None,
                data_change: DataChange | None = None) -> Path:
    """The checkpoint checkpoint.restore names, once it holds this model's arrays and its data
    agrees with this run's (neither checked when `model` is None)."""
    try:
        _, directory = weights.locate(path)
    except ConfigError:
        raise ConfigError(weights.restore_error(path)) from None
    if model is None:
        return directory
    changed = weights.model_changes(weights.read_meta(directory), model)
    if changed:
        raise ConfigError(f"checkpoint.restore={path} holds another model ({', '.join(changed)})"
                          "; set those to the checkpoint's values")
    meta = weights.read_meta(directory)
    if data_change and "config" in meta and (
            change := data_change(weights.config_of(meta).data, path)):
        raise ConfigError(change)
    return directory


def _target(abstract_state: Any, shardings: Any) -> Any:
    return jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings
    )


def _restore(manager: ocp.CheckpointManager, step: int, target: Any) -> tuple[dict, dict]:
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(target), meta=ocp.args.JsonRestore(),
    ))
    return restored["state"], restored["meta"]


def restore_from(path: str, abstract_state: Any, shardings: Any,
                 resume_input: Callable[[Path], object] | None, weights_only: bool,
                 model: ModelConfig) -> tuple[dict, dict]:
    """Start from another run's checkpoint: `path` is a checkpoint (`.../checkpoints/<step>`),
    or a run, import or checkpoints directory (its newest complete checkpoint). With
    `weights_only`, take its params alone (fine-tuning: fresh optimizer state, step 0, data from
    the start); an imported model (jaxtron convert-hf import) holds nothing else."""
    directory = restore_dir(path, model)
    _quiet_abandoned_reads()
    try:
        return _restore_from(directory, abstract_state, shardings, resume_input, weights_only,
                             path)
    except ConfigError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged checkpoint: one line, not Orbax's spec dump
        lifecycle.silence_at_exit()
        raise ConfigError(f"checkpoint.restore={path}: {directory} is unreadable ({read_error(e)})"
                          "; restore from another checkpoint") from None


def _read_only_notes(record: logging.LogRecord) -> bool:
    """Orbax's notes that a read-only manager is, or that it removes a failed save's tmp dir."""
    return not record.getMessage().startswith((
        "CheckpointManagerOptions.read_only=True", "Given directory is read only",
        "Attempted to create temporary directory"))


def _restore_from(directory: Path, abstract_state: Any, shardings: Any,
                  resume_input: Callable[[Path], object] | None, weights_only: bool,
                  path: str) -> tuple[dict, dict]:
    if weights.read_meta(directory).get("layout") == weights.LAYERED:
        if not weights_only:  # train.check_paths says it first
            raise ConfigError(weights.imported_only(path))
        params = weights.restore_layers(directory, abstract_state["params"], shardings["params"])
        return {"params": params}, weights.read_meta(directory)
    logging.getLogger("absl").addFilter(_read_only_notes)
    manager = ocp.CheckpointManager(directory.parent, item_names=("state", "data", "meta"),
                                    options=ocp.CheckpointManagerOptions(read_only=True))
    try:
        if not weights_only:
            state, meta = _restore(manager, int(directory.name), _target(abstract_state, shardings))
            resume_input(directory / "data")
            return state, meta
        target = {"params": _target(abstract_state["params"], shardings["params"])}
        restored = manager.restore(int(directory.name), args=ocp.args.Composite(
            state=ocp.args.PyTreeRestore(
                target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
                partial_restore=True),
            meta=ocp.args.JsonRestore(),
        ))
        return restored["state"], restored["meta"]
    finally:
        manager.close()
