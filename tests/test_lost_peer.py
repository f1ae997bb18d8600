"""A lost process ends a two-process run cleanly and restartably (jaxtron/train/supervisor.py).

Two launch.py processes x 4 CPU devices (gloo) train a one-layer model; after four logged steps
process 1 is killed (SIGKILL of its launch.py, whose training process dies with it) or frozen
(SIGSTOP of its launch.py, whose training process stops with it, as a hung node freezes both). Process 0 used to
stop with status 134 (or 4, when a save was under way), a Python traceback (`Gloo AllGather
failed ... Connection reset by peer`) and ~30 lines of C++ fatal output and a stack; now it says
in one line which process was lost and which checkpoint is intact, and exits 75. The same
command then resumes, and its losses equal an uninterrupted run's (one process, 8 devices).

Measured (2 shared cores, run.peer_timeout_s=20, so JAX's heartbeat timeout is 10 s): process 0
stopped 8-11 s after the SIGKILL and 7-13 s after the SIGSTOP (the default, 60: 30 s heartbeats).
Process 1 is lost during checkpoint 4's save: the newest complete checkpoint is 2, and the rerun
resumes from it.
"""

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from helpers import (
    MULTIPROCESS_OVERRIDES,
    MULTIPROCESS_RTOL,
    PROCESSES,
    free_port,
    metrics_rows,
    multiprocess_env,
)

from jaxtron import config
from jaxtron.checkpoint import weights
from jaxtron.train import bad_hosts
from jaxtron.train import loop as train_lib

ROOT = Path(__file__).resolve().parent.parent
PEER_TIMEOUT_S = 20
OVERRIDES = [*MULTIPROCESS_OVERRIDES, "model.num_layers=1", "train.steps=8",
             f"run.peer_timeout_s={PEER_TIMEOUT_S}"]
# What a Python traceback or the C++ runtime's fatal exit leaves on a terminal.
NOISE = ("Traceback", "F0000", "*** Check failure", "Fatal Python error", "@ 0x")


def _start(run_dir: Path, logs: Path, name: str) -> list[subprocess.Popen]:
    """Both processes of the run, each in its own process group (the training process launch.py
    starts is in it); output in logs/<name>-<i>.txt."""
    port = free_port()
    return [subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", str(PROCESSES), "--process-id", str(i), *OVERRIDES,
         f"run.dir={run_dir}"],
        cwd=ROOT, env=multiprocess_env(), stdout=(logs / f"{name}-{i}.txt").open("w"),
        stderr=subprocess.STDOUT, start_new_session=True) for i in range(PROCESSES)]


def _groups(pid: int) -> list[int]:
    """launch.py's process group and its training process's (its child, in a group of its own)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    return [pid, *map(int, children)]


def _signal(pid: int, sig: int) -> None:
    for group in _groups(pid):
        try:
            os.killpg(group, sig)
        except ProcessLookupError:
            pass


def _end(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            _signal(p.pid, signal.SIGCONT)
            _signal(p.pid, signal.SIGKILL)
            p.wait(timeout=60)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: 8 steps in this process over its 8 devices."""
    run_dir = tmp_path_factory.mktemp("reference") / "run"
    cfg = config.load([ROOT / "configs" / "tiny.yaml"], [*OVERRIDES, f"run.dir={run_dir}"])
    return train_lib.train(cfg)


