"""Goodput: the parts of a run's wall time add up to it, across a preemption and a resume.

One attempt, timed around the call: its parts (start-up, compile, data, steps, checkpoint, eval)
leave less than 2% of the measured wall time to `other`, and the account's wall time is the
measured one within 2%. A run stopped by SIGTERM (exit 75) whose last save is then lost resumes
from the checkpoint before it: run.dir/goodput.json holds both attempts, the first one's steps
after that checkpoint count as redone (its time from the step it recorded at the save), and the
second attempt's stdout and TensorBoard report the whole run (TensorBoard hides the first
attempt's account, logged at a step the second one redoes).
"""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import SMALL, run_until, saved_steps, tensorboard_scalars

from jaxtron import config
from jaxtron.train import goodput
from jaxtron.train.loop import train

ROOT = Path(__file__).resolve().parent.parent
TOLERANCE = 0.02
SLACK_S = 0.2  # the test's own clock also runs over the exit's writes, after the account is taken
STEPS = 24  # a stop that lands a few steps late still stops before the end


def test_parts_add_up_to_the_wall_time(tmp_path, capsys):
    run_dir = tmp_path / "run"
    cfg = config.load(["configs/tiny.yaml"], [*SMALL, "train.steps=6", "train.eval_every=3",
                                              "checkpoint.every=2", f"run.dir={run_dir}"])
    started = time.time()
    train(cfg, started=started)
    wall = time.time() - started

    (record,) = json.loads((run_dir / goodput.FILE).read_text())
    seconds = record["seconds"]
    named = sum(v for part, v in seconds.items() if part != "other")
    assert abs(named - wall) < TOLERANCE * wall + SLACK_S, (seconds, wall)
    assert abs(seconds["other"]) < TOLERANCE * wall
    assert abs(record["wall_s"] - wall) < TOLERANCE * wall + SLACK_S
    for part in ("startup", "compile", "step", "checkpoint", "eval"):
        assert seconds[part] > 0, part
    assert record["outcome"] == "done" and (record["resumed_from"], record["last_step"]) == (0, 6)
    assert sorted(record["step_s_at"], key=int) == ["2", "4", "6"]
    assert record["step_s_at"]["6"] <= seconds["step"]

    summary = goodput.summarize([record])
    assert summary["goodput"] == pytest.approx(seconds["step"] / record["wall_s"])
    assert summary["redone_s"] == 0 and summary["attempts"] == 1
    out = capsys.readouterr().out
    assert f"goodput {100 * summary['goodput']:.1f}%" in out and "in 1 attempt " in out
    board = tensorboard_scalars(run_dir)
    for key in ("goodput", "wall_s", "step_s", "compile_s", "startup_s", "eval_s", "other_s"):
        assert board[f"goodput/{key}"] == [(6, pytest.approx(summary[key], rel=1e-6))], key


def _launch(run_dir: Path) -> list[str]:
    return [sys.executable, str(ROOT / "launch.py"), *SMALL, f"train.steps={STEPS}",
            "train.eval_every=0", "checkpoint.every=3", f"run.dir={run_dir}"]


def test_preempted_then_resumed_run_accounts_both_attempts(tmp_path):
    run_dir = tmp_path / "run"
    assert run_until(_launch(run_dir), run_dir, 4, signal.SIGTERM) == 75
    *_, resumed, stopped = saved_steps(run_dir)  # the step SIGTERM stopped at, saved
    assert stopped >= 4 and resumed % 3 == 0 and resumed < stopped
    shutil.rmtree(run_dir / "checkpoints" / str(stopped))  # its save is lost: resume before it
    proc = subprocess.run(_launch(run_dir), cwd=ROOT, capture_output=True, text=True, timeout=600,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]

    first, second = json.loads((run_dir / goodput.FILE).read_text())
    assert (first["outcome"], first["resumed_from"], first["last_step"]) == ("preempted", 0,
                                                                              stopped)
    assert (second["outcome"], second["resumed_from"], second["last_step"]) == ("done", resumed,
                                                                                STEPS)
    assert second["started"] >= first["started"] + first["wall_s"]
    for record in (first, second):
        assert abs(record["seconds"]["other"]) < TOLERANCE * record["wall_s"], record

    summary = goodput.summarize([first, second])
    redone = first["seconds"]["step"] - first["step_s_at"][str(resumed)]  # trained twice
    assert summary["redone_steps"] == stopped - resumed and summary["attempts"] == 2
    assert summary["redone_s"] == pytest.approx(redone) and redone > 0
    assert summary["step_s"] == pytest.approx(first["step_s_at"][str(resumed)]
                                              + second["seconds"]["step"])
    assert summary["wall_s"] == pytest.approx(first["wall_s"] + second["wall_s"])
    assert summary["goodput"] == pytest.approx(summary["step_s"] / summary["wall_s"])
    parts = sum(summary[f"{part}_s"] for part in goodput.PARTS)
    assert parts == pytest.approx(summary["wall_s"])

    assert "in 2 attempts" in proc.stdout and f"{stopped - resumed} steps)" in proc.stdout
    board = tensorboard_scalars(run_dir)  # the first attempt's account, at a redone step, is hidden
    assert board["goodput/attempts"] == [(STEPS, 2.0)]
    assert board["goodput/redone_steps"] == [(STEPS, float(stopped - resumed))]
    assert board["goodput/goodput"][-1] == (STEPS, pytest.approx(summary["goodput"], rel=1e-6))


