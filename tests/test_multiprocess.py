"""Several processes: 2 x 4 CPU devices (gloo collectives) train exactly as 1 x 8 devices on the
same global batches, also on meshes where one batch shard spans both processes (pipeline stages
on different processes); they checkpoint together, resume together or as one process, and a
killed peer stops the other.

The real launch.py runs in two subprocesses joined at a localhost coordinator; the reference runs
in this pytest process on conftest's 8 simulated devices.
"""

import dataclasses
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
from helpers import (
    MULTIPROCESS_OVERRIDES,
    MULTIPROCESS_RTOL,
    PROCESSES,
    free_port,
    metrics_rows,
    multiprocess_env,
    start_processes,
    wait_processes,
)

import launch
from jaxtron import config
from jaxtron.train import distributed
from jaxtron.train import loop as train_lib

ROOT = Path(__file__).resolve().parent.parent
DEAD_PEER_LIMIT_S = 60


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two processes train 4 steps; rerun to 1000 steps, they resume, and once step 6 is logged
    process 1 is killed. The reference: 6 steps in this one process over all 8 devices."""
    tmp = tmp_path_factory.mktemp("multiprocess")
    run_dir, logs = tmp / "run", tmp / "logs"
    logs.mkdir()
    procs = []
    try:
        procs = start_processes(run_dir, logs, "first", "train.steps=4")
        codes, saved = wait_processes(procs), run_dir / "checkpoints"
        first = dict(codes=codes, rows=metrics_rows(run_dir),
                     checkpoints=sorted(p.name for p in saved.iterdir()) if saved.is_dir() else [])
        shutil.copytree(run_dir, tmp / "as_one")  # resumed below by one process

        procs = start_processes(run_dir, logs, "second", "train.steps=1000")
        deadline = time.monotonic() + 400
        while (len(metrics_rows(run_dir)) < 6 and all(p.poll() is None for p in procs)
               and time.monotonic() < deadline):
            time.sleep(0.2)
        procs[1].send_signal(signal.SIGKILL)
        killed = time.monotonic()
        try:
            code = procs[0].wait(timeout=DEAD_PEER_LIMIT_S + 60)
        except subprocess.TimeoutExpired:
            code = None
        second = dict(code=code, stopped_after=time.monotonic() - killed,
                      rows=metrics_rows(run_dir)[4:])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)
    outputs = {p.name: p.read_text() for p in sorted(logs.iterdir())}

    cfg = config.load([ROOT / "configs" / "tiny.yaml"],
                      [*MULTIPROCESS_OVERRIDES, "train.steps=6", f"run.dir={tmp / 'reference'}"])
    reference = train_lib.train(cfg)
    # The two processes' step-4 checkpoint, resumed by this one process over its 8 devices.
    as_one = train_lib.train(dataclasses.replace(
        cfg, run=dataclasses.replace(cfg.run, dir=str(tmp / "as_one"))))
    return dict(first=first, second=second, reference=reference, outputs=outputs,
                run_dir=run_dir, as_one=as_one)


def _losses(rows: list[dict]) -> list[float]:
    return [row["loss"] for row in rows]


def test_two_processes_train_as_one(runs):
    first, outputs = runs["first"], runs["outputs"]
    assert first["codes"] == [0, 0], outputs
    assert [r["step"] for r in first["rows"]] == [1, 2, 3, 4]
    np.testing.assert_allclose(_losses(first["rows"]), _losses(runs["reference"][:4]),
                               rtol=MULTIPROCESS_RTOL)
    np.testing.assert_allclose([r["grad_norm"] for r in first["rows"]],
                               [r["grad_norm"] for r in runs["reference"][:4]],
                               rtol=MULTIPROCESS_RTOL)
    assert "jax.distributed: 2 processes joined, 8 cpu devices" in outputs["first-0.txt"]
    # fsdp=8 over 2 processes of 4 devices, both on this machine: one host, in the log as in the
    # preflight checks (no axis crosses hosts, and no warning says one does).
    assert "crosses hosts" not in outputs["first-0.txt"]
    assert "spans hosts" not in outputs["first-0.txt"]


def test_processes_checkpoint_together_and_resume(runs):
    run_dir, outputs = runs["run_dir"], runs["outputs"]
    assert runs["first"]["checkpoints"] == ["2", "4"]  # one directory per step, none left temporary
    for step in (2, 4):
        step_dir = run_dir / "checkpoints" / str(step)
        assert (step_dir / "commit_success.txt").is_file()
        for i in range(PROCESSES):  # each process wrote its own shards and input position into it
            assert (step_dir / "state" / f"ocdbt.process_{i}").is_dir()
            assert (step_dir / "data" / f"process_{i}-of-{PROCESSES}.json").is_file()
    assert "resumed from" in outputs["second-0.txt"] and "step 4" in outputs["second-0.txt"]
    for text in outputs.values():
        assert "unreadable" not in text and "cannot resume the input exactly" not in text, text
    resumed = runs["second"]["rows"][:2]
    assert [r["step"] for r in resumed] == [5, 6]
    np.testing.assert_allclose(_losses(resumed), _losses(runs["reference"][4:]),
                               rtol=MULTIPROCESS_RTOL)


def test_checkpoint_of_two_processes_resumes_in_one(runs):
    """Saved by 2 processes at step 4, resumed by 1: steps 5 and 6 as the uninterrupted run's."""
    assert [r["step"] for r in runs["as_one"]] == [5, 6]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in runs["as_one"]],
                                   [r[key] for r in runs["reference"][4:]], rtol=MULTIPROCESS_RTOL)


