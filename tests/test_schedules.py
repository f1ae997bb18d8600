"""The learning-rate schedules (step/schedules.py): each curve's numbers under jit, the cosine
one unchanged, what a resume under another schedule is told, and the schedule warnings."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from helpers import tiny_config

from jaxtron import config
from jaxtron.step.schedules import lr_schedule, schedule_jump

LR, FLOOR = 3e-3, 3e-4  # configs/tiny.yaml's optim.lr, and it times optim.min_lr_ratio=0.1
# 1 - progress through the cool-down, as each shape turns it into a share of LR - FLOOR
SHAPES = {"linear": lambda p: 1 - p, "cosine": lambda p: 0.5 * (1 + math.cos(math.pi * p)),
          "sqrt": lambda p: 1 - math.sqrt(p)}


def rates(*overrides: str, steps: list[int]) -> np.ndarray:
    """The tiny preset's schedule under `overrides`, at `steps`, jitted on an int32 array (as the
    train step calls it with optax's count)."""
    cfg = tiny_config(*overrides)
    return np.asarray(jax.jit(lr_schedule(cfg.optim, cfg.train.steps))(
        jnp.asarray(steps, jnp.int32)))


def test_cosine_is_optax_warmup_cosine_decay_as_before():
    """The default: existing checkpoints and runs keep their numbers, bit for bit."""
    steps = list(range(0, 260, 7))
    for extra, decay in (((), 200), (("optim.decay_steps=120",), 120)):
        expected = optax.warmup_cosine_decay_schedule(0.0, LR, 20, decay, end_value=FLOOR)
        assert np.array_equal(rates(*extra, steps=steps),
                              np.asarray(jax.jit(expected)(jnp.asarray(steps, jnp.int32))))
    # halfway from the warm-up's end (20) to train.steps (200): halfway from LR to FLOOR
    np.testing.assert_allclose(rates(steps=[10, 20, 110, 200, 250]),
                               [LR / 2, LR, 1.65e-3, FLOOR, FLOOR], rtol=1e-6)


@pytest.mark.parametrize("shape", SHAPES)
def test_wsd_warms_up_holds_then_cools_down_over_the_last_fifth(shape):
    """train.steps=100: warm-up to step 10, LR to 80 (cooldown_steps=0: a fifth of 100), then
    the shape down to FLOOR at 100, and FLOOR after."""
    steps = [0, 5, 10, 50, 79, 80, 85, 90, 95, 100, 101, 150]
    got = rates("optim.schedule=wsd", "train.steps=100", "optim.warmup_steps=10",
                f"optim.cooldown_shape={shape}", steps=steps)
    cooling = [FLOOR + (LR - FLOOR) * SHAPES[shape]((s - 80) / 20) for s in (85, 90, 95)]
    np.testing.assert_allclose(got, [0, LR / 2, LR, LR, LR, LR, *cooling, FLOOR, FLOOR, FLOOR],
                               rtol=1e-6, atol=1e-9)


def test_wsd_cooldown_numbers():
    """Halfway through a linear cool-down, and a quarter through a sqrt one (1 - sqrt(1/4)),
    are both halfway from LR to FLOOR: 1.65e-3."""
    common = ("optim.schedule=wsd", "train.steps=100", "optim.warmup_steps=10")
    assert rates(*common, steps=[90])[0] == pytest.approx(1.65e-3, rel=1e-6)
    assert rates(*common, "optim.cooldown_shape=sqrt", steps=[85])[0] == pytest.approx(
        1.65e-3, rel=1e-6)


def test_wsd_cooldown_ends_at_decay_steps_and_starts_no_earlier_than_the_warm_up_end():
    """decay_steps=60 cooldown_steps=30: LR to 30, FLOOR from 60 on, though the run goes to 100.
    A cool-down longer than what follows the warm-up starts as the warm-up ends."""
    ended = rates("optim.schedule=wsd", "train.steps=100", "optim.warmup_steps=10",
                  "optim.decay_steps=60", "optim.cooldown_steps=30", steps=[30, 45, 60, 100])
    np.testing.assert_allclose(ended, [LR, (LR + FLOOR) / 2, FLOOR, FLOOR], rtol=1e-6)
    long = rates("optim.schedule=wsd", "train.steps=100", "optim.warmup_steps=10",
                 "optim.cooldown_steps=500", steps=[5, 10, 55, 100])
    np.testing.assert_allclose(long, [LR / 2, LR, (LR + FLOOR) / 2, FLOOR], rtol=1e-6)


def test_constant_warms_up_then_holds_forever():
    got = rates("optim.schedule=constant", "train.steps=100", "optim.warmup_steps=10",
                steps=[0, 5, 10, 100, 10**6])
    np.testing.assert_allclose(got, [0, LR / 2, LR, LR, LR], rtol=1e-6)


@pytest.mark.parametrize("schedule, first", [("constant", [LR] * 3),
                                             ("wsd", [LR] * 3),
                                             ("cosine", [FLOOR + (LR - FLOOR) * SHAPES["cosine"](
                                                 i / 200) for i in range(3)])])