@pytest.mark.slow  # CI's time (the preempted one above runs); `pytest -m slow` runs it
def test_killed_then_resumed_run_accounts_both_attempts(tmp_path):
    """A run killed by SIGKILL (no exit code runs) still has its account in goodput.json, as of
    its last log row, marked "killed" by the next attempt; resumed from checkpoint 4 (the later
    ones removed), its steps after 4 count as redone (the summary said 1 attempt, 0 redone)."""
    run_dir = tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "launch.py"), *SMALL, "train.steps=40", "train.eval_every=0",
           "checkpoint.every=4", f"run.dir={run_dir}"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:  # killed once checkpoint 4 is on disk (its write is asynchronous) and goodput.json
        # holds step 6 (written just after the log row of step 6: waiting on metrics.jsonl's row
        # could kill the run between the two)
        deadline, account = time.time() + 300, run_dir / goodput.FILE
        while time.time() < deadline and proc.poll() is None:
            if (run_dir / "checkpoints" / "4").is_dir() and account.exists() and \
                    json.loads(account.read_text())[-1]["last_step"] >= 6:
                proc.kill()
            time.sleep(0.02)
    finally:
        proc.kill()
        assert proc.wait(timeout=60) == -signal.SIGKILL
    (killed,) = json.loads((run_dir / goodput.FILE).read_text())
    assert killed["outcome"] == "running" and killed["last_step"] >= 6
    for step in saved_steps(run_dir):
        if step > 4:
            shutil.rmtree(run_dir / "checkpoints" / str(step))
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]

    first, second = json.loads((run_dir / goodput.FILE).read_text())
    assert first == {**killed, "outcome": "killed"}
    assert (second["outcome"], second["resumed_from"], second["last_step"]) == ("done", 4, 40)
    summary = goodput.summarize([first, second])
    redone = first["seconds"]["step"] - first["step_s_at"]["4"]
    assert summary["redone_steps"] == first["last_step"] - 4 and summary["attempts"] == 2
    assert summary["redone_s"] == pytest.approx(redone) and redone > 0
    assert "in 2 attempts" in proc.stdout and f"{first['last_step'] - 4} steps)" in proc.stdout


def test_startup_begins_when_python_starts_not_when_its_pid_did(tmp_path):
    """`sleep 3; exec python launch.py` in one shell: python runs in a pid that was alive 3 s
    before it, as in `pip install -e . && python launch.py` (bash execs the last command), where
    /proc's start of the pid counted the pip install as start-up (48 of 51.9 s). The attempt
    starts after the pause, and start-up is what python took within the time it ran."""
    pause_s, run_dir = 3, tmp_path / "run"
    cmd = [sys.executable, str(ROOT / "launch.py"), *SMALL, "train.steps=1", "train.eval_every=0",
           f"run.dir={run_dir}"]
    before = time.time()
    proc = subprocess.run(["bash", "-c", f'sleep {pause_s}; exec "$@"', "bash", *cmd], cwd=ROOT,
                          capture_output=True, text=True, timeout=600, check=False)
    after = time.time()
    assert proc.returncode == 0, proc.stderr[-2000:]
    (record,) = json.loads((run_dir / goodput.FILE).read_text())
    assert before + pause_s <= record["started"] <= record["started"] + record["wall_s"] <= after
    assert 0 < record["seconds"]["startup"] < after - before - pause_s
