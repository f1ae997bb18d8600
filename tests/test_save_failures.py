"""A checkpoint that cannot be written ends the run at once: exit 4, one line naming the cause,
never "done". And one run.dir holds one run at a time."""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import grain
import numpy as np
import pytest
from helpers import assert_refused

from jaxtron import config
from jaxtron.checkpoint import LOCK_FILE, Checkpoints, CheckpointSaveError

ROOT = Path(__file__).resolve().parent.parent


def _launch(*args: str, **kwargs) -> subprocess.Popen | subprocess.CompletedProcess:
    command = [sys.executable, str(ROOT / "launch.py"), "train.seq_len=64", "train.eval_every=0",
               "run.tensorboard=false", "run.progress=lines", *args]
    if kwargs.pop("background", False):
        return subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)


def _checkpoints(run_dir: Path) -> Checkpoints:
    cfg = config.load(["configs/tiny.yaml"], [f"run.dir={run_dir}"])
    return Checkpoints(cfg.checkpoint, run_dir)


def _save(ckpt: Checkpoints, step: int) -> None:
    import jax.numpy as jnp

    ckpt.save(step, {"w": jnp.arange(4.0)}, iter(grain.MapDataset.range(8).to_iter_dataset()),
              {"step": step})


def test_a_checkpoints_directory_replaced_by_a_file_is_one_line(tmp_path):
    ckpt = _checkpoints(tmp_path)
    _save(ckpt, 2)
    ckpt.wait()
    os.rename(tmp_path / "checkpoints", tmp_path / "old")
    (tmp_path / "checkpoints").write_text("")
    with pytest.raises(CheckpointSaveError, match=r"^checkpoint 4 was not saved: not a directory "
                                                  rf"\({tmp_path / 'checkpoints'}\)$"):
        _save(ckpt, 4)
    ckpt.close()


def test_a_step_directory_that_cannot_be_made_fails_at_once(tmp_path, monkeypatch):
    """Orbax by default makes the step directory in the background while the writes wait up to
    300 s for a signal that it exists, then time out; here the failure is raised in save()."""
    from orbax.checkpoint._src.path import atomicity

    async def refused(makedir, tmp_dir, **kwargs):
        raise PermissionError(13, "Permission denied", str(tmp_dir))

    ckpt = _checkpoints(tmp_path)
    monkeypatch.setattr(atomicity, "_create_tmp_directory", refused)
    began = time.monotonic()
    with pytest.raises(CheckpointSaveError, match=r"^checkpoint 4 was not saved: permission denied "
                                                  rf"\({tmp_path / 'checkpoints'}\)$"):
        _save(ckpt, 4)
        ckpt.wait()
    assert time.monotonic() - began < 30
    ckpt.close()
    assert ckpt.steps() == []


def _tmpfs(where: Path, size: str) -> Path:
    where.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)],
                      capture_output=True, check=False).returncode != 0:
        pytest.skip("mounting a small tmpfs is not permitted here")
    return where


@pytest.fixture
def full_disk(tmp_path):
    """A 3 MiB tmpfs: room for a run's files but not for its first checkpoint (~88 MB)."""
    yield _tmpfs(tmp_path / "small", "3m")
    subprocess.run(["umount", str(tmp_path / "small")], check=True)


@pytest.fixture
def filling_disk(tmp_path):
    """A 100 MiB tmpfs: room for one checkpoint of tiny (88,108,040 bytes) until it fills."""
    yield _tmpfs(tmp_path / "fills", "100m")
    subprocess.run(["umount", str(tmp_path / "fills")], check=True)


def test_a_run_dir_without_room_for_one_checkpoint_is_refused_before_training(full_disk):
    """Every save would fail: refused in one line before a step is trained (it trained until
    the first save, then stopped with 4), and nothing is left in run.dir."""
    run_dir = full_disk / "run"
    proc = _launch("train.steps=3", "train.log_every=1", f"run.dir={run_dir}")
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert re.fullmatch(rf"launch.py: error: run.dir {run_dir} has 0.00 GiB \([\d,]+ bytes\) free "
                        r"on its filesystem, less than one checkpoint \(0.08 GiB \(88,108,040 "
                        r"bytes\): params \+ optimizer state\), so the first save fails; free "
                        r"space there or point run.dir at a larger filesystem", proc.stderr.strip())
    assert " | loss " not in proc.stdout and not run_dir.exists()
    dry = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--dry-run",
                          f"run.dir={run_dir}"], cwd=ROOT, capture_output=True, text=True,
                         check=False)
    assert dry.returncode == 2 and dry.stderr == proc.stderr