# stage=2 puts stage 0 on process 0's devices and stage 1 on process 1's, so every batch shard
# (split over fsdp) lives on both processes; tensor=2 splits heads inside each process.
SPANNING = ["mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2", "train.microbatches=4",
            "train.steps=3", "checkpoint.every=0"]


@pytest.mark.slow  # CI's time; `pytest -m slow` runs it
def test_batch_shards_spanning_processes(tmp_path):
    """Pipeline stages on different processes: a batch shard spans both, and each device must
    take its rows of the global batch (not its process's slice); losses and grad norms equal
    one process over 8 devices (measured: identical, bit for bit; with the old per-process row slices
    the run exited with an error here)."""
    logs = tmp_path / "logs"
    logs.mkdir()
    procs = start_processes(tmp_path / "run", logs, "spanning", *SPANNING)
    try:
        codes = wait_processes(procs)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)
    assert codes == [0, 0], (logs / "spanning-0.txt").read_text()[-3000:]
    rows = metrics_rows(tmp_path / "run")
    cfg = config.load([ROOT / "configs" / "tiny.yaml"],
                      [*MULTIPROCESS_OVERRIDES, *SPANNING, f"run.dir={tmp_path / 'reference'}"])
    reference = train_lib.train(cfg)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in rows], [r[key] for r in reference],
                                   rtol=MULTIPROCESS_RTOL)


def test_killed_process_stops_the_other(runs):
    """It ends in one line naming the lost process, restartably (75); tests/test_lost_peer.py
    looks closer (no traceback, no C++ stack; the rerun resumes)."""
    second, out = runs["second"], runs["outputs"]["second-0.txt"]
    assert second["code"] == 75, out[-3000:]
    assert second["stopped_after"] < DEAD_PEER_LIMIT_S, second["stopped_after"]
    assert re.match(r"launch\.py: error: process 1 of 2 \(host \S+\) stopped answering "
                    r"\(lost peer\) after step ", out.splitlines()[-1]), out[-3000:]
    print(f"process 0 exited {second['code']} {second['stopped_after']:.1f} s after process 1 "
          "was killed")


# Slows one process down by a second as it compares the configs (its yaml.safe_load there).
LAG_IN_THE_COMPARISON = """
import sys, time, yaml
_load = yaml.safe_load
def _slow_load(*args, **kwargs):
    if sys._getframe(1).f_back.f_code.co_name == "check_same_config":
        time.sleep(1)
    return _load(*args, **kwargs)
yaml.safe_load = _slow_load
"""


