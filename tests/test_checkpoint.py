"""Checkpoints: a resumed run continues bit-for-bit where the uninterrupted one went."""

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import grain
import numpy as np
import pytest
from helpers import tiny_config

from jaxtron import data as data_lib
from jaxtron.checkpoint import Checkpoints, CheckpointSaveError
from jaxtron.step.optim import lr_schedule
from jaxtron.train.loop import train

ROOT = Path(__file__).resolve().parent.parent


def _cfg(run_dir, *extra):
    return tiny_config("train.steps=6", "train.log_every=1", "train.seq_len=64",
                       "checkpoint.every=2", "checkpoint.keep=2", "optim.warmup_steps=2", *extra,
                       run_dir=run_dir)


def test_resume_from_latest_checkpoint_is_exact(tmp_path):
    run_dir = tmp_path / "run"
    straight = train(_cfg(run_dir))
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [4, 6]  # every 2 steps, the latest 2 kept

    # Lose the last checkpoint: the rerun restores step 4 (params, optimizer, data position).
    shutil.rmtree(run_dir / "checkpoints" / "6")
    resumed = train(_cfg(run_dir))
    assert [row["step"] for row in resumed] == [5, 6]
    np.testing.assert_array_equal([r["loss"] for r in resumed], [r["loss"] for r in straight[4:]])
    np.testing.assert_array_equal([r["grad_norm"] for r in resumed],
                                  [r["grad_norm"] for r in straight[4:]])

    assert [r["tokens"] for r in resumed] == [r["tokens"] for r in straight[4:]] == [
        5 * 16 * 64, 6 * 16 * 64]  # counted on from the checkpoint's, not from 0
    meta = json.loads((run_dir / "checkpoints" / "6" / "meta" / "metadata").read_text())
    assert meta["step"] == 6 and meta["tokens_seen"] == 6 * 16 * 64
    assert meta["loss"] == straight[-1]["loss"]


def test_finished_run_is_not_trained_again(tmp_path):
    run_dir = tmp_path / "run"
    train(_cfg(run_dir, "train.steps=2"))
    assert train(_cfg(run_dir, "train.steps=2")) == []


class _Poisoned(grain.DatasetIterator):
    """Delegates to the real batch iterator; batches number `at` get a marker the loss turns to NaN."""

    def __init__(self, it, at):
        super().__init__()
        self.it, self.at, self.count = it, set(at), 0

    def __next__(self):
        batch = next(self.it)
        self.count += 1
        if self.count in self.at:
            batch = dict(batch, positions=batch["positions"].copy())
            batch["positions"][0, 0] = -1
        return batch

    def get_state(self):
        return self.it.get_state()

    def set_state(self, state):
        self.it.set_state(state)


def _poison(monkeypatch, at, where="loss"):
    """Marked batches make the loss NaN (where="loss"), or leave the loss exactly as it is and make
    the gradient NaN (where="grad")."""
    import jax
    import jax.numpy as jnp

    from jaxtron import data as data_lib
    from jaxtron.step import train_step as step_lib  # loss_and_grads calls it there

    real_loss, real_input = step_lib.loss_sums, data_lib.make_input

    def loss_sums(params, graphdef, batch, pipe=None, chunk=0, histories=None,
                  with_stats=False, **kwargs):
        total, aux = real_loss(params, graphdef, batch, pipe, chunk, histories, with_stats,
                               **kwargs)
        marked = batch["positions"][0, 0] < 0
        if where == "loss":  # the objective and the cross-entropy logged with it
            nan = lambda x: jnp.where(marked, jnp.nan, x)
            return nan(total), (aux[0], nan(aux[1]), aux[2]) if with_stats else aux
        # sqrt at 0 has an infinite slope: times the zero slope of 0*w it is NaN, only when marked.
        # The value added is exactly 0 (x - x), so the loss stays finite and unchanged.
        w = jax.tree.leaves(params)[0]
        root = jnp.sqrt(jnp.sum(w) * 0.0 + jnp.where(marked, 0.0, 1.0))
        return total + (root - jax.lax.stop_gradient(root)), aux

    monkeypatch.setattr(step_lib, "loss_sums", loss_sums)

    def make_input(*args, **kwargs):
        batches, evals = real_input(*args, **kwargs)
        return _Poisoned(batches, at), evals

    monkeypatch.setattr(data_lib, "make_input", make_input)


def _saved_params(run_dir, step):
    import orbax.checkpoint as ocp

    path = run_dir / "checkpoints" / str(step) / "state"
    return ocp.StandardCheckpointer().restore(path.absolute())