def test_a_disk_that_fills_during_the_run_ends_it_with_status_4_and_one_line(filling_disk):
    """The write fails in the background: reported as the checkpoint that was not saved (not a
    900-line traceback), no "done" line, and no checkpoint listed."""
    run_dir = filling_disk / "run"
    proc = _launch("train.steps=100000", "checkpoint.every=0", "train.log_every=1",
                   f"run.dir={run_dir}", background=True)
    _wait_for_step(proc)
    with open(filling_disk / "filler", "wb") as f:  # another program takes the room
        f.truncate(0)
        f.write(os.urandom(99 * 2**20))
    proc.send_signal(signal.SIGTERM)  # a checkpoint, then 75: here it cannot be written
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 4, err[-3000:]
    assert re.fullmatch(r"launch.py: error: checkpoint \d+ was not saved: no space left on device "
                        rf"\({run_dir / 'checkpoints'}\)", err.strip()), err[-3000:]
    assert "done:" not in out
    (left,) = (run_dir / "checkpoints").iterdir()  # the failed save's part, removed at a restart
    assert left.name.endswith(".orbax-checkpoint-tmp")
    ckpt, began = _checkpoints(run_dir), time.monotonic()  # removes it in the background
    while left.exists() and time.monotonic() - began < 30:
        time.sleep(0.1)
    ckpt.close()
    assert not left.exists()


def test_a_background_write_that_failed_is_caught_by_check_before_the_next_save(full_disk):
    """check() (called every step) raises once the write has failed, without waiting for one in
    progress; the loop does not train on to the next checkpoint first."""
    import jax.numpy as jnp

    ckpt = _checkpoints(full_disk)
    noise = jnp.asarray(np.random.default_rng(0).standard_normal((2, 2**20), np.float32))
    ckpt.save(1, {"w": noise}, iter(grain.MapDataset.range(8).to_iter_dataset()),
              {"step": 1})  # 8 MiB that do not compress: more than the disk holds
    began = time.monotonic()
    with pytest.raises(CheckpointSaveError, match=r"^checkpoint 1 was not saved: no space left "
                                                  rf"on device \({full_disk / 'checkpoints'}\)$"):
        while time.monotonic() - began < 60:
            ckpt.check()
            time.sleep(0.05)
    ckpt.close()
    assert ckpt.steps() == []


def _wait_for_step(proc: subprocess.Popen) -> None:
    for line in proc.stdout:
        if " step " in line and " | loss " in line:
            return
    raise AssertionError(f"the first run ended: {proc.wait()} {proc.stderr.read()[-2000:]}")


def test_a_second_run_into_the_same_run_dir_is_refused_and_a_killed_ones_lock_blocks_nothing(
        tmp_path):
    run_dir = tmp_path / "run"
    first = _launch("train.steps=100000", "checkpoint.every=0", "train.log_every=1",
                    f"run.dir={run_dir}", background=True)
    try:
        _wait_for_step(first)
        # (not the running first's temporary files: goodput.json is written beside and renamed)
        before = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir()
                  if not p.name.endswith(".tmp")}
        second = _launch("train.steps=2", f"run.dir={run_dir}")
        assert_refused(second.returncode, second.stderr, f"run.dir {run_dir}",
                       f"pid {first.pid} on host {os.uname().nodename}")
        assert not second.stdout
        after = {p.name: p.stat().st_mtime_ns for p in run_dir.iterdir() if p.name in before}
        assert after.keys() == before.keys() and after["config.yaml"] == before["config.yaml"]
    finally:
        first.send_signal(signal.SIGKILL)  # no clean-up: its lock file stays behind
        first.wait()
    assert (run_dir / LOCK_FILE).exists()
    third = _launch("train.steps=1", f"run.dir={run_dir}")
    assert third.returncode == 0, third.stderr[-2000:]
    assert "done: step 1" in third.stdout