@pytest.mark.slow  # CI's time; `pytest -m slow` runs it
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "frozen"])
def test_a_lost_process_stops_the_other_in_one_line_and_the_rerun_resumes(tmp_path, reference,
                                                                          sig):
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    procs = _start(run_dir, logs, "lost")
    try:
        deadline = time.monotonic() + 400
        while (len(metrics_rows(run_dir)) < 4 and all(p.poll() is None for p in procs)
               and time.monotonic() < deadline):
            time.sleep(0.1)
        assert len(metrics_rows(run_dir)) >= 4, (logs / "lost-0.txt").read_text()[-3000:]
        # launch.py only: its training process dies with it, or stops with it
        procs[1].send_signal(sig)
        lost_at = time.monotonic()
        code = procs[0].wait(timeout=120)
        stopped_after = time.monotonic() - lost_at
    finally:
        _end(procs)
    out = (logs / "lost-0.txt").read_text()
    print(f"process 0 exited {code} {stopped_after:.1f} s after process 1 was "
          f"{'killed' if sig == signal.SIGKILL else 'frozen'}")
    saved = weights.complete_steps(run_dir / "checkpoints")
    assert saved, out[-3000:]
    newest = int(saved[-1].name)
    assert code == 75 and stopped_after < PEER_TIMEOUT_S, (code, stopped_after, out[-3000:])
    errors = [line for line in out.splitlines() if "error" in line.lower()]
    host = bad_hosts.host_of(run_dir, 1)  # named, and marked bad, where process 0 wrote hosts.json
    named = f"\\(host {re.escape(host)}\\) " if host else ""
    assert len(errors) == 1 and re.fullmatch(
        rf"launch\.py: error: process 1 of 2 {named}stopped answering \(lost peer\) after step "
        rf"\d+; the last checkpoint, step {newest}, is intact: rerun the same command to resume",
        errors[0]), out[-3000:]
    assert bad_hosts.read(run_dir) == ([host] if host else [])
    assert not [n for n in NOISE if n in out] and not re.search(r"^[EF]\d{4} ", out, re.M), out
    assert weights.read_meta(saved[-1])["step"] == newest  # the newest complete one reads
    assert "lost peer" in (run_dir / "logs" / "process_0.err").read_text()  # the details

    procs = _start(run_dir, logs, "rerun")
    try:
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        _end(procs)
    rerun = (logs / "rerun-0.txt").read_text()
    assert codes == [0, 0] and f"step {newest}" in rerun, rerun[-3000:]
    resumed = metrics_rows(run_dir)[newest - 8:]  # after the lost attempt's rows
    assert [r["step"] for r in resumed] == list(range(newest + 1, 9))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in resumed],
                                   [r[key] for r in reference[newest:]], rtol=MULTIPROCESS_RTOL)


# Process 1 is alive but stuck in Python at step 4 (its heartbeats go on, so JAX never ends it).
STUCK_AT_STEP_4 = """
import time
from jaxtron.train import metrics
_tick = metrics.MetricsWriter.tick
def _stuck(self, step):
    if step == 4:
        time.sleep(10**6)
    return _tick(self, step)
metrics.MetricsWriter.tick = _stuck
"""
STUCK_TIMEOUT_S = 15


def test_a_stuck_process_ends_the_run_in_one_line_each_with_75(tmp_path, reference):
    """Both processes stop within run.stuck_timeout_s (and the lost-peer bound after it), each
    with one error line and status 75, and the same command resumes exactly."""
    run_dir, logs, hook = tmp_path / "run", tmp_path / "logs", tmp_path / "hook"
    logs.mkdir()
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(STUCK_AT_STEP_4)
    port, procs = free_port(), []
    for i in range(PROCESSES):
        env = multiprocess_env()
        if i == 1:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook), env.get("PYTHONPATH")]))
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "launch.py"), "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", str(PROCESSES), "--process-id", str(i), *OVERRIDES,
             f"run.stuck_timeout_s={STUCK_TIMEOUT_S}", f"run.dir={run_dir}"],
            cwd=ROOT, env=env, stdout=(logs / f"stuck-{i}.txt").open("w"),
            stderr=subprocess.STDOUT, start_new_session=True))
    try:
        codes = [p.wait(timeout=400) for p in procs]
    finally:
        _end(procs)
    out = [(logs / f"stuck-{i}.txt").read_text() for i in range(PROCESSES)]
    assert codes == [75, 75], (codes, out[0][-2000:], out[1][-2000:])
    for text in out:
        errors = [line for line in text.splitlines() if "error" in line.lower()]
        assert len(errors) == 1 and re.match(r"launch\.py: error: (no progress in 15 s while "
                                             r"[^(]+ \(run.stuck_timeout_s\)|process "
                                             r"\d of 2 (\(host [^)]+\) )?stopped answering "
                                             r"\(lost peer\))",
                                             errors[0]), text[-3000:]
        assert not [n for n in NOISE if n in text] and not re.search(r"^[EF]\d{4} ", text, re.M)
    assert "no progress in 15 s while training step 4" in out[1]  # the stuck one says so itself
    newest = int(weights.complete_steps(run_dir / "checkpoints")[-1].name)

    procs = _start(run_dir, logs, "rerun")
    try:
        assert [p.wait(timeout=400) for p in procs] == [0, 0]
    finally:
        _end(procs)
    resumed = [r for r in metrics_rows(run_dir) if r["step"] > newest][-(8 - newest):]
    assert [r["step"] for r in resumed] == list(range(newest + 1, 9))
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in resumed],
                                   [r[key] for r in reference[newest:]], rtol=MULTIPROCESS_RTOL)