@pytest.mark.parametrize("where", ["loss", "grad"])
def test_nonfinite_step_is_skipped(tmp_path, monkeypatch, where):
    """A NaN loss, or a NaN gradient under a finite loss, drops that step's update entirely, and
    the logged learning rate is the one optax applies (its schedule does not count the skip)."""
    _poison(monkeypatch, at={3}, where=where)
    run_dir = tmp_path / "run"
    cfg = _cfg(run_dir, "checkpoint.every=1", "checkpoint.keep=10")
    rows = train(cfg)
    losses, norms = [r["loss"] for r in rows], [r["grad_norm"] for r in rows]
    if where == "loss":
        assert np.isnan(losses[2])
    else:
        assert np.isfinite(losses[2]) and np.isnan(norms[2])
    assert np.all(np.isfinite(losses[3:])) and np.all(np.isfinite(norms[3:]))
    schedule = lr_schedule(cfg.optim, cfg.train.steps)
    applied = [0, 1, 2, 2, 3, 4]  # updates applied before each step: step 3's never was
    np.testing.assert_array_equal([r["lr"] for r in rows],
                                  [np.float32(schedule(n)) for n in applied])
    before, at, after = (_saved_params(run_dir, s) for s in (2, 3, 4))
    for a, b in zip(jax_leaves(before["params"]), jax_leaves(at["params"])):
        np.testing.assert_array_equal(a, b)  # step 3's update was dropped entirely
    for a, b in zip(jax_leaves(before["opt_state"]), jax_leaves(at["opt_state"])):
        np.testing.assert_array_equal(a, b)
    assert int(at["nonfinite"]) == 1 and int(after["nonfinite"]) == 0
    assert any(np.any(a != b) for a, b in zip(jax_leaves(at["params"]), jax_leaves(after["params"])))


def test_nonfinite_step_stops_without_saving(tmp_path, monkeypatch):
    import pytest

    from jaxtron.train.loop import NonFiniteError

    _poison(monkeypatch, at={3})
    run_dir = tmp_path / "run"
    with pytest.raises(NonFiniteError, match="step 3"):
        train(_cfg(run_dir, "checkpoint.every=1", "checkpoint.keep=10", "train.on_nonfinite=stop"))
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved == [1, 2]


def test_too_many_consecutive_skips_stop(tmp_path, monkeypatch):
    import pytest

    from jaxtron.train.loop import NonFiniteError

    _poison(monkeypatch, at={2, 3, 4})
    with pytest.raises(NonFiniteError, match="3 non-finite steps in a row"):
        train(_cfg(tmp_path / "run", "train.max_nonfinite_skips=2"))


def jax_leaves(tree):
    import jax

    return [np.asarray(x) for x in jax.tree.leaves(tree)]


@pytest.mark.slow  # CI's time: the moved-aside test below skips a damaged latest one too
def test_damaged_latest_checkpoint_is_skipped(tmp_path, capsys):
    run_dir = tmp_path / "run"
    straight = train(_cfg(run_dir, "checkpoint.keep=3"))  # checkpoints 2, 4, 6
    shutil.rmtree(run_dir / "checkpoints" / "6")
    files = [p for p in (run_dir / "checkpoints" / "4" / "state").rglob("*") if p.is_file()]
    biggest = max(files, key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])  # truncated
    (run_dir / "checkpoints" / "5.orbax-checkpoint-tmp-1234").mkdir()  # a save killed mid-write
    capsys.readouterr()
    resumed = train(_cfg(run_dir, "checkpoint.keep=3"))
    out = capsys.readouterr().out
    assert "checkpoints/4 is unreadable" in out
    moved = list((run_dir / "damaged_checkpoints").iterdir())  # kept, out of Orbax's way
    assert [p.name.split("-")[0] for p in moved] == ["4"] and (moved[0] / "state").is_dir()
    # inspect_ckpt reads it there ("not a checkpoint" before), naming the damage: exit 1.
    inspected = subprocess.run([sys.executable, str(ROOT / "tools" / "inspect_ckpt.py"),
                                str(moved[0])], capture_output=True, text=True, timeout=300)
    assert inspected.returncode == 1 and "\nstep:        4\n" in inspected.stdout
    assert re.fullmatch(rf"inspect_ckpt.py: error: checkpoint {re.escape(str(moved[0]))} is "
                        r"damaged \(.+\); a resume moved it aside \(the run goes on from its "
                        r"other checkpoints\)\n", inspected.stderr), inspected.stderr
    assert [r["step"] for r in resumed] == [3, 4, 5, 6]  # from step 2, the newest good one
    np.testing.assert_array_equal([r["loss"] for r in resumed], [r["loss"] for r in straight[2:]])

    # Every checkpoint damaged: stop with one line rather than start over on top of them.
    import pytest

    from jaxtron.config import ConfigError

    for step_dir in (run_dir / "checkpoints").iterdir():
        if step_dir.name.isdigit():
            for f in (step_dir / "state").rglob("*"):
                if f.is_file() and f.stat().st_size > 1000:
                    f.write_bytes(f.read_bytes()[:100])
    with pytest.raises(ConfigError, match="none of the 3 checkpoints"):
        train(_cfg(run_dir, "checkpoint.keep=3"))


