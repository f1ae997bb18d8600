"""Killed runs lose at most the work since the last checkpoint and resume bit-for-bit (CPU).

The real `launch.py` runs in a subprocess; the test watches metrics.jsonl and kills it mid-run,
then reruns the same command and compares every loss logged after the restored step with an
uninterrupted run.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import alive_pids, child_pids, run_until, saved_steps

from jaxtron.checkpoint import weights

ROOT = Path(__file__).resolve().parent.parent
STEPS = 10
ARGS = [f"train.steps={STEPS}", "train.log_every=1", "train.seq_len=128", "optim.warmup_steps=2",
        "run.tensorboard=false", "run.progress=lines"]


PLUGIN_NOISE = ("WARNING: All log messages before absl::InitializeLog()", "I0000 00:00:")


def _cmd(run_dir: Path, *extra: str, entry: str = "launch.py") -> list[str]:
    start = [sys.executable, str(ROOT / "launch.py")] if entry == "launch.py" else _jaxtron_train()
    return [*start, *ARGS, f"run.dir={run_dir}", *extra]


def _jaxtron_train() -> list[str]:
    """`jaxtron train`: the console script pip installed beside this Python, else its module."""
    script = Path(sys.executable).parent / "jaxtron"
    return [str(script), "train"] if script.is_file() else [sys.executable, "-m",
                                                               "jaxtron.commands", "train"]


def _losses(run_dir: Path) -> dict[int, float]:
    """step -> loss; a rerun's rows for a step replace the killed run's."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[int, float]:
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    subprocess.run(_cmd(run_dir, "checkpoint.every=3"), cwd=ROOT, check=True,
                   capture_output=True, timeout=600)
    losses = _losses(run_dir)
    assert sorted(losses) == list(range(1, STEPS + 1))
    return losses


@pytest.mark.parametrize("kill_at", [4, pytest.param(8, marks=pytest.mark.slow)])
def test_sigkill_then_rerun_is_bit_exact(tmp_path, straight, kill_at):
    run_dir = tmp_path / "run"
    cmd = _cmd(run_dir, "checkpoint.every=3")
    status = run_until(cmd, run_dir, kill_at, signal.SIGKILL, saved=kill_at // 3 * 3)
    assert status == -signal.SIGKILL
    saved = saved_steps(run_dir)
    assert saved and max(saved) % 3 == 0 and max(saved) < STEPS  # died after a checkpoint
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    resumed = _losses(run_dir)
    assert resumed == straight  # every step, the replayed ones included, bit for bit


def _rows(run_dir: Path) -> dict[int, dict]:
    """step -> the logged row without its timings; a rerun's rows replace the killed run's."""
    timed = ("tokens_per_sec", "step_time", "tflops_per_device", "mfu", "mfu_fp8",
             "host_memory_gib")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: {k: v for k, v in row.items() if k not in timed} for row in rows}


def test_sigkill_then_rerun_is_bit_exact_with_fp8_delayed_scaling(tmp_path):
    """model.fp8=delayed scales from amax histories in the train state: killed with step 5
    logged and checkpoint 3 saved, the rerun redoes steps 4 and 5 and logs the same losses and
    FP8 statistics bit for bit (histories restarted empty, or not restored, change both)."""
    run_dir = tmp_path / "run"
    cmd = _cmd(run_dir, "train.steps=6", "checkpoint.every=3", "model.fp8=delayed",
               "model.fp8_history=2")
    assert run_until(cmd, run_dir, 5, signal.SIGKILL, saved=3) == -signal.SIGKILL
    assert saved_steps(run_dir) == [3]
    killed = _rows(run_dir)
    assert {4, 5} <= set(killed) and "fp8_amax_g" in killed[5]
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, timeout=600)
    resumed = _rows(run_dir)
    assert sorted(resumed) == list(range(1, 7))
    assert [resumed[step] for step in killed] == [killed[step] for step in killed]


