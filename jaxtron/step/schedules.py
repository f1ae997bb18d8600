"""The learning-rate schedules (optim.schedule): cosine, wsd (warm-up, stable, decay: a run that
can be extended while its rate is flat, and cooled down from any checkpoint) and constant; and
what a run that resumes under another schedule is told.

Each starts with a linear warm-up from 0 to optim.lr over optim.warmup_steps. cosine then decays
to lr * min_lr_ratio at the decay's end (optim.decay_steps, else train.steps); wsd holds lr and
decays over the last optim.cooldown_steps before that end (optim.cooldown_shape: linear, cosine,
or sqrt, 1 - sqrt of the progress, Hägele et al. 2024); constant holds lr to the end."""

from __future__ import annotations

import jax.numpy as jnp
import optax

from jaxtron.config import Config, OptimConfig

# The fields a schedule reads (beside train.steps), in the order a warning names them; only wsd
# reads the cool-down's.
FIELDS = ("lr", "schedule", "warmup_steps", "decay_steps", "min_lr_ratio")
COOLDOWN_FIELDS = ("cooldown_steps", "cooldown_shape")


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """The learning rate at each step count (an int32 array inside jit) for optim.schedule."""
    warmup = max(cfg.warmup_steps, 0)
    if cfg.schedule == "constant":  # optax's warm-up of 0 steps stays at 0 (optax 0.2.8)
        return (optax.warmup_constant_schedule(init_value=0.0, peak_value=cfg.lr,
                                               warmup_steps=warmup) if warmup else
                optax.constant_schedule(cfg.lr))
    if cfg.schedule == "wsd":
        return _wsd(cfg, total_steps)
    # cosine: the numbers every run and checkpoint before the other schedules had
    decay = max(cfg.decay_steps or total_steps, warmup + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup, decay_steps=decay,
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def wsd_bounds(cfg: OptimConfig, total_steps: int) -> tuple[int, int, int]:
    """(warm-up end, cool-down start, decay end) of wsd: the cool-down is the last cooldown_steps
    (0: a fifth) before the end, at least one step, and never starts inside the warm-up."""
    warmup = max(cfg.warmup_steps, 0)
    end = max(cfg.decay_steps or total_steps, warmup + 1)
    cooldown = max(cfg.cooldown_steps or end // 5, 1)
    return warmup, max(end - cooldown, warmup), end


def _wsd(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """0 -> lr over the warm-up, lr until the cool-down, then down to lr * min_lr_ratio at the
    decay's end and there after it."""
    warmup, start, end = wsd_bounds(cfg, total_steps)
    floor, steps = cfg.lr * cfg.min_lr_ratio, end - start
    if cfg.cooldown_shape == "cosine":
        cooldown = optax.cosine_decay_schedule(cfg.lr, steps, alpha=cfg.min_lr_ratio)
    elif cfg.cooldown_shape == "sqrt":
        cooldown = _sqrt_cooldown(cfg.lr, floor, steps)
    else:
        cooldown = optax.linear_schedule(cfg.lr, floor, steps)
    return optax.join_schedules(
        [optax.linear_schedule(0.0, cfg.lr, warmup), optax.constant_schedule(cfg.lr), cooldown],
        [warmup, start])


def _sqrt_cooldown(peak: float, floor: float, steps: int) -> optax.Schedule:
    """peak -> floor over `steps` as 1 - sqrt(progress), then floor (optax has no such shape)."""
    def schedule(count):
        progress = jnp.clip(count / steps, 0.0, 1.0)
        return floor + (peak - floor) * (1.0 - jnp.sqrt(progress))
    return schedule


def schedule_jump(saved: Config, now: Config, step: int) -> str | None:
    """Resuming at `step` under another schedule (a raised train.steps, a new optim.lr): the
    learning rate the checkpoint's schedule gives there and this run's, when they differ by more
    than 10%, in a warning naming the fields and how to keep the checkpoint's schedule."""
    before = float(lr_schedule(saved.optim, saved.train.steps)(step))
    after = float(lr_schedule(now.optim, now.train.steps)(step))
    if abs(after - before) <= 0.1 * max(before, after):
        return None
    keys = FIELDS + (COOLDOWN_FIELDS if "wsd" in (saved.optim.schedule, now.optim.schedule)
                     else ())
    fields = [("train.steps", saved.train.steps, now.train.steps)] + [
        (f"optim.{key}", getattr(saved.optim, key), getattr(now.optim, key)) for key in keys]
    changed = ", ".join(f"{key}={a} -> {b}" for key, a, b in fields if a != b)
    decay = saved.optim.decay_steps or saved.train.steps  # the step the checkpoint's decay ends
    keep = [f"{key}={a}" for key, a, b in fields[1:] if a != b and key != "optim.decay_steps"]
    if saved.optim.schedule != "constant" and (now.optim.decay_steps or now.train.steps) != decay:
        keep.append(f"optim.decay_steps={decay}")
    advice = f"; to keep the checkpoint's schedule, set {' '.join(keep)}" if keep else ""
    return (f"the learning rate at step {step} jumps from {before:.3g} (the checkpoint's schedule) "
            f"to {after:.3g} ({changed}){advice}{_cooldown_note(saved, now, step, after > before)}")


def _cooldown_note(saved: Config, now: Config, step: int, up: bool) -> str:
    """Where a wsd cool-down explains the jump: the checkpoint already inside its own (`up`: a
    longer run cannot undo it), or this run's starting before a stable-phase checkpoint."""
    if saved.optim.schedule != "wsd":
        return ""
    _, start, end = wsd_bounds(saved.optim, saved.train.steps)
    if up and step > start:
        return (f"; the checkpoint is past the start of its cool-down (steps {start}-{end}): to "
                f"extend the stable phase, restore a checkpoint from before step {start} into a "
                "new run.dir (checkpoint.restore=.../checkpoints/<step>)")
    _, now_start, now_end = wsd_bounds(now.optim, now.train.steps)
    if not up and now.optim.schedule == "wsd" and now_start < step < now_end and step <= start:
        return (f"; this run's cool-down starts at step {now_start}, before the checkpoint's: to "
                f"cool down from here, set optim.cooldown_steps={now_end - step}")
    return ""