def test_restore_from_another_runs_checkpoint(tmp_path):
    source = tmp_path / "source"
    straight = train(_cfg(source, "train.steps=4"))  # checkpoints 2 and 4
    # Full restore: a new run dir continues from step 2 exactly as the source did.
    cont = train(_cfg(tmp_path / "cont", "train.steps=4",
                      f"checkpoint.restore={source / 'checkpoints' / '2'}"))
    assert [r["step"] for r in cont] == [3, 4]
    np.testing.assert_array_equal([r["loss"] for r in cont], [r["loss"] for r in straight[2:]])
    # Weights only (fine-tuning): params carried over, optimizer fresh, step 0. With warmup the
    # first step's learning rate is 0, so after one step the params are still the source's.
    tuned = tmp_path / "tuned"
    train(_cfg(tuned, "train.steps=1", "checkpoint.weights_only=true",
               f"checkpoint.restore={source / 'checkpoints' / '2'}"))
    src, new = _saved_params(source, 2), _saved_params(tuned, 1)
    for a, b in zip(jax_leaves(src["params"]), jax_leaves(new["params"])):
        np.testing.assert_array_equal(a, b)
    assert int(new["step"]) == 1 and int(src["step"]) == 2
    # The optimizer restarted: Adam's and the schedule's counters count this run's one step
    # (carried over they would read 3), while the source's read 2.
    assert [int(x) for x in jax_leaves(new["opt_state"]) if x.dtype == np.int32] == [1, 1]
    assert [int(x) for x in jax_leaves(src["opt_state"]) if x.dtype == np.int32] == [2, 2]


@pytest.mark.slow  # CI's time; `pytest -m slow` runs it
def test_damaged_latest_is_moved_aside_and_saved_again(tmp_path, capsys):
    """Damage the newest checkpoint, rerun to the same step, rerun further: the third run resumes
    from the checkpoint the second one saved, and every loss equals a straight run's. (Left in
    place, the damaged step blocks Orbax from saving that step again, and the third run would
    start over from the older checkpoint.)"""
    fixed = ["optim.decay_steps=8", "checkpoint.keep=2"]  # the same schedule at any train.steps
    straight = train(_cfg(tmp_path / "straight", "train.steps=8", *fixed))
    run_dir = tmp_path / "run"
    train(_cfg(run_dir, *fixed))  # checkpoints 4 and 6
    _truncate_biggest(run_dir / "checkpoints" / "6" / "state")
    again = train(_cfg(run_dir, *fixed))
    assert [r["step"] for r in again] == [5, 6]
    further = train(_cfg(run_dir, "train.steps=8", *fixed))
    assert [r["step"] for r in further] == [7, 8]
    out = capsys.readouterr().out
    assert "checkpoints/6 is unreadable" in out and "step 6 (loss" in out
    np.testing.assert_array_equal([r["loss"] for r in again + further],
                                  [r["loss"] for r in straight[4:]])


