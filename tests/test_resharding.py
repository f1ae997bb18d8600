"""Any mesh: a run saved on fsdp=8 resumes on (data=2, fsdp=2, tensor=2), on one device and
under a circular pipeline (its layers stored in another order).

The restore reads the fsdp=8 checkpoint straight into the target mesh's shardings (from RULES):
every array equal bit for bit. The resumed step 3 gives the loss of the fsdp=8 run continued on
fsdp=8, up to fp32 rounding from different reduction orders; rtol 1e-5 on loss and grad norm.
"""

import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import tiny_config
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtron import config, parallel
from jaxtron.checkpoint import Checkpoints
from jaxtron.parallel import pipeline
from jaxtron.step.optim import make_optimizer
from jaxtron.step.state import fresh_state_around, in_layer_order, init_state, make_plan
from jaxtron.train.loop import train

RTOL = 1e-5
SAVED_STEP = 2
# (mesh overrides, how many devices): measured relative step-3 differences vs fsdp=8 (CPU).
TARGETS = {
    "data=2,fsdp=2,tensor=2": ({"data": 2, "fsdp": 2, "tensor": 2}, 8),  # loss 0, grad norm 0
    "one_device": ({"fsdp": 1}, 1),  # loss 5.5e-7 (5 ulp of a sum over 1024 tokens), grad norm 0
    # context parallelism: the weights split over fsdp x context, each sequence over context
    "context=2,fsdp=4": ({"context": 2, "fsdp": 4}, 8),
}


def _cfg(run_dir, mesh: dict, steps: int, *extra: str) -> config.Config:
    return tiny_config(*(f"mesh.{a}={n}" for a, n in mesh.items()), f"train.steps={steps}",
                       "train.seq_len=64", "train.log_every=1", "train.eval_every=0",
                       "optim.warmup_steps=1", "checkpoint.every=2", *extra, run_dir=run_dir)


def _restore(cfg: config.Config, devices: list, step: int) -> tuple[dict, dict]:
    """The checkpoint's state read into `cfg.mesh`'s shardings, and those shardings."""
    plan = make_plan(cfg, make_optimizer(cfg), len(devices))
    shardings = parallel.named(plan.specs, parallel.make_mesh(cfg.mesh, devices))
    ckpt = Checkpoints(cfg.checkpoint, Path(cfg.run.dir))
    try:
        state, _ = ckpt.restore(step, plan.abstract, shardings)
    finally:
        ckpt.close()
    return state, shardings


