"""The optimizer: AdamW, or Muon for the hidden matrices (muon.py), at the learning-rate schedule
(schedules.py), after global-norm clipping; weight decay where decay_mask says."""

from __future__ import annotations

import jax
import optax

from jaxtron.config import Config
from jaxtron.step import muon
from jaxtron.step.schedules import lr_schedule, schedule_jump  # noqa: F401  (the step's names)

# Leaf names that are never weight-decayed: RMSNorm scales, biases (gpt-oss's output, router
# and expert ones too), gpt-oss's attention sinks, and the MoE balancing bias (moe.rebalanced
# moves it; it has no gradient).
NO_DECAY = frozenset({"scale", "bq", "bk", "bv", "bo", "sinks", "b_router", "b_gate_up",
                      "b_down", "router_bias"})


def decay_mask(params: dict) -> dict:
    """True for weights that get weight decay (matrices and embeddings), False for NO_DECAY."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[-1].key not in NO_DECAY, params)


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    """The optax chain the train step applies (optim.name: adamw, or muon with AdamW for what
    is not a hidden matrix), at the run's learning-rate schedule."""
    o = cfg.optim
    schedule = lr_schedule(o, cfg.train.steps)
    if o.name == "muon":
        tx = muon.muon(o, cfg.model, schedule, decay_mask, NO_DECAY)
    else:
        tx = optax.adamw(schedule, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                         mask=decay_mask, mu_dtype=o.mu_dtype or None)
    if o.clip_norm <= 0:
        return tx
    return optax.chain(optax.clip_by_global_norm(o.clip_norm), tx)


def describe(cfg: Config) -> str:
    """The optimizer and its schedule in a line, for the dry run."""
    o = cfg.optim
    name = ("muon (Newton-Schulz on the hidden matrices, "
            f"{o.muon_layout}; AdamW on the rest)" if o.name == "muon" else "adamw")
    return f"optimizer: {name}, {o.schedule} schedule peaking at lr={o.lr:g}"


def schedule_count(opt_state) -> jax.Array:
    """The updates the learning-rate schedule has applied (optax's own counter, which a skipped
    non-finite step leaves alone): the schedule's argument for the next update."""
    is_count = lambda x: isinstance(x, optax.ScaleByScheduleState)
    counts = [s.count for s in jax.tree.leaves(opt_state, is_leaf=is_count) if is_count(s)]
    if len(counts) != 1:
        raise ValueError("expected one learning-rate schedule in the optimizer, "
                         f"found {len(counts)}")
    return counts[0]