def _truncate_biggest(directory):
    """Cut the biggest file under `directory` in half, as a crash mid-copy would."""
    files = [p for p in directory.rglob("*") if p.is_file()]
    biggest = max(files, key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[: biggest.stat().st_size // 2])


def test_a_save_that_cannot_happen_is_an_error(tmp_path):
    """Orbax declines (returns False) to save a step at or below the newest it has; that must
    stop the run, never pass as saved."""
    import jax.numpy as jnp

    ckpt = Checkpoints(_cfg(tmp_path).checkpoint, tmp_path)
    batches = iter(grain.MapDataset.range(8).to_iter_dataset())
    state = {"w": jnp.arange(4.0)}
    ckpt.save(4, state, batches, {"step": 4})
    for step in (4, 3):
        with pytest.raises(CheckpointSaveError, match=f"checkpoint {step} was not saved.*step 4"):
            ckpt.save(step, state, batches, {"step": step})
    ckpt.close()
    assert ckpt.steps() == [4]


def test_launch_stops_with_status_4_when_orbax_declines_a_save(tmp_path, monkeypatch, capsys):
    """Orbax's save() returning False (no write) ends the run with one line and status 4."""
    import orbax.checkpoint as ocp

    import launch

    monkeypatch.setattr(ocp.CheckpointManager, "save", lambda *a, **k: False)
    rc = launch.main(["train.steps=2", "train.seq_len=64", "checkpoint.every=1",
                      "train.eval_every=0", "run.tensorboard=false", "run.progress=lines",
                      f"run.dir={tmp_path / 'run'}"])
    err = capsys.readouterr().err.strip()
    assert rc == 4 and len(err.splitlines()) == 1, err
    assert "checkpoint 1 was not saved: Orbax declined to write it" in err


def test_restore_latest_reads_back_what_was_saved_and_names_one_damaged_checkpoint(tmp_path):
    """restore_latest takes no model: check_start compared it before run.dir was touched. With
    its only checkpoint unreadable it stops with one line in the singular."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    from jaxtron.config import ConfigError

    ckpt = Checkpoints(_cfg(tmp_path).checkpoint, tmp_path)
    batches = iter(grain.MapDataset.range(8).to_iter_dataset())
    next(batches)
    ckpt.save(4, {"w": jnp.arange(4.0)}, batches, {"step": 4})
    ckpt.close()
    abstract = {"w": jax.ShapeDtypeStruct((4,), jnp.float32)}
    shardings = {"w": SingleDeviceSharding(jax.devices()[0])}
    ckpt = Checkpoints(_cfg(tmp_path).checkpoint, tmp_path)

    handed = []  # restore_latest hands the input its data item's directory, nothing more
    step, state, meta = ckpt.restore_latest(abstract, shardings, handed.append, print)
    assert (step, meta) == (4, {"step": 4})
    assert [Path(d) for d in handed] == [tmp_path / "checkpoints" / "4" / "data"]
    assert data_lib.saved_iterator_state(handed[0], 0, 1)  # the saved data position
    np.testing.assert_array_equal(state["w"], [0.0, 1.0, 2.0, 3.0])
    for f in (tmp_path / "checkpoints" / "4" / "state").rglob("*"):
        if f.is_file() and f.stat().st_size > 100:
            f.write_bytes(b"")
    with pytest.raises(ConfigError, match=r"^the one checkpoint in .*checkpoints is unreadable; "
                                          r"move it aside to start over"):
        ckpt.restore_latest(abstract, shardings, handed.append, lambda line: None)
    ckpt.close()


def _saved(*overrides: str) -> dict:
    """A checkpoint's meta as far as the start-up checks read it: the config it was saved with."""
    from jaxtron import config as config_lib

    return {"config": config_lib.to_yaml(tiny_config(*overrides))}


def test_what_a_resume_may_change_of_the_model():
    """model_changes: the arrays always, and with resume=True the function of the same arrays;
    the experts' fields only where both configs have experts, their width as a width (0 is
    mlp_dim's); implementation choices and the objective's knobs never."""
    from jaxtron.checkpoint.weights import model_changes

    moe = ("model.moe.num_experts=4", "model.moe.experts_per_token=2")
    saved = _saved(*moe)
    changes = lambda *o, resume=True: model_changes(saved, tiny_config(*moe, *o).model, resume)
    assert changes("model.moe.experts_per_token=1") == ["model.moe.experts_per_token=2 -> 1"]
    assert changes("model.moe.experts_per_token=1", resume=False) == []  # a new run from it may
    assert changes("model.moe.norm_topk_prob=false", "model.rope_theta=1e6") == [
        "model.rope_theta=10000.0 -> 1000000.0", "model.moe.norm_topk_prob=true -> false"]
    assert changes("model.qk_norm=true", resume=False) == ["model.qk_norm=false -> true"]
    assert changes("model.moe.num_experts=8", resume=False) == ["model.moe.num_experts=4 -> 8"]
    assert changes("model.moe.mlp_dim=512", resume=False) == ["model.moe.mlp_dim=0 -> 512"]
    assert changes("model.moe.mlp_dim=768") == []  # tiny's mlp_dim: the same experts
    assert changes("model.moe.kernel=xla", "model.moe.capacity_factor=1.25", "model.moe.aux_coef=0.1",
                   "model.moe.z_coef=0.01", "model.dtype=bfloat16", "model.remat=full",
                   "model.scan_layers=false", "model.fp8=tensorwise", "model.init_std=0.01") == []
    dense = _saved()  # no router: top-k and the experts' width mean nothing
    assert model_changes(dense, tiny_config("model.moe.experts_per_token=1",
                                            "model.moe.mlp_dim=64").model, True) == []
    assert model_changes(dense, tiny_config(*moe).model, True) == ["model.moe.num_experts=0 -> 4"]