def test_the_supervisor_passes_on_the_watchdog_line_and_keeps_the_runtime_noise():
    """What the training process's stderr shows when its peer (process 0, the coordination
    service's host) stopped on its own watchdog while this one's watchdog fired too: the runtime's
    warning and error lines and the fatal line's tail are kept for the log; the watchdog's line,
    which comes after the fatal one, still reaches the terminal (it is the only line: the
    supervisor adds none)."""
    from jaxtron.train import supervisor

    stuck = ("launch.py: error: no progress in 15 s while training step 4 "
             "(run.stuck_timeout_s): a process of the run is stuck\n")
    lines = [
        "[Gloo] Rank 1 is connected to 1 peer ranks.\n",
        "W1127 18:30:08.687653    6761 preemption_sync_manager.cc:147] Failed to retrieve "
        "preemption notice from coordination service: UNAVAILABLE: Socket closed\n",
        "Additional GRPC error information from remote target coordination_service\n",
        "E1127 18:30:08.687763    6761 preemption_sync_manager.cc:159] Failed to cancel "
        "preemption barrier: FAILED_PRECONDITION\n",
        "F1127 18:30:09.000001    6761 client.h:77] Terminating process because the JAX "
        "distributed service detected fatal errors.\n",
        "*** Check failure stack trace: ***\n",
        stuck,
    ]
    stderr = supervisor._Stderr()
    shown = [line for line in lines if stderr.take(line) is not None]
    assert shown == [lines[0], stuck]
    assert stderr.stuck and stderr.runtime_fatal and len(stderr.kept) == 5
    assert stderr.first_sign is not None

    healthy = supervisor._Stderr()  # a warning alone from the runtime is no sign of a lost peer
    assert healthy.take(lines[1]) is None and healthy.first_sign is None


# What a training process's stderr shows when JAX's coordination service ends it over a lost
# process 1 (abridged), before it aborts.
RUNTIME_ABORT = """
import os, sys
sys.stderr.write(
    "E1127 18:30:08.687763    6761 coordination_service.cc:501] Task 1 heartbeat timeout.\\n"
    "F1127 18:30:09.000001    6761 client.h:77] Terminating process because the JAX "
    "distributed service detected fatal errors.\\n")
sys.stderr.flush()
os.abort()
"""


def test_the_lost_process_host_is_named_and_added_to_bad_hosts(tmp_path, capsys):
    """A supervised child aborted by the runtime over process 1 (on node7, says hosts.json): the
    supervisor's line names node7 and bad_hosts gets it, once per survivor. No hosts.json (or a
    process it does not name): the line as before and no bad_hosts."""
    from jaxtron import lifecycle
    from jaxtron.train import supervisor

    handlers = {sig: signal.getsignal(sig) for sig in
                (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCONT)}
    bad_hosts.write_hosts(tmp_path, ["node3", "node7"])
    try:
        status = supervisor.supervise([sys.executable, "-c", RUNTIME_ABORT], 0, 2, tmp_path, 60)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    kept = "no checkpoint was saved yet: rerun the same command to start"
    assert status == 75
    assert capsys.readouterr().err == (f"{lifecycle.script_name()}: error: process 1 of 2 "
                                       f"(host node7) stopped answering (lost peer); {kept}\n")
    assert supervisor._mark_bad(tmp_path, 1) == "node7"  # another survivor
    assert (tmp_path / bad_hosts.BAD).read_text() == "node7\tprocess 1 stopped answering\n" * 2
    assert bad_hosts.read(tmp_path) == ["node7"]
    assert supervisor._lost_line(0, 2, tmp_path, supervisor._mark_bad(tmp_path, 0)) == (
        f"process 0 of 2 (the coordinator, host node3) stopped answering (lost peer); {kept}")
    assert bad_hosts.read(tmp_path) == ["node7", "node3"]

    (tmp_path / bad_hosts.HOSTS).unlink()
    (tmp_path / bad_hosts.BAD).unlink()
    for lost in (1, None):
        assert supervisor._mark_bad(tmp_path, lost) is None
    assert supervisor._lost_line(1, 2, tmp_path, None) == (
        f"process 1 of 2 stopped answering (lost peer); {kept}")
    assert not (tmp_path / bad_hosts.BAD).exists()