def test_sigkill_then_rerun_reproduces_the_balancing_bias(tmp_path):
    """configs/tiny_deepseek.yaml, whose routers' balancing biases are train state moved by each
    step's load: killed with step 5 logged and checkpoint 3 saved, the rerun redoes steps 4 and
    5 and logs what an uninterrupted run logs (losses and per-layer loads) bit for bit, and its
    final biases are that run's (biases restarted at 0, or not restored, change both)."""
    args = ("--config", str(ROOT / "configs" / "tiny_deepseek.yaml"), "train.steps=6",
            "checkpoint.every=3", "train.batch_size=8", "train.seq_len=64",
            "model.moe.bias_update_speed=0.01", "train.eval_every=0")
    straight_dir, run_dir = tmp_path / "straight", tmp_path / "run"
    subprocess.run(_cmd(straight_dir, *args), cwd=ROOT, check=True, capture_output=True,
                   timeout=600)
    assert run_until(_cmd(run_dir, *args), run_dir, 5, signal.SIGKILL, saved=3) == -signal.SIGKILL
    assert saved_steps(run_dir) == [3]
    subprocess.run(_cmd(run_dir, *args), cwd=ROOT, check=True, capture_output=True, timeout=600)
    resumed, straight = _rows(run_dir), _rows(straight_dir)
    assert sorted(resumed) == list(range(1, 7)) and "moe_load/3" in resumed[6]
    assert resumed == straight
    bias = [weights.reader(d)[2](("layers", "mlp", "router_bias"), None)
            for d in (run_dir, straight_dir)]
    np.testing.assert_array_equal(*bias)
    assert np.count_nonzero(bias[0]) > bias[0].size // 2  # the biases moved


# Kills the process inside Orbax's commit of checkpoint 6: its arrays and commit_success file are
# written into the temporary directory, which has not yet been renamed to checkpoints/6.
KILL_IN_THE_COMMIT = """
import os, signal
from orbax.checkpoint._src.path import atomicity
_rename = atomicity.async_path.rename
async def _rename_or_die(src, dst):
    if os.path.basename(str(dst)) == "6":
        os.kill(os.getpid(), signal.SIGKILL)
    return await _rename(src, dst)
atomicity.async_path.rename = _rename_or_die
"""


@pytest.mark.slow  # CI's time; `pytest -m slow` runs it
def test_sigkill_during_a_saves_commit_keeps_the_previous_checkpoint(tmp_path, straight):
    """A checkpoint whose commit was cut short is never read: the rerun resumes from the one
    before, bit for bit, and saves the cut step again (Orbax writes into a temporary directory and
    renames it when complete; the leftover is removed at the next start)."""
    run_dir, hook = tmp_path / "run", tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(KILL_IN_THE_COMMIT)
    cmd = _cmd(run_dir, "checkpoint.every=3")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(hook), os.environ.get(
        "PYTHONPATH")]))}
    killed = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=600)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    assert saved_steps(run_dir) == [3]
    leftovers = [p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.isdigit()]
    assert any(name.startswith("6.") for name in leftovers), leftovers  # the cut commit's
    rerun = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert "resumed from" in rerun.stdout and "step 3" in rerun.stdout
    assert _losses(run_dir) == straight
    assert saved_steps(run_dir) == [6, 9, 10]  # checkpoint.keep=3
    assert [p.name for p in (run_dir / "checkpoints").iterdir() if not p.name.isdigit()] == []


@pytest.mark.parametrize("entry", ["launch.py", "jaxtron train"])
def test_sigterm_saves_the_interrupted_step_and_resumes_exactly(tmp_path, straight, entry):
    run_dir = tmp_path / "run"
    cmd = _cmd(run_dir, "checkpoint.every=1000", entry=entry)  # only the signal and the end save
    status = run_until(cmd, run_dir, 3, signal.SIGTERM)
    assert status == 75  # launch.EXIT_PREEMPTED
    logged = max(_losses(run_dir))
    assert saved_steps(run_dir) == [logged]  # the checkpoint is of the step it stopped at
    assert 3 <= logged < STEPS
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert f"step {logged}" in proc.stdout  # "resumed from ... step N"
    assert _losses(run_dir) == straight


def test_sighup_from_a_closed_terminal_saves_the_step_like_sigterm(tmp_path):
    run_dir = tmp_path / "run"
    status = run_until(_cmd(run_dir, "checkpoint.every=1000"), run_dir, 3, signal.SIGHUP)
    assert status == 75
    logged = max(_losses(run_dir))
    assert saved_steps(run_dir) == [logged] and 3 <= logged < STEPS


def test_a_signal_during_an_evaluation_saves_that_step_without_finishing_it(tmp_path):
    """SIGINT once step 2's row is written, as its (long) evaluation starts: the evaluation is
    left unfinished and step 2 saved, exit 75. Before, every eval batch ran first (a preemption's
    grace period gone; with train.eval_batches=100000 a SIGTERM waited for minutes), then the
    stop came at step 3."""
    import sysconfig

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    held_out = tmp_path / "ds"  # ~265,000 held-out tokens: 130 eval batches, seconds to read
    subprocess.run([sys.executable, str(ROOT / "tools" / "prepare_data.py"),
                    str(stdlib / "email" / "*.py"), str(stdlib / "asyncio" / "*.py"), "--out",
                    str(held_out), "--train-tokenizer", "1000", "--val-fraction", "0.9"],
                   check=True, capture_output=True, timeout=300)
    run_dir = tmp_path / "run"
    cmd = _cmd(run_dir, "checkpoint.every=1000", "train.eval_every=2", "train.eval_batches=4000",
               "data.source=arrayrecord", f"data.mixture=[{{path: {held_out}}}]",
               "model.vocab_size=1024", "model.num_layers=4")
    assert run_until(cmd, run_dir, 2, signal.SIGINT) == 75
    assert saved_steps(run_dir) == [2]
    assert (run_dir / "eval.jsonl").read_text() == ""  # step 2's evaluation never finished