@pytest.mark.parametrize("late", [None, 0, 1])
def test_processes_given_different_configs_stop_at_once_in_one_line(tmp_path, late):
    """train.steps=6 on one process and 8 on the other: both hung after step 6 for ever (the
    final checkpoint never written); model.num_layers 2 against 1 aborted both (134) in a
    mismatched collective. Now each says so in one line after joining, exit 2, nothing trained,
    also when one process gets there a second after the other (leaving without the others, the
    first aborted the late one from C++: 134 and a stack)."""
    run_dir, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    lag = None
    if late is not None:
        lag = {late: tmp_path / "lag"}
        lag[late].mkdir()
        (lag[late] / "sitecustomize.py").write_text(LAG_IN_THE_COMPARISON)
    procs = start_processes(run_dir, logs, "differ", pythonpath=lag,
                            own={0: ["train.steps=6"], 1: ["train.steps=8"]})
    try:
        codes = wait_processes(procs, timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = [(logs / f"differ-{i}.txt").read_text() for i in range(PROCESSES)]
    fix = "; give every process the same --config files and overrides"
    assert codes == [2, 2], out
    assert out[0].splitlines()[-1] == ("launch.py: error: this process (0) was given another "
                                       "config than process 1: train.steps=6 here, 8 on process "
                                       f"1{fix}"), out[0]
    assert out[1].splitlines()[-1] == ("launch.py: error: this process (1) was given another "
                                       "config than process 0: train.steps=8 here, 6 on process "
                                       f"0{fix}"), out[1]
    assert not (run_dir / "checkpoints").exists() and "Traceback" not in out[0] + out[1]


@pytest.mark.parametrize("wait, message", [
    ("4", "2 processes at 127.0.0.1:{port} did not all join within 4 s; start every process with "
          "the same --coordinator and --num-processes and its own --process-id (0 to N-1), or "
          "wait longer with JAXTRON_JOIN_TIMEOUT_S"),
    ("soon", "JAXTRON_JOIN_TIMEOUT_S=soon must be a number of seconds above 0"),
])
def test_a_process_left_alone_says_so_in_one_line(tmp_path, wait, message):
    """Process 1 never started (or two given --process-id 0): process 0 waited 300 s, then JAX
    aborted it from C++ (134, a stack, 'another task died'); now one line when the wait ends."""
    port = free_port()
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", "2", "--process-id", "0", *MULTIPROCESS_OVERRIDES,
         f"run.dir={tmp_path / 'run'}"],
        cwd=ROOT, env={**multiprocess_env(), "JAXTRON_JOIN_TIMEOUT_S": wait}, capture_output=True,
        text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert proc.stderr.splitlines() == [f"launch.py: error: {message.format(port=port)}"]
    assert time.monotonic() - started < 60 and not (tmp_path / "run").exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_while_the_processes_join_stops_at_once(tmp_path, sig):
    """JAX waits for the other processes in C++, where no Python handler runs: SIGTERM (timeout,
    a scheduler) and Ctrl-C did nothing until JAX's own timeout aborted it, minutes later."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "launch.py"), "--coordinator", f"127.0.0.1:{port}",
         "--num-processes", "2", "--process-id", "0", *MULTIPROCESS_OVERRIDES,
         f"run.dir={tmp_path / 'run'}"],
        cwd=ROOT, env=multiprocess_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while proc.poll() is None and time.monotonic() < deadline:
            try:  # the coordination service is up: the process waits in C++ for the other
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        time.sleep(0.5)  # from starting the service to its own client's wait: Python lines
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert (proc.returncode, err) == (75, "launch.py: stopped by a signal while the processes "
                                          "joined (nothing to save); run the same command to "
                                          "start\n")


FULL_DISK = """
import errno
import orbax.checkpoint as ocp