def test_no_warm_up_starts_at_the_peak(schedule, first):
    """optim.warmup_steps=0: step 0 is at lr (optax's warmup_constant_schedule with 0 warm-up
    steps stays at 0 for ever: the constant schedule does without it)."""
    got = rates(f"optim.schedule={schedule}", "optim.warmup_steps=0", "train.steps=200",
                steps=[0, 1, 2])
    np.testing.assert_allclose(got, first, rtol=1e-4)


WSD = ("optim.schedule=wsd", "optim.warmup_steps=100")


def test_resuming_a_wsd_run_in_its_stable_phase_says_nothing():
    """The two ways on from a stable-phase checkpoint (step 5000 of 10000, cool-down from 8000):
    a longer run, and a cool-down from the checkpoint (train.steps=S+C, cooldown_steps=C)."""
    saved = tiny_config(*WSD, "train.steps=10000")
    assert schedule_jump(saved, tiny_config(*WSD, "train.steps=20000"), 5000) is None
    cool = tiny_config(*WSD, "train.steps=5500", "optim.cooldown_steps=500")
    assert schedule_jump(saved, cool, 5000) is None
    assert rates(*WSD, "train.steps=5500", "optim.cooldown_steps=500",
                 steps=[5250])[0] == pytest.approx((LR + FLOOR) / 2, rel=1e-6)


def test_extending_a_wsd_run_inside_its_cooldown_warns():
    """Step 9000 is halfway through the cool-down of 8000-10000: a longer run puts the rate back
    at its peak, which the warning says, with the two ways to avoid it."""
    saved = tiny_config(*WSD, "train.steps=10000")
    assert schedule_jump(saved, tiny_config(*WSD, "train.steps=20000"), 9000) == (
        "the learning rate at step 9000 jumps from 0.00165 (the checkpoint's schedule) to 0.003 "
        "(train.steps=10000 -> 20000); to keep the checkpoint's schedule, set "
        "optim.decay_steps=10000; the checkpoint is past the start of its cool-down (steps "
        "8000-10000): to extend the stable phase, restore a checkpoint from before step 8000 "
        "into a new run.dir (checkpoint.restore=.../checkpoints/<step>)")
    kept = tiny_config(*WSD, "train.steps=20000", "optim.decay_steps=10000")
    assert schedule_jump(saved, kept, 9000) is None


def test_a_cooldown_that_would_start_before_the_checkpoint_says_how_to_start_it_there():
    """train.steps=S+C without cooldown_steps=C: a fifth of 6000 starts the cool-down at 4800,
    before the stable-phase checkpoint at 5000, and the rate drops at once (a sixth of the way
    down: 2.55e-3)."""
    saved = tiny_config(*WSD, "train.steps=10000")
    warning = schedule_jump(saved, tiny_config(*WSD, "train.steps=6000"), 5000)
    assert warning.startswith("the learning rate at step 5000 jumps from 0.003 (the checkpoint's "
                              "schedule) to 0.00255 (train.steps=10000 -> 6000)")
    assert warning.endswith("; this run's cool-down starts at step 4800, before the checkpoint's: "
                            "to cool down from here, set optim.cooldown_steps=1000")


def test_changing_the_schedule_on_resume_names_it():
    saved = tiny_config(*WSD, "train.steps=10000")
    now = tiny_config("optim.warmup_steps=100", "train.steps=10000")  # cosine
    assert schedule_jump(saved, now, 5000) == (
        "the learning rate at step 5000 jumps from 0.003 (the checkpoint's schedule) to 0.00167 "
        "(optim.schedule=wsd -> cosine); to keep the checkpoint's schedule, set "
        "optim.schedule=wsd")


@pytest.mark.parametrize("overrides,warning", [
    (["optim.cooldown_steps=50"], "optim.cooldown_steps=50 does nothing with "
     "optim.schedule=cosine (only wsd has a cool-down); drop it, or set optim.schedule=wsd"),
    (["optim.schedule=constant", "optim.decay_steps=150", "optim.cooldown_shape=sqrt"],
     "optim.decay_steps=150, optim.cooldown_shape=sqrt do nothing with optim.schedule=constant "
     "(it never decays); drop them, or set optim.schedule=wsd"),
    (["optim.schedule=wsd", "optim.cooldown_steps=190"],
     "optim.cooldown_steps=190 is more than the 180 steps from the warm-up's end "
     "(optim.warmup_steps=20) to the decay's end (train.steps=200): the cool-down starts as the "
     "warm-up ends, with no stable phase; lower optim.cooldown_steps"),
    (["optim.muon_layout=gathered"], "optim.muon_layout=gathered does nothing with "
     "optim.name=adamw; drop it, or set optim.name=muon"),
])
def test_schedule_settings_that_are_probably_not_meant_are_warnings(overrides, warning):
    assert config.check_warnings(tiny_config(*overrides)) == [warning]
    for fine in (["optim.schedule=wsd", "optim.cooldown_steps=180", "optim.cooldown_shape=sqrt"],
                 ["optim.schedule=constant"]):
        assert config.check_warnings(tiny_config(*fine)) == []