def _continue(source, run_dir, mesh: dict, devices: list, *extra: str) -> list[dict]:
    """A copy of the saved run, trained on to step 3 on `mesh`."""
    shutil.copytree(source, run_dir)
    return train(_cfg(run_dir, mesh, SAVED_STEP + 1, *extra), devices=devices)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The fsdp=8 run saved at step 2, its state as numpy, and the step-3 row of that run
    continued on fsdp=8."""
    base = tmp_path_factory.mktemp("resharding")
    run_dir = base / "fsdp8"
    train(_cfg(run_dir, {"fsdp": 8}, SAVED_STEP))
    state, _ = _restore(_cfg(run_dir, {"fsdp": 8}, SAVED_STEP + 1), jax.devices(), SAVED_STEP)
    rows = _continue(run_dir, base / "fsdp8_continued", {"fsdp": 8}, jax.devices())
    assert [r["step"] for r in rows] == [SAVED_STEP + 1]
    return run_dir, jax.tree.map(np.asarray, state), rows[0]


@pytest.mark.parametrize("target", TARGETS)
def test_resume_on_another_mesh(saved, tmp_path, target):
    run_dir, saved_state, saved_row = saved
    mesh, num_devices = TARGETS[target]
    devices = jax.devices()[:num_devices]

    # (a) Every array restored into the target's RULES shardings, values unchanged.
    state, shardings = _restore(_cfg(run_dir, mesh, SAVED_STEP + 1), devices, SAVED_STEP)
    paths = jax.tree_util.tree_flatten_with_path(state)[0]
    assert len(paths) == len(jax.tree.leaves(saved_state)) == len(jax.tree.leaves(shardings))
    for (path, restored), expected, sharding in zip(
            paths, jax.tree.leaves(saved_state), jax.tree.leaves(shardings)):
        assert isinstance(sharding, NamedSharding) and restored.sharding == sharding, path
        np.testing.assert_array_equal(np.asarray(restored), expected, err_msg=str(path))
    embed = state["params"]["embed"]  # W_emb[V_(tensor,stage), D_(fsdp,context,expert)]
    assert embed.sharding.spec == P(("tensor", "stage"), ("fsdp", "context", "expert"))
    assert embed.addressable_shards[0].data.shape == (
        8192 // mesh.get("tensor", 1), 256 // (mesh["fsdp"] * mesh.get("context", 1)))

    # (b) Training on from there: step 3 as on fsdp=8.
    rows = _continue(run_dir, tmp_path / "run", mesh, devices)
    assert [r["step"] for r in rows] == [SAVED_STEP + 1]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(rows[0][key], saved_row[key], rtol=RTOL, err_msg=key)


def test_resume_under_a_circular_pipeline(saved, tmp_path, capsys):
    """Layers saved in model order are permuted into the circular schedule's stage order
    (stage 0 holds layers 0 and 2, stage 1 layers 1 and 3) and train on as before."""
    run_dir, _, saved_row = saved
    rows = _continue(run_dir, tmp_path / "run", {"stage": 2, "fsdp": 4}, jax.devices(),
                     "pipeline.schedule=circular", "pipeline.repeats=2", "train.microbatches=2")
    assert [r["step"] for r in rows] == [SAVED_STEP + 1]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose(rows[0][key], saved_row[key], rtol=RTOL, err_msg=key)
    log = capsys.readouterr().out
    assert "layers reordered from the checkpoint's pipeline layout" in log
    assert "bubble 0.2000 = (S-1)/(R*M+S-1) = 1/5" in log  # 2 stages, 2 repeats, 2 microbatches


def test_restores_reuse_the_restored_buffers(tmp_path):
    """The layer permutation after a restore under another pipeline layout, and the fresh state of
    a weights-only restore, donate what they are given: the state is never held twice."""
    cfg = _cfg(tmp_path, {"stage": 2, "fsdp": 4}, 3, "pipeline.schedule=circular",
               "pipeline.repeats=2", "train.microbatches=2")
    tx = make_optimizer(cfg)
    plan = make_plan(cfg, tx, 8)
    mesh = parallel.make_mesh(cfg.mesh, jax.devices())
    shardings = parallel.named(plan.specs, mesh)
    model_order = np.arange(cfg.model.num_layers)
    copy = lambda tree: jax.tree.map(np.array, tree)  # a copy: a view of a CPU buffer pins it
    with jax.set_mesh(mesh):
        # A state as a restore reads it, in model order: every array its own buffer (init_state's
        # equal constants may share one, and JAX does not donate a buffer passed twice).
        before = copy(init_state(cfg, plan, tx, mesh))
        restored = jax.tree.map(jax.device_put, before, shardings)
        ordered = in_layer_order(restored, {"layer_order": model_order.tolist()}, plan, tx,
                                 shardings, print)
        _assert_consumed(restored)
        expected = pipeline.reorder(before["params"]["layers"], model_order, plan.layer_order)
        for got, want in zip(jax.tree.leaves(ordered["params"]["layers"]),
                             jax.tree.leaves(expected)):
            np.testing.assert_array_equal(np.asarray(got), want)

        params = ordered["params"]
        kept = copy(params)
        fresh = fresh_state_around(params, tx, shardings)
        _assert_consumed(params)
        for got, want in zip(jax.tree.leaves(fresh["params"]), jax.tree.leaves(kept)):
            np.testing.assert_array_equal(np.asarray(got), want)
        assert int(fresh["step"]) == 0


def _assert_consumed(tree) -> None:
    alive = [jax.tree_util.keystr(path) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
             if not x.is_deleted()]
    assert not alive, f"not donated: {alive}"