def _no_space(self, step, *args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device", str(self.directory))

ocp.CheckpointManager.save = _no_space
"""


def test_a_save_that_fails_on_one_process_ends_both(tmp_path):
    """Process 1 cannot write its part of checkpoint 2 (its disk is full): it stops with status 4
    and one line (it was held 30 s at jax.distributed's shutdown barrier, then aborted with -6
    and a C++ stack); process 0, left waiting for it, stops with 4 too, naming the checkpoint;
    no checkpoint 2 is listed."""
    run_dir, logs, patched = tmp_path / "run", tmp_path / "logs", tmp_path / "site"
    logs.mkdir()
    patched.mkdir()
    (patched / "sitecustomize.py").write_text(FULL_DISK)
    procs = start_processes(run_dir, logs, "save", "train.steps=3", pythonpath={1: patched})
    try:
        codes = wait_processes(procs, timeout=400 + DEAD_PEER_LIMIT_S)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    out = [(logs / f"save-{i}.txt").read_text() for i in range(PROCESSES)]
    assert codes[1] == 4, out[1][-3000:]
    errors = [line for line in out[1].splitlines() if "error" in line.lower()]
    assert errors == ["launch.py: error: checkpoint 2 was not saved: no space left on device "
                      f"({run_dir / 'checkpoints'})"], out[1][-3000:]
    assert codes[0] == 4 and "done:" not in out[0], out[0][-3000:]  # its save's barrier failed
    assert out[0].splitlines()[-1].startswith("launch.py: error: checkpoint 2 was not saved: ")
    assert not (run_dir / "checkpoints" / "2").exists()


@pytest.fixture
def no_joining(monkeypatch):
    """No cluster in the environment, and jax.distributed.initialize fails the test if called."""
    for var in list(os.environ):
        if var.startswith(("SLURM_", "OMPI_")):
            monkeypatch.delenv(var)

    def initialize(*args, **kwargs):
        raise AssertionError("jax.distributed.initialize was called")

    monkeypatch.setattr(jax.distributed, "initialize", initialize)
    return monkeypatch


BAD_FLAGS = [
    (["--coordinator", "127.0.0.1:1234"], "--num-processes, --process-id missing"),
    (["--num-processes", "2", "--process-id", "0"], "--coordinator missing"),
    (["--coordinator", "localhost", "--num-processes", "2", "--process-id", "0"],
     "--coordinator=localhost is not HOST:PORT"),
    (["--coordinator", "localhost:99999", "--num-processes", "2", "--process-id", "0"],
     "is not HOST:PORT"),
    (["--coordinator", "[::1]:1234", "--num-processes", "2", "--process-id", "2"],
     "--process-id=2 must be in 0..1"),
    (["--coordinator", "a:1", "--num-processes", "0", "--process-id", "0"], "at least 1"),
    (["--num-processes", "two"], "invalid int value"),
]


@pytest.mark.parametrize("args,message", BAD_FLAGS, ids=[" ".join(a) for a, _ in BAD_FLAGS])
@pytest.mark.parametrize("mode", [[], ["--dry-run"]])
def test_bad_process_flags_are_one_line_and_status_2(no_joining, capsys, args, message, mode):
    """The dry run refuses them as the run does (it said nothing of them, exit 0)."""
    try:
        rc = launch.main([*args, *mode, "train.steps=1"])
    except SystemExit as e:  # argparse
        rc = e.code
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and message in err, err


def test_cluster_environments(no_joining):
    assert distributed.cluster_processes() == ("", 1, 0)
    distributed.initialize(None, None, None)  # one process: nothing to join
    slurm = {"SLURM_JOB_ID": "7", "SLURM_STEP_NODELIST": "node[01-02]", "SLURM_LOCALID": "1",
             "SLURM_PROCID": "3", "SLURM_NTASKS": "1"}
    for var, value in slurm.items():
        no_joining.setenv(var, value)
    assert distributed.cluster_processes() == ("", 1, 0)  # one task: single process
    no_joining.setenv("SLURM_NTASKS", "8")
    assert distributed.cluster_processes() == ("Slurm", 8, 3)
    no_joining.delenv("SLURM_STEP_NODELIST")  # an sbatch script that forgot srun
    with pytest.raises(config.ConfigError, match="SLURM_STEP_NODELIST unset.*srun"):
        distributed.cluster_processes()
    for var in slurm:
        no_joining.delenv(var, raising=False)
    no_joining.setenv("OMPI_COMM_WORLD_SIZE", "2")
    no_joining.setenv("OMPI_COMM_WORLD_RANK", "1")
    with pytest.raises(config.ConfigError, match="OMPI_MCA_orte_hnp_uri unset"):
        distributed.cluster_processes()
    no_joining.setenv("OMPI_MCA_orte_hnp_uri", "1531576320.0;tcp://10.0.0.1:34911")
    assert distributed.cluster_processes() == ("Open MPI", 2, 1)


def test_dry_run_never_joins(no_joining, capsys):
    rc = launch.main(["--dry-run", "--coordinator", "127.0.0.1:1", "--num-processes", "2",
                      "--process-id", "1"])
    assert rc == 0 and "parameters: 7,342,336" in capsys.readouterr().out
