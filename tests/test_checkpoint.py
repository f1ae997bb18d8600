"""Checkpoints: a resumed run continues bit-for-bit where the uninterrupted one went."""

import json
import shutil

import numpy as np

from jaxtron import config
from jaxtron.train import train


def _cfg(run_dir, *extra):
    return config.load(["configs/tiny.yaml"], [
        "train.steps=6", "train.log_every=1", "train.seq_len=64", "checkpoint.every=2",
        "checkpoint.keep=2", "optim.warmup_steps=2", "run.tensorboard=false",
        "run.progress=lines", f"run.dir={run_dir}", *extra,
    ])


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

    meta = json.loads((run_dir / "checkpoints" / "6" / "meta" / "metadata").read_text())
    assert meta["step"] == 6 and meta["tokens_seen"] == 6 * 16 * 64
    assert meta["loss"] == straight[-1]["loss"]


def test_finished_run_is_not_trained_again(tmp_path):
    run_dir = tmp_path / "run"
    train(_cfg(run_dir, "train.steps=2"))
    assert train(_cfg(run_dir, "train.steps=2")) == []
