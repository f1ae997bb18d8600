"""Where a run starts: the newer of the local tier's newest complete step (local_tier.py) and
run.dir's newest sound checkpoint, else checkpoint.restore's, else fresh weights. Checked before
anything is written (check_start), said by the dry run (describe_start) and done at start-up
(initial_state); the reading of arrays is jaxtron.checkpoint's."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Callable

from jax.sharding import Mesh

from jaxtron import data, parallel
from jaxtron.checkpoint import (
    Checkpoints,
    DataChange,
    damage,
    none_readable,
    restore_dir,
    restore_from,
    weights,
)
from jaxtron.config import Config, ConfigError, ModelConfig
from jaxtron.step.optim import schedule_jump
from jaxtron.step.state import Plan, fresh_state_around, in_layer_order, init_state
from jaxtron.train.local_tier import LocalTier


def check_start(run_dir: Path, model: ModelConfig, restore: str,
                data_change: DataChange | None = None, optimizer: str = "") -> None:
    """Before anything is written: run.dir's newest checkpoint whose metadata reads, or else
    checkpoint.restore, holds this model's arrays (one line naming the fields that differ), its
    data agrees with this run's (`data_change`, e.g. data.prepared.tokenizer_check: what is
    wrong, or None) and so does its optimizer (`optimizer`: optim.name, "" unchecked), and
    checkpoint.restore names a checkpoint. A refused command leaves run.dir as it was."""
    # Damaged ones are passed over here, and set aside by Checkpoints.restore_latest.
    steps = damage.survey(run_dir / "checkpoints", damage.meta_damage)[0]
    if steps:
        meta = weights.read_meta(steps[-1])
        if meta.get("layout") == weights.LAYERED:  # jaxtron convert-hf import's output
            raise ConfigError(f"run.dir={run_dir} holds an import (weights only); set run.dir to a "
                              f"new directory with checkpoint.restore={run_dir} "
                              "checkpoint.weights_only=true")
        if changed := weights.model_changes(meta, model, resume=True):
            raise ConfigError(_another_model(run_dir, changed))
        if optimizer:
            check_optimizer(meta, optimizer, f"run.dir={run_dir}", run_dir)
        if data_change and "config" in meta and (
                change := data_change(weights.config_of(meta).data, "")):
            raise ConfigError(change)
    if restore:  # a run.dir that has checkpoints resumes from them, but a wrong path is a mistake
        restore_dir(restore, None if steps else model, data_change)


def check_optimizer(meta: dict, optimizer: str, holder: str, restore: Path | str) -> None:
    """The checkpoint (`meta`, in `holder`) holds state of the optimizer `optimizer` (optim.name),
    or one line names the two ways on: its optimizer, or its weights alone (`restore`)."""
    try:
        saved = weights.config_of(meta).optim.name
    except (ConfigError, KeyError):  # an older or foreign meta: its optimizer was AdamW's
        saved = "adamw"
    if saved != optimizer:
        raise ConfigError(f"{holder} holds {saved} optimizer state, not optim.name={optimizer}'s; "
                          f"set optim.name={saved} to resume it, or start a new run.dir with "
                          f"checkpoint.restore={restore} checkpoint.weights_only=true to train "
                          f"its weights with {optimizer}")


def _another_model(run_dir: Path, changed: list[str]) -> str:
    """The refusal of a resume whose model is not its checkpoints' (`changed`: as model_changes
    says them): each field with the checkpoints' value and this start's, and the two ways on."""
    back = " ".join(change.split(" -> ")[0] for change in changed)
    return (f"{run_dir} holds checkpoints of another model ({', '.join(changed)}); start a new "
            f"run.dir, or drop the override{'s' if len(changed) > 1 else ''} to resume with the "
            f"checkpoints' {back}")


def describe_start(run_dir: Path, restore: str, weights_only: bool, steps: int) -> str:
    """Where a run would start, for the dry run (check_start has checked the model): the newest
    sound checkpoint in run.dir, naming the newer damaged ones a run sets aside (as far as their
    files tell: no array is read), else checkpoint.restore's, else nothing."""
    found = weights.run_checkpoints(run_dir)
    newest = int(found[-1].name) if found else -1
    damaged = {int(d.name): damage.damage(d) for d in
               damage.step_dirs(run_dir / "checkpoints") if int(d.name) > newest}
    if damaged and not found:  # as restore_latest stops, naming each cause
        causes = "; ".join(f"checkpoint {n}: {why}" for n, why in sorted(damaged.items()))
        raise ConfigError(none_readable(run_dir / "checkpoints", len(damaged), f" ({causes})"))
    if found:
        step = int(weights.read_meta(found[-1]).get("step", found[-1].name))
        left = ("nothing left to train: raise train.steps to go on" if step >= steps else
                f"{steps - step:,} steps to go")
        aside = "".join(f"; checkpoint {n} is damaged ({why}) and will be set aside"
                        for n, why in sorted(damaged.items(), reverse=True))
        return (f"start: resumes from {found[-1]} (step {step:,} of {steps:,}: {left}){aside}; its "
                "arrays are read at start-up" + ("" if damaged else ", and an unreadable newest "
                                                 "checkpoint is set aside for an older one"))
    if restore:
        directory = restore_dir(restore, None)
        what = "its weights only (step 0, fresh optimizer)" if weights_only else "its whole state"
        return f"start: from {directory}, {what}"
    return "start: from scratch (run.dir holds no checkpoint)"


