"""Pipeline parallelism: every stage layout gives the one-device losses and gradients.

A small 8-layer model, 3 AdamW steps on a fixed random batch, then the gradient at the third
step's parameters. Layers stored in stage order (circular) are put back in model order before
comparing. Asserted: losses within 2e-6 relative; each gradient array within 1e-5 of the
reference's norm at the start and 2.5e-4 after 3 steps (Adam's first steps amplify fp32
rounding differences of near-zero gradients into the parameters). Measured over all 16 cases:
losses <= 4.5e-7, gradients <= 6.3e-7 at the start and <= 4.8e-5 after 3 steps (tensor=2 the
largest); on an AMD EPYC host, whose CPU kernels sum in another order, the embedding's 1.1e-4
after 3 steps (stage=2, data=2, fsdp=2).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    PIPE_MODEL,
    PIPE_STEPS,
    PIPE_TRAIN,
    assert_close_grads,
    pipeline_batch,
    pipeline_cfg,
    pipeline_reference,
    pipeline_run,
)

from jaxtron import config
from jaxtron.ops import attention
from jaxtron.parallel import pipeline

MODEL, TRAIN, STEPS = PIPE_MODEL, PIPE_TRAIN, PIPE_STEPS
_cfg, _batch, _run, _reference = pipeline_cfg, pipeline_batch, pipeline_run, pipeline_reference
_assert_close_grads = assert_close_grads


def _check(cfg: config.Config, devices: int, remat: str) -> None:
    losses, first, last = _run(cfg, devices)
    ref_losses, ref_first, ref_last = _reference(remat)
    assert losses[-1] < losses[0] - 0.1  # it is training, not just agreeing
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    _assert_close_grads(first, ref_first, 1e-5)
    _assert_close_grads(last, ref_last, 2.5e-4)


LAYOUTS = [  # (mesh overrides, devices)
    (("mesh.stage=2", "mesh.fsdp=1"), 2),
    (("mesh.stage=4", "mesh.fsdp=1"), 4),
    (("mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2"), 8),
    (("mesh.stage=2", "mesh.data=2", "mesh.fsdp=2"), 8),
    (("mesh.stage=2", "mesh.data=2", "mesh.fsdp=2", "pipeline.grad_sum=whole"), 8),
]
SCHEDULES = {"gpipe": (), "circular": ("pipeline.schedule=circular", "pipeline.repeats=2")}


SCHEDULES = {"gpipe": (), "circular": ("pipeline.schedule=circular", "pipeline.repeats=2")}
# The default suite runs each layout with both schedules, gpipe without and circular with remat;
# `-m slow` runs the other half of the matrix.
CASES = [pytest.param(layout, schedule, remat, id=f"{','.join(layout[0])}-{schedule}-{remat}"
                      .replace("mesh.", ""),
                      marks=[pytest.mark.slow] if (schedule == "gpipe") == (remat == "full") else [])
         for layout in LAYOUTS for schedule in SCHEDULES for remat in ("none", "full")]


@pytest.mark.parametrize("layout,schedule,remat", CASES)
def test_pipeline_matches_one_device(layout, schedule, remat):
    mesh, devices = layout
    _check(_cfg(*mesh, *SCHEDULES[schedule], f"model.remat={remat}"), devices, remat)


def test_pipeline_passes_accumulate_like_one_pass():
    """pipeline.passes=2 (gradient accumulation around the pipeline) sums the same gradients."""
    _check(_cfg("mesh.stage=2", "mesh.fsdp=1", "pipeline.passes=2"), 2, "none")


@pytest.mark.parametrize("stages,repeats,micro,bubble", [
    (2, 1, 4, 1 / 5), (4, 1, 4, 3 / 7), (4, 2, 4, 3 / 11), (8, 1, 16, 7 / 23), (8, 4, 16, 7 / 71),
])
def test_bubble_fraction_follows_the_schedule(stages, repeats, micro, bubble):
    pipe = pipeline.Pipeline(stages, repeats, micro)
    assert pipe.iterations == micro * repeats + stages - 1
    assert pipe.bubble == pytest.approx(bubble, rel=1e-12)


def test_the_log_line_names_repeats_and_passes_only_when_there_are_several():
    assert pipeline.describe(pipeline.Pipeline(2, 1, 4), "gpipe", 1) == (
        "pipeline: gpipe, 2 stages, 4 microbatches per pass x 1 pass: bubble 0.2000 = "
        "(S-1)/(R*M+S-1) = 1/5")
    assert pipeline.describe(pipeline.Pipeline(4, 2, 4), "circular", 2) == (
        "pipeline: circular, 4 stages x 2 repeats, 4 microbatches per pass x 2 passes: bubble "
        "0.2727 = (S-1)/(R*M+S-1) = 3/11")


def test_circular_storage_order_puts_each_stage_groups_side_by_side():
    # 8 layers, 2 stages x 2 repeats: stage 0 holds groups 0 and 2, stage 1 groups 1 and 3.
    assert pipeline.layer_order(8, 2, 2).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]
    assert pipeline.layer_order(8, 4, 1).tolist() == list(range(8))
    order = pipeline.layer_order(12, 2, 3)
    stored = np.arange(12)[order]
    assert pipeline.reorder(stored, order, np.arange(12)).tolist() == list(range(12))


@pytest.mark.parametrize("overrides,message", [
    (("model.num_layers=6", "mesh.stage=4"), "model.num_layers=6 is not divisible by mesh.stage=4"),
    (("mesh.stage=2", "pipeline.schedule=circular", "pipeline.repeats=3"),
     "not divisible by mesh.stage=2 x pipeline.repeats=3"),
    (("mesh.stage=4", "pipeline.schedule=circular", "pipeline.repeats=2", "train.microbatches=2"),
     "needs at least mesh.stage=4 microbatches per pass"),
    (("mesh.stage=2", "pipeline.repeats=2"), "pipeline.repeats=2 needs pipeline.schedule=circular"),
    (("mesh.stage=2", "pipeline.schedule=dualpipe"), "pipeline.schedule=dualpipe is not one of"),
    (("mesh.stage=2", "pipeline.passes=3"), "not divisible by pipeline.passes=3"),
])
def test_invalid_pipeline_layouts_fail_before_compiling(capsys, overrides, message):
    import launch

    code = launch.main(["--dry-run", "--devices", "8", *MODEL, *TRAIN, "mesh.fsdp=-1",
                        *overrides])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err


@pytest.mark.parametrize("overrides,expected", [
    (("mesh.stage=4", "train.microbatches=8"), 3 / 11),
    (("mesh.stage=4", "train.microbatches=8", "pipeline.schedule=circular", "pipeline.repeats=2"),
     3 / 19),
    (("mesh.stage=2", "train.microbatches=8", "pipeline.passes=2", "train.batch_size=32"), 1 / 5),
])
def test_the_log_reports_the_schedule_bubble(capsys, overrides, expected):
    import re

    import launch

    # model.vocab_size=512: the dry run trains the default corpus's tokenizer, which needs 354+
    assert launch.main(["--dry-run", "--devices", "8", *MODEL, "model.vocab_size=512", *TRAIN[:2],
                        "mesh.fsdp=-1", *overrides]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("pipeline: ")]
    assert len(lines) == 1
    assert float(re.search(r"bubble ([0-9.]+)", lines[0]).group(1)) == pytest.approx(
        expected, abs=5e-5)


def test_70b_pipeline_preset_plans_on_128_devices(capsys):
    import launch

    assert launch.main(["--config", "configs/llama3_70b_pp8.yaml", "--dry-run",
                        "--devices", "128"]) == 0
    out = capsys.readouterr().out
    assert "mesh: data=2, stage=8, fsdp=1, tensor=8 (128 devices)" in out
    assert "parameter bytes per device: 4,410,212,352 bytes" in out  # docs/parallelism.md
    assert "bubble 0.0266 = (S-1)/(R*M+S-1) = 7/263" in out


def _with(x, placeholder):
    """x + the sum of a zero-element array: x, with the placeholder used (as the cuDNN calls use
    jax's, so that it is not pruned)."""
    return x + jnp.sum(placeholder).astype(x.dtype)


@jax.custom_vjp
def _attend(q, k, v, segment_ids, placeholder):
    return _with(attention.xla_attention(q, k, v, segment_ids), placeholder)


def _attend_fwd(q, k, v, segment_ids, placeholder):
    out, pullback = jax.vjp(lambda q, k, v: attention.xla_attention(q, k, v, segment_ids), q, k, v)
    return _with(out, placeholder), (pullback, placeholder)


def _attend_bwd(residuals, g):
    pullback, placeholder = residuals
    dq, dk, dv = pullback(g)
    return _with(dq, placeholder), dk, dv, None, jnp.zeros_like(placeholder)


_attend.defvjp(_attend_fwd, _attend_bwd)


@pytest.mark.parametrize("remat", [pytest.param("none", marks=pytest.mark.slow), "full"])
def test_cudnn_path_in_the_stages_matches_one_device(monkeypatch, remat):
    """The stages' cuDNN path (attention.cudnn_attention: a shard_map over fsdp and tensor around
    the sealed kernel) with a CPU kernel in cuDNN's place: XLA attention behind a custom_vjp that,
    like jax's cuDNN entry, takes a zero-element placeholder and keeps it as a residual. Losses
    and gradients are the one-device run's (XLA attention, no pipeline)."""
    calls = []

    def kernel(q, k, v, segment_ids):
        calls.append(q.shape)
        return _attend(q, k, v, segment_ids, jnp.zeros(0, q.dtype))

    monkeypatch.setattr(attention, "_cudnn_local", kernel)
    resolve = attention.resolve  # model.attention=cudnn in float32, which the kernel here allows
    monkeypatch.setattr(attention, "resolve",
                        lambda impl, *args: impl if impl == "cudnn" else resolve(impl, *args))
    cfg = _cfg("mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", f"model.remat={remat}")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention="cudnn"))
    _check(cfg, 8, remat)
    # each device's own rows and heads: 16 rows / 4 microbatches / fsdp 2, 4 heads / tensor 2
    assert calls and set(calls) == {(2, 32, 2, 16)}
