"""The metric writers across attempts and terminals: a resumed run logs each step once, in
metrics.jsonl, eval.jsonl and TensorBoard, and the progress bar draws on a terminal that reports
its size as 0x0.

A run killed (SIGKILL) after its last checkpoint N and run again trains N+1.. a second time; the
rows the killed attempt logged for those steps are dropped when the loop starts again, the rows up
to N are kept byte for byte, and TensorBoard's purge (a SessionLog.START at N+1) hides the killed
attempt's events for them.
"""

import io
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import jax
import pytest
from helpers import SMALL, run_until, saved_steps, tensorboard_scalars

from jaxtron import config
from jaxtron.plan import setup as setup_lib
from jaxtron.plan.costs import KEYS
from jaxtron.train import loop as train_lib
from jaxtron.train.metrics import MetricsWriter, StepWindow, Stopwatch

ROOT = Path(__file__).resolve().parent.parent


def _row(step: int, loss: float) -> dict:
    return dict(zip(KEYS, (step, loss, 3e-4, 0.75, 12345.0, 1.8, None, None, step * 2048)))


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def _attempt(run_dir: Path, start: int, end: int, loss: float) -> None:
    """One attempt's logging: steps start+1..end, an evaluation every 10 steps."""
    log = MetricsWriter(run_dir, 40, "lines", tensorboard=True)
    log.begin(start)
    for step in range(start + 1, end + 1):
        log.write(_row(step, loss))
        if step % 10 == 0:
            log.write_eval(step, loss)
    log.close()