RESTORE_UNUSED = ("checkpoint.restore={} is not used: run.dir has checkpoints of its own, which "
                  "come first (restore starts a new run.dir)")


def resumed_schedule_jump(meta: dict, cfg: Config) -> str | None:
    """optim.schedule_jump between the checkpoint's config (in its meta) and this run's."""
    try:
        saved = weights.config_of(meta)
    except (ConfigError, KeyError):  # an older or foreign meta: nothing to compare
        return None
    return schedule_jump(saved, cfg, int(meta["step"]))


def initial_state(cfg: Config, plan: Plan, tx, mesh: Mesh, *, ckpt: Checkpoints, batches,
                  info: Callable[[str], None],
                  local: LocalTier | None = None) -> tuple[dict, int, int]:
    """(state, step, tokens seen): the newest of the local tier's steps (`local`) and run.dir's
    readable checkpoints, else checkpoint.restore, else fresh weights."""
    shardings = parallel.named(plan.specs, mesh)
    if local is not None and (found := local.restore(plan.abstract, shardings,
                                                     ckpt.latest_step(), info)):
        step, state, position, meta = found
        data.resume_state(batches, position, info)
        state = in_layer_order(state, meta, plan, tx, shardings, info)
        if jump := resumed_schedule_jump(meta, cfg):
            info(f"warning: {jump}")
        return state, step, meta["tokens_seen"]
    resume_input = functools.partial(data.resume_input, batches, warn=info)
    restored = ckpt.restore_latest(plan.abstract, shardings, resume_input, info)
    if restored is not None:
        step, state, meta = restored
        state = in_layer_order(state, meta, plan, tx, shardings, info)
        info(f"resumed from {ckpt.manager.directory} step {step} "
                     f"(loss {meta['loss']:.4f}, {meta['tokens_seen']:,} tokens seen)")
        if jump := resumed_schedule_jump(meta, cfg):
            info(f"warning: {jump}")
        if cfg.checkpoint.restore:
            info(f"note: {RESTORE_UNUSED.format(cfg.checkpoint.restore)}")
        return state, step, meta["tokens_seen"]
    if not cfg.checkpoint.restore:
        return init_state(cfg, plan, tx, mesh), 0, 0
    resume_input = functools.partial(data.resume_input, batches, warn=print)
    state, meta = restore_from(cfg.checkpoint.restore, plan.abstract, shardings, resume_input,
                               cfg.checkpoint.weights_only, cfg.model)
    if cfg.checkpoint.weights_only:
        params = in_layer_order(state, meta, plan, tx, shardings, info)["params"]
        state = fresh_state_around(params, tx, shardings, plan.abstract.get("fp8"))
        info(f"weights from {cfg.checkpoint.restore}; optimizer and data start fresh")
        return state, 0, 0
    state = in_layer_order(state, meta, plan, tx, shardings, info)
    info(f"started from {cfg.checkpoint.restore} (step {meta['step']})")
    if jump := resumed_schedule_jump(meta, cfg):
        info(f"warning: {jump}")
    return state, int(meta["step"]), meta["tokens_seen"]
