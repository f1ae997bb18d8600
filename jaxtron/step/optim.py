"""The optimizer: AdamW with linear warmup + cosine decay, global-norm clipping, a decay mask."""

from __future__ import annotations

import jax
import optax

from jaxtron.config import Config, OptimConfig

# Leaf names that are never weight-decayed: RMSNorm scales, biases (gpt-oss's output, router
# and expert ones too), gpt-oss's attention sinks, and the MoE balancing bias (moe.rebalanced
# moves it; it has no gradient).
NO_DECAY = frozenset({"scale", "bq", "bk", "bv", "bo", "sinks", "b_router", "b_gate_up",
                      "b_down", "router_bias"})


def lr_schedule(cfg: OptimConfig, total_steps: int) -> optax.Schedule:
    """0 -> cfg.lr over warmup_steps, then cosine down to lr * min_lr_ratio at decay_steps."""
    warmup = max(cfg.warmup_steps, 0)
    decay = max(cfg.decay_steps or total_steps, warmup + 1)
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=cfg.lr, warmup_steps=warmup, decay_steps=decay,
        end_value=cfg.lr * cfg.min_lr_ratio,
    )


def schedule_jump(saved: Config, now: Config, step: int) -> str | None:
    """Resuming at `step` under another schedule (a raised train.steps, a new optim.lr): the
    learning rate the checkpoint's schedule gives there and this run's, when they differ by more
    than 10%, in a warning naming the fields and how to keep the checkpoint's decay."""
    before = float(lr_schedule(saved.optim, saved.train.steps)(step))
    after = float(lr_schedule(now.optim, now.train.steps)(step))
    if abs(after - before) <= 0.1 * max(before, after):
        return None
    fields = [("train.steps", saved.train.steps, now.train.steps)] + [
        (f"optim.{key}", getattr(saved.optim, key), getattr(now.optim, key))
        for key in ("lr", "warmup_steps", "decay_steps", "min_lr_ratio")]
    changed = ", ".join(f"{key}={a} -> {b}" for key, a, b in fields if a != b)
    decay = saved.optim.decay_steps or saved.train.steps  # the step the checkpoint's decay ends
    keep = [f"{key}={a}" for key, a, b in fields[1:] if a != b and key != "optim.decay_steps"]
    if now.optim.decay_steps != decay:
        keep.append(f"optim.decay_steps={decay}")
    advice = f"; to keep the checkpoint's schedule, set {' '.join(keep)}" if keep else ""
    return (f"the learning rate at step {step} jumps from {before:.3g} (the checkpoint's schedule) "
            f"to {after:.3g} ({changed}){advice}")


def decay_mask(params: dict) -> dict:
    """True for weights that get weight decay (matrices and embeddings), False for NO_DECAY."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key not in NO_DECAY, params)


def make_optimizer(cfg: OptimConfig, total_steps: int) -> optax.GradientTransformation:
    """The optax chain the train step applies."""
    adamw = optax.adamw(
        lr_schedule(cfg, total_steps), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
        weight_decay=cfg.weight_decay, mask=decay_mask, mu_dtype=cfg.mu_dtype or None,
    )
    if cfg.clip_norm <= 0:
        return adamw
    return optax.chain(optax.clip_by_global_norm(cfg.clip_norm), adamw)


def schedule_count(opt_state) -> jax.Array:
    """The updates the learning-rate schedule has applied (optax's own counter, which a skipped
    non-finite step leaves alone): the schedule's argument for the next update."""
    is_count = lambda x: isinstance(x, optax.ScaleByScheduleState)
    counts = [s.count for s in jax.tree.leaves(opt_state, is_leaf=is_count) if is_count(s)]
    if len(counts) != 1:
        raise ValueError("expected one learning-rate schedule in the optimizer, "
                         f"found {len(counts)}")
    return counts[0]