def test_the_data_workers_end_with_a_run_killed_by_sigkill(tmp_path):
    """kill -9 (the OOM killer, a scheduler) of a run with data.workers=1 left its Grain worker
    running, re-parented to pid 1, holding ~250 MB, one per worker per attempt."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_cmd(run_dir, "checkpoint.every=1000", "data.workers=1",
                                 "train.steps=1000"), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 300
        while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text():
            assert time.time() < deadline and proc.poll() is None, "no step was logged"
            time.sleep(0.05)
        workers = child_pids(proc.pid)
        assert workers  # the Grain worker (and multiprocessing's resource tracker)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    deadline = time.time() + 30
    while alive_pids(workers) and time.time() < deadline:
        time.sleep(0.1)
    left = alive_pids(workers)
    for pid in left:  # not to leave them to the next test
        os.kill(pid, signal.SIGKILL)
    assert left == []


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_sent_to_every_process_of_the_job_is_one_line(tmp_path, sig):
    """Ctrl-C in a terminal signals the whole process group, data workers too: each printed a
    KeyboardInterrupt traceback (18 lines with one worker), then "leaked shared_memory objects";
    now the run's one line, exit 75, the step saved."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_cmd(run_dir, "checkpoint.every=1000", "data.workers=2",
                                 "train.steps=1000"), cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.time() + 300
        while not (run_dir / "metrics.jsonl").is_file() or not (run_dir / "metrics.jsonl").read_text():
            assert time.time() < deadline and proc.poll() is None, "no step was logged"
            time.sleep(0.05)
        os.killpg(proc.pid, sig)
        err = proc.communicate(timeout=300)[1]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    # A worker imports jax before anything of jaxtron's runs in it: on a machine with the CUDA
    # plugin (the gpu-aot extra) but no NVIDIA driver, absl logs that at each worker's start.
    lines = [line for line in err.splitlines() if not line.startswith(PLUGIN_NOISE)]
    assert proc.returncode == 75 and len(lines) == 1, err[-3000:]
    assert lines[0].startswith(f"preempted by signal {int(sig)} at step ") and saved_steps(run_dir)


def test_data_workers_that_end_with_the_run_leave_nothing_behind():
    """Ending the workers as their parent exits (the kernel's PR_SET_PDEATHSIG, tried first)
    killed them before they freed their shared memory: "resource_tracker: There appear to be 4
    leaked shared_memory objects" after every run with data workers."""
    done = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_data.py"), "--batches", "50"],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "workers=2:" in done.stdout, done.stderr[-2000:]
    assert "leaked" not in done.stderr, done.stderr[-2000:]


def test_a_reader_that_goes_away_does_not_end_the_run(tmp_path):
    """`python launch.py | head -2`: the run goes on to its last step and saves it, exit 0 (its
    metrics are in run.dir); before, the first print after head exited ended it, exit 0 and no
    checkpoint."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_cmd(run_dir, "checkpoint.every=1000"), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()  # the reader exits
    assert proc.wait(timeout=600) == 0, proc.stderr.read()[-2000:]
    assert saved_steps(run_dir) == [STEPS]
    assert sorted(_losses(run_dir)) == list(range(1, STEPS + 1))


def test_ctrl_c_during_start_up_stops_before_the_first_step(tmp_path):
    """SIGINT once the log says the step is compiling: exit 75 at once, nothing trained or saved. Before, the signal waited for the compile and a
    training step, which it then checkpointed."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_cmd(run_dir, "checkpoint.every=1000", "model.num_layers=8"),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:
            if "compiling the train step" in line:
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 75, err[-2000:]
    assert err.strip().splitlines()[-1].startswith("stopped by a signal before training started")
    assert not run_dir.exists()  # no step ran: the start made run.dir and removed it again


@pytest.mark.parametrize("sig, entry", [(signal.SIGINT, "launch.py"), (signal.SIGTERM, "launch.py"),
                                        (signal.SIGHUP, "launch.py"), (signal.SIGHUP, "jaxtron train"),
                                        (signal.SIGINT, "jaxtron train")])