def test_a_resumed_attempt_replaces_the_rows_of_the_steps_it_redoes(tmp_path, capsys):
    _attempt(tmp_path, 0, 30, loss=1.0)
    before = (tmp_path / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    with (tmp_path / "metrics.jsonl").open("a") as f:
        f.write('{"step": 31, "lo')  # the line a kill cut short
    time.sleep(1.1)  # tensorboardX names event files by the second: attempts are seconds apart
    _attempt(tmp_path, 20, 40, loss=2.0)  # resumed from the checkpoint at step 20

    rows = (tmp_path / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    assert _steps(tmp_path / "metrics.jsonl") == list(range(1, 41))
    assert rows[:20] == before[:20]  # the steps up to the checkpoint: untouched
    assert {json.loads(r)["loss"] for r in rows[20:]} == {2.0}
    evals = [json.loads(r) for r in (tmp_path / "eval.jsonl").read_text().splitlines()]
    assert [(r["step"], r["eval_loss"]) for r in evals] == [(10, 1.0), (20, 1.0), (30, 2.0),
                                                             (40, 2.0)]
    board = tensorboard_scalars(tmp_path)
    assert board["train/loss"] == [(s, 1.0) for s in range(1, 21)] + [(s, 2.0)
                                                                      for s in range(21, 41)]
    assert board["eval/loss"] == [(10, 1.0), (20, 1.0), (30, 2.0), (40, 2.0)]
    assert not list(tmp_path.glob("*.tmp"))
    capsys.readouterr()


@pytest.mark.slow  # CI's time: the resumed attempt above replaces rows the same way
def test_killed_and_resumed_run_logs_each_step_once(tmp_path):
    """The real launch.py, killed after a checkpoint and run again: every file's steps strictly
    increase, and the rows up to the restored step are the killed attempt's, byte for byte."""
    run_dir = tmp_path / "run"
    steps = 24  # a kill that lands a few steps late still finds steps to redo
    cmd = [sys.executable, str(ROOT / "launch.py"), *SMALL, f"train.steps={steps}",
           "train.eval_every=3", "checkpoint.every=4", f"run.dir={run_dir}"]
    assert run_until(cmd, run_dir, 10, signal.SIGKILL, saved=8) == -signal.SIGKILL
    restored = max(saved_steps(run_dir))
    killed = (run_dir / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    kept = [line for line in killed if json.loads(line)["step"] <= restored]
    assert len(kept) < len(killed)  # the killed attempt logged steps the next one redoes
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]

    rows = (run_dir / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    assert _steps(run_dir / "metrics.jsonl") == list(range(1, steps + 1))
    assert rows[:len(kept)] == kept
    assert _steps(run_dir / "eval.jsonl") == list(range(3, steps + 1, 3))
    losses = {json.loads(r)["step"]: json.loads(r)["loss"] for r in rows}
    board = tensorboard_scalars(run_dir)
    assert [s for s, _ in board["train/loss"]] == list(range(1, steps + 1))
    assert all(abs(v - losses[s]) <= 1e-6 * abs(losses[s]) for s, v in board["train/loss"]
               if s > restored)  # the resumed attempt's values (float32 in the event file)


class _Terminal(io.StringIO):
    """stderr as a terminal: a file descriptor to ask for its size."""

    def fileno(self) -> int:
        return 2

    def isatty(self) -> bool:
        return True


def _frames(text: str) -> list[str]:
    return [f for f in text.replace("\n", "\r").split("\r") if f.strip()]


def test_progress_bar_on_a_0x0_terminal_is_80_columns(tmp_path, monkeypatch):
    """A terminal that reports 0x0 (some CI and ssh set-ups) gets an 80-column bar, not none
    (tqdm took it as -1 columns and -1 rows and drew empty lines); a later real size is followed."""
    size = [os.terminal_size((0, 0))]
    monkeypatch.setattr(sys, "stderr", _Terminal())
    monkeypatch.setattr(os, "get_terminal_size", lambda *args: size[0])
    monkeypatch.setattr(shutil, "get_terminal_size", lambda *args, **kwargs: size[0])
    log = MetricsWriter(tmp_path, 1000, "bar", tensorboard=False)
    log.begin(0)
    log.write(_row(5, 2.5))
    frames = _frames(sys.stderr.getvalue())
    assert frames and "5/1000" in frames[-1] and "loss 2.5000" in frames[-1]
    assert max(len(f) for f in frames) == 79, frames  # one column short: no wrap

    size[0] = os.terminal_size((140, 40))  # the window was resized
    sys.stderr.seek(0)
    sys.stderr.truncate()
    log.write(_row(6, 2.25))
    (frame,) = _frames(sys.stderr.getvalue())
    assert "6/1000" in frame and "12,345 tok/s]" in frame and len(frame) <= 139
    log.close()


def test_step_window_is_the_rows_steps_less_checkpoints_and_evaluations():
    """Fake clock: a row's seconds per step leave out the spans that are not training (the data
    wait stays: a data-bound run is that slow), over exactly the steps since the last row."""
    now = [100.0]
    watch = Stopwatch(clock=lambda: now[0])
    window = StepWindow(watch, 4)  # resumed after step 4
    for phase, seconds in (("data", 0.5), ("eval", 7.0), ("checkpoint", 3.0), ("profile", 1.0)):
        with watch.time(phase):
            now[0] += seconds
    now[0] += 2.5  # the steps' dispatch and device work, seen at the row's sync
    assert window.close(6) == (0.5 + 2.5) / 2
    now[0] += 4.0
    with watch.time("eval"):
        now[0] += 9.0
    assert window.close(10) == 4.0 / 4


def _slowed(compile_step, seconds: float):
    """train.compile_step whose step's device work takes `seconds` more (a host callback that
    sleeps, inside the program: every output of the step is ready only after it)."""

    def sleep_then(loss):
        time.sleep(seconds)
        return loss

    def compile_slow(*args):
        step = compile_step(*args)

        def slow(state, batch):
            state, out = step(state, batch)
            loss = jax.pure_callback(sleep_then, jax.ShapeDtypeStruct((), out["loss"].dtype),
                                     out["loss"])
            return state, {**out, "loss": loss}

        return jax.jit(slow, donate_argnums=0)

    return compile_slow


def test_a_rows_step_time_is_its_steps_without_the_evaluation(tmp_path, monkeypatch, capsys):
    """An evaluation after step 5, between the rows of steps 4 and 6, first waits for step 5's
    device work; that wait is step 5's time, so step 6's row is two steps' time like the others
    (it was counted as evaluation: the row showed half the step time, twice the tok/s). Steps
    slowed by 0.4 s (a sleep on the device's side) make the rows' times steady."""
    monkeypatch.setattr(setup_lib, "compile_step", _slowed(setup_lib.compile_step, 0.4))
    small = [o for o in SMALL if not o.startswith("train.log_every")]
    cfg = config.load(["configs/tiny.yaml"], [*small, "train.steps=8", "train.log_every=2",
                                              "train.eval_every=5", "train.eval_batches=1",
                                              f"run.dir={tmp_path / 'run'}"])
    rows = train_lib.train(cfg)
    assert [r["step"] for r in rows] == [2, 4, 6, 8]
    times = [row["step_time"] for row in rows]
    steady = times[1:]  # row 2 also holds step 1's first-run overhead
    median = statistics.median(steady)
    assert min(times) >= 0.4 and all(median / 1.5 < t < median * 1.5 for t in steady), times
    for row in rows:
        assert row["tokens_per_sec"] == pytest.approx(8 * 32 / row["step_time"])
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert logged == rows
    capsys.readouterr()


def _bar(tmp_path, monkeypatch, columns: int) -> MetricsWriter:
    """A progress bar on a terminal `columns` wide."""
    monkeypatch.setattr(sys, "stderr", _Terminal())
    monkeypatch.setattr(os, "get_terminal_size", lambda *args: os.terminal_size((columns, 24)))
    log = MetricsWriter(tmp_path, 1000, "bar", tensorboard=False)
    log.begin(0)
    return log


def test_progress_bar_drops_fields_that_do_not_fit_rather_than_cut_them(tmp_path, monkeypatch):
    """At 80 columns the bar showed `... | grad_norm 2.` (tqdm cuts the line at the terminal's
    width): the fields that do not fit are left out, the least telling first."""
    log = _bar(tmp_path, monkeypatch, 80)
    log.write(_row(5, 2.5))
    frame = _frames(sys.stderr.getvalue())[-1]
    assert len(frame) == 79 and frame.endswith(", loss 2.5000 | 12,345 tok/s]"), frame
    monkeypatch.setattr(os, "get_terminal_size", lambda *args: os.terminal_size((121, 24)))
    log.write(_row(6, 2.25))  # wide enough for every field
    frame = _frames(sys.stderr.getvalue())[-1]
    assert frame.endswith("loss 2.2500 | lr 3.00e-04 | grad_norm 0.750 | 1800 ms/step | "
                          "12,345 tok/s]"), frame
    log.close()


def test_progress_bar_ends_with_the_rows_step_rate(tmp_path, monkeypatch):
    """The bar's last draw gave steps over its elapsed time (3.88 s/step where the rows said 2.29:
    evaluations, checkpoint waits and the run's end counted as steps): it is the rows' rate."""
    log = _bar(tmp_path, monkeypatch, 100)
    for step, step_time in ((2, 1.8), (4, 2.2)):
        log.tick(step)
        log.write({**_row(step, 2.5), "step_time": step_time})
    time.sleep(0.2)  # the bar's elapsed time holds more than its steps
    log.close()
    assert "2.00s/step" in _frames(sys.stderr.getvalue())[-1]