def test_a_signal_in_the_first_second_stops_with_75(tmp_path, sig, entry):
    """While jax imports: a KeyboardInterrupt there was swallowed by one of jax's gc callbacks
    (the run went on to the end, exit 0) or became an ImportError; SIGTERM/SIGHUP killed it
    (143, 129). Now each is recorded, and start-up stops with 75 once the imports are done.
    `jaxtron train` imports jax with jaxtron itself, before its command starts: the same."""
    for delay in (0.2, 0.8):  # after the interpreter starts, while jax imports
        run_dir = tmp_path / f"run{delay}"
        proc = subprocess.Popen(_cmd(run_dir, entry=entry), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        proc.send_signal(sig)
        err = proc.communicate(timeout=300)[1]
        # what the child inherited beside the code's own start-up: the signal's disposition and
        # this thread's mask (a CI run once saw SIGHUP lost: exit 0, nothing on stderr)
        inherited = (signal.getsignal(sig), sorted(signal.pthread_sigmask(signal.SIG_BLOCK, [])))
        assert proc.returncode == 75, (delay, inherited, err[-2000:])
        assert err.strip().splitlines() == ["stopped by a signal before training started (nothing "
                                            "to save); run the same command to start"]
        assert not (run_dir / "checkpoints").exists()


def test_a_stop_blocked_by_the_parent_still_stops_the_start(tmp_path):
    """A parent thread with SIGHUP blocked (the mask survives exec): the run's handler never saw
    the signal, trained to the end and exited 0 with nothing on stderr. Start-up unblocks the
    signals it stops on, so the pending one stops it with 75."""
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGHUP])
    try:
        proc = subprocess.Popen(_cmd(tmp_path / "run"), cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
    time.sleep(0.8)
    proc.send_signal(signal.SIGHUP)
    err = proc.communicate(timeout=300)[1]
    assert proc.returncode == 75, err[-2000:]
    assert err.strip().splitlines() == ["stopped by a signal before training started (nothing "
                                        "to save); run the same command to start"]


# A batch script's way to start a run: `cmd &` in a non-interactive shell starts it with SIGINT
# ignored; the script then signals it mid-compile, as a batch system's end does.
IN_THE_BACKGROUND = """
"$@" > "$RUN_OUT" 2> "$RUN_ERR" &
pid=$!
for _ in $(seq 3000); do
    grep -q "compiling the train step" "$RUN_OUT" && break
    kill -0 $pid || break
    sleep 0.1
done
kill -$SIG $pid
wait $pid
echo $?
"""


@pytest.mark.parametrize("sig", ["TERM", "HUP"])
def test_a_signal_during_the_compile_of_a_background_job_stops_with_75(tmp_path, sig):
    """Started by a script with `&` (SIGINT ignored from the start), a SIGTERM or SIGHUP during
    the compile ended in `launch.py: stopped by a signal` and 130, which Slurm does not requeue:
    one_line_errors looked for the run's own handler on SIGINT only. Now 75 and launch.py's
    line, as in the foreground."""
    run_dir, out, err = tmp_path / "run", tmp_path / "out.txt", tmp_path / "err.txt"
    env = {**os.environ, "RUN_OUT": str(out), "RUN_ERR": str(err), "SIG": sig}
    script = subprocess.run(["bash", "-c", IN_THE_BACKGROUND, "batch-script",
                             *_cmd(run_dir, "checkpoint.every=1000", "model.num_layers=8")],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    lines = [line for line in err.read_text().splitlines() if not line.startswith(PLUGIN_NOISE)]
    assert script.stdout == "75\n", err.read_text()[-2000:]
    assert lines == ["stopped by a signal before training started (nothing to save); run the same "
                     "command to start"]
    log = out.read_text()
    assert "compiling the train step" in log and "compiled the train step" not in log
    assert not run_dir.exists()  # no step ran: the start made run.dir and removed it again


def test_nohup_keeps_a_run_going_when_the_terminal_hangs_up(tmp_path):
    """A SIGHUP the run was started ignoring (nohup) is not taken over: the run trains on. (The
    same signal without nohup checkpoints and exits 75: the SIGHUP test above.)"""
    run_dir = tmp_path / "run"
    nohup = ["sh", "-c", 'trap "" HUP && exec "$@"', "nohup"]  # no preexec_fn: no fork of jax
    status = run_until([*nohup, *_cmd(run_dir, "checkpoint.every=1000")], run_dir, 2,
                       signal.SIGHUP)
    assert status == 0 and saved_steps(run_dir) == [STEPS]
