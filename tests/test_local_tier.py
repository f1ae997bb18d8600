"""The local checkpoint tier across hosts (jaxtron/train/local_tier.py, local_files.py,
local_peers.py) and stragglers named (jaxtron/train/stragglers.py).

Four launch.py processes stand for two hosts (JAXTRON_HOST=a for processes 0 and 1, b for 2
and 3), each host with its own local directory (checkpoint.local_dir=$LOCAL, set per host), on
a data 2 x fsdp 2 x tensor 2 mesh of 8 CPU devices; the local tier every 5 steps, the persistent
one every 50. The reference run trains 55 steps. The second run, host b's input slowed (a sleep
per batch), names b a straggler within three reports, and loses host b after step 37 (its
processes killed, its local directory wiped: a replaced node); the rerun resumes from local step
35 with b's shards from host a's copies, and its losses equal the reference's bit for bit. It
loses host b again after step 52; with both hosts' local directories wiped, the last rerun
resumes from the persistent step 50, saying so in one line, and its goodput summary counts 2
steps redone for each failure.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from helpers import assert_refused, free_port, metrics_rows, multiprocess_env, run_launch

from jaxtron.train import local_files, local_peers, stragglers
from jaxtron.train import local_tier as local

ROOT = Path(__file__).resolve().parent.parent
HOSTS = {0: "a", 1: "a", 2: "b", 3: "b"}
STEPS = 55
OVERRIDES = ["train.log_every=1", "train.seq_len=64", "train.batch_size=8", "train.eval_every=0",
             "model.num_layers=2", "optim.warmup_steps=2", "optim.decay_steps=100",
             f"train.steps={STEPS}", "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2",
             "checkpoint.every=50", "checkpoint.local_dir=$LOCAL", "checkpoint.local_every=5",
             "run.straggler_every=5", "run.tensorboard=false", "run.progress=lines",
             "run.peer_timeout_s=20"]
# In host b's training processes: leave at the start of step `step` (after the one before
# it finished everywhere), the supervisor with it, as a node that goes down.
KILL_AT = """
import os, signal
from jaxtron.train import watchdog
_tick = watchdog.Watchdog.tick
def _tick_or_die(self, doing):
    if os.environ.get("JAXTRON_SUPERVISOR") and doing == "training step {step}":
        os.kill(os.getppid(), signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)
    return _tick(self, doing)
watchdog.Watchdog.tick = _tick_or_die
"""
SLOW_INPUT = """
import time
from jaxtron.data import pipeline
_next = pipeline.BatchIterator.__next__
def _slow_next(self):
    time.sleep(0.4)
    return _next(self)
pipeline.BatchIterator.__next__ = _slow_next
"""


def _run(tmp_path: Path, name: str, hook: str = "") -> list[int]:
    """The four processes of the run in tmp_path/run, each host's local_dir in
    tmp_path/local-<host>; host b's processes import `hook` first."""
    port, procs = free_port(), []
    hook_dir = tmp_path / f"hook-{name}"
    hook_dir.mkdir()
    (hook_dir / "sitecustomize.py").write_text(hook)
    for i, host in HOSTS.items():
        env = multiprocess_env()
        env.update(JAX_NUM_CPU_DEVICES="2", JAXTRON_HOST=host, LOCAL=str(tmp_path / f"local-{host}"))
        if host == "b" and hook:
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(hook_dir),
                                                              env.get("PYTHONPATH")]))
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "launch.py"), "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", "4", "--process-id", str(i), *OVERRIDES,
             f"run.dir={tmp_path / 'run'}"],
            cwd=ROOT, env=env, stdout=(tmp_path / f"{name}-{i}.txt").open("w"),
            stderr=subprocess.STDOUT, start_new_session=True))
    try:
        return [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)


def _out(tmp_path: Path, name: str, i: int = 0) -> str:
    return (tmp_path / f"{name}-{i}.txt").read_text()


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in metrics_rows(run_dir)}


def test_a_slow_host_is_named_and_a_lost_host_resumes_from_its_peers_copy(tmp_path):
    """The reference, then the run that loses host b (its input slowed meanwhile), the rerun from
    its peer's copy, and the rerun from the persistent tier (the module's docstring)."""
    reference = tmp_path / "reference"
    reference.mkdir()
    assert _run(reference, "ref") == [0] * 4, _out(reference, "ref")
    expected = _losses(reference / "run")
    run_dir = tmp_path / "run"

    statuses = _run(tmp_path, "lost", SLOW_INPUT + KILL_AT.format(step=38))
    assert statuses[2:] == [-signal.SIGKILL] * 2 and statuses[:2] == [75, 75], statuses
    out = _out(tmp_path, "lost")
    named = [line for line in out.splitlines() if "straggler: host b " in line]
    assert named and named[0].endswith(("steps 1-5", "steps 6-10", "steps 11-15")), out
    assert "(processes 2, 3; devices 4096, 4097, 6144, 6145) waited 0.4" in named[0]
    assert not any("straggler: host a " in line for line in out.splitlines())
    assert sorted(p.name for p in (tmp_path / "local-b").rglob("process_*")) == [
        "process_0", "process_0", "process_1", "process_1", "process_2", "process_2",
        "process_3", "process_3"]  # steps 30 and 35: own files and host a's copies
    shutil.rmtree(tmp_path / "local-b")  # a replaced node: its disk is new

    statuses = _run(tmp_path, "rerun", KILL_AT.format(step=53))
    assert statuses[:2] == [75, 75], _out(tmp_path, "rerun")
    out = _out(tmp_path, "rerun")
    assert ("resumed from local checkpoint 35 in checkpoint.local_dir (processes 2, 3 took their "
            "shards from a peer's copy)") in out
    losses = _losses(run_dir)
    assert [losses[s] for s in range(36, 53)] == [expected[s] for s in range(36, 53)]
    records = json.loads((run_dir / "goodput.json").read_text())
    assert records[0]["last_step"] == 37 and records[1]["resumed_from"] == 35
    assert records[0]["stragglers"]["b"] >= 1

    shutil.rmtree(tmp_path / "local-a")
    shutil.rmtree(tmp_path / "local-b", ignore_errors=True)
    statuses = _run(tmp_path, "persistent")
    out = _out(tmp_path, "persistent")
    assert statuses == [0] * 4, out
    said = [line for line in out.splitlines() if "resuming from the persistent tier" in line]
    assert len(said) == 1 and said[0].endswith(
        "no local checkpoint on any host; resuming from the persistent tier (step 50)"), said
    assert "resumed from" in out and "step 50" in out
    failures = [line.split(" ", 1)[1] for line in out.splitlines() if "failure after" in line]
    assert [f.split(":")[0] + ":" + f.rsplit(":", 1)[1] for f in failures] == [
        "failure after step 37 (killed): 2 steps redone",
        "failure after step 52 (killed): 2 steps redone"], failures
    losses = _losses(run_dir)
    assert [losses[s] for s in range(51, STEPS + 1)] == [expected[s]
                                                        for s in range(51, STEPS + 1)]


# ------------------------------------------------------------------ in one process
def test_each_process_is_copied_to_the_same_rank_on_the_next_host():
    assert local_peers.peers(("a", "a", "b", "b")) == [2, 3, 0, 1]
    assert local_peers.peers(("a", "b", "c")) == [1, 2, 0]
    assert local_peers.peers(("a", "a")) == [None, None]


def test_a_host_is_named_by_its_slowest_process_against_the_median():
    nodes = ("a", "a", "b", "b", "c", "c")
    probes = [1.0] * 6
    verdict = stragglers.judge([0.01, 0.02, 0.30, 0.01, 0.02, 0.01], probes, nodes, 1.0, 0.2,
                               1, 5)
    assert (verdict.host, verdict.processes, verdict.named) == ("b", [2, 3], True)
    assert verdict.median_wait_s == pytest.approx(0.02)  # of a and c
    calm = stragglers.judge([0.01, 0.02, 0.15, 0.01, 0.02, 0.01], probes, nodes, 1.0, 0.2, 1, 5)
    assert not calm.named  # 0.13 s above the median: under a fifth of a 1 s step
    slow_gpu = stragglers.judge([0.01] * 6, [1.0, 1.0, 1.0, 1.0, 1.3, 1.0], nodes, 1.0, 0.2,
                                1, 5)
    assert (slow_gpu.host, slow_gpu.named, slow_gpu.probe) == ("c", True, pytest.approx(1.3))
    assert not stragglers.judge([0.01] * 6, [1.0, 1.0, 1.0, 1.0, 1.15, 1.0], nodes, 1.0, 0.2,
                                1, 5).named


def test_a_local_file_reads_back_exactly_and_its_damage_is_found(tmp_path):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec

    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    shardings = {"w": NamedSharding(mesh, PartitionSpec("x")),
                 "b": NamedSharding(mesh, PartitionSpec())}
    state = {"w": jax.device_put(jnp.arange(64, dtype=jnp.bfloat16) / 7, shardings["w"]),
             "b": jax.device_put(jnp.float32(3.5), shardings["b"])}
    abstract = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), state)
    payload = local_files.gather(5, 0, state, {"consumed": 3}, {"step": 5}, "print")
    payload.seal()
    path = tmp_path / "5" / "process_0"
    local_files.write(path, payload.chunks())
    assert local_files.read_header(path)["fingerprint"] == "print"
    restored, data, meta = local_files.load(path, abstract, shardings)
    assert (data, meta) == ({"consumed": 3}, {"step": 5})
    for key in state:
        assert restored[key].sharding == shardings[key]
        np.testing.assert_array_equal(np.asarray(restored[key]), np.asarray(state[key]))
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 1
    path.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="fails its checksum"):
        local_files.load(path, abstract, shardings)
    path.write_bytes(bytes(raw[:-1]))  # cut short: not a whole file
    assert local_files.read_header(path) is None


def test_each_fallback_to_the_persistent_tier_is_one_line_saying_why():
    """A step whose shards one process lacks everywhere (two adjacent hosts lost), local files of
    another process count, none at all, and a persistent checkpoint newer than the local one."""
    holders = {(35, 0): [0], (35, 1): [0, 1]}  # process 2's file of step 35 is on no host
    assert local._fallback_line([35], None, [], holders, set(), 3, 20) == (
        "local checkpoint 35 lacks process 2's shards on every host (a host and the peer that "
        "kept its copy were both lost); resuming from the persistent tier (step 20)")
    assert local._fallback_line([35], None, [], {}, {(35, 4)}, 2, None) == (
        "local checkpoint 35 was saved by 4 processes and this run has 2 processes in its own "
        "layout; resuming from the persistent tier (none yet: starting from scratch)")
    assert local._fallback_line([], None, [], {}, set(), 2, 50) == (
        "checkpoint.local_dir: no local checkpoint on any host; resuming from the persistent "
        "tier (step 50)")
    assert local._fallback_line([], None, [], {}, set(), 2, None) is None  # a fresh run
    complete = {(35, 0): [0], (35, 1): [1]}
    assert local._fallback_line([35], 35, [35], complete, set(), 2, 50).startswith(
        "local checkpoint 35 is older than the persistent tier's")


def test_a_local_dir_that_cannot_be_written_is_one_line_before_any_step(tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    done = run_launch("--config", "configs/tiny.yaml", "train.steps=2", "model.num_layers=1",
                      f"run.dir={tmp_path / 'run'}", f"checkpoint.local_dir={blocked}/local",
                      env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""})
    assert_refused(done.returncode, done.stderr, f"checkpoint.local_dir={blocked}/local cannot be "
                   "written on host", "Not a directory")
    assert "step " not in done.stdout and not (tmp_path / "run").exists()


def test_a_straggler_stop_waits_for_the_saves_lists_the_host_and_ends_restartably(tmp_path):
    """run.on_straggler=stop: the step's saves are waited for, the host goes into
    run.dir/bad_hosts (the Slurm script leaves it out) and the run ends as a preemption (75)."""
    from types import SimpleNamespace

    from jaxtron.train import bad_hosts
    from jaxtron.train import loop as loop_lib
    from jaxtron.train.metrics import Stopwatch

    waited = []
    run = SimpleNamespace(watch=Stopwatch(), log=SimpleNamespace(is_main=True),
                          ckpt=SimpleNamespace(wait=lambda: waited.append("persistent")),
                          local=SimpleNamespace(wait=lambda: waited.append("local")))
    cfg = SimpleNamespace(run=SimpleNamespace(dir=str(tmp_path)))
    verdict = stragglers.judge([0.01, 0.01, 0.5, 0.5], [0.0] * 4, ("a", "a", "b", "b"), 1.0, 0.2,
                               6, 10)
    with pytest.raises(loop_lib.StragglerStop) as stopped:
        loop_lib._leave_out(cfg, run, 10, verdict)
    assert isinstance(stopped.value, loop_lib.Preempted)  # jaxtron train: exit status 75
    assert str(stopped.value) == (
        f"host b straggled at step 10 (input wait 0.490 s of each 1.000 s step above the other "
        f"hosts' median; run.on_straggler=stop), listed in {tmp_path}/bad_hosts")
    assert waited == ["persistent", "local"] and bad_hosts.read(tmp_path) == ["b"]


def test_the_lost_peer_line_names_a_newer_local_checkpoint_on_this_host(tmp_path):
    from jaxtron.train import supervisor

    run_dir = tmp_path / "run"
    (run_dir / "checkpoints" / "50").mkdir(parents=True)
    (run_dir / "config.yaml").write_text(f"checkpoint:\n  local_dir: {tmp_path}/local\n")
    here = local.root(f"{tmp_path}/local", run_dir)
    (here / "55").mkdir(parents=True)
    (here / "55" / "process_1").write_bytes(b"")
    line = supervisor._lost_line(1, 2, run_dir, "node7")
    assert line.endswith("and this host holds local checkpoint 55 (checkpoint.local_dir): rerun "
                         "the same command to resume from the newest one every host can read")


def test_a_local_dir_without_room_for_the_tier_is_refused_at_start(tmp_path, monkeypatch):
    """local_keep + 1 saves of the host's shards must fit, or the start stops in one line (a
    ConfigError: exit 2) before any step, instead of a save failing mid-run."""
    from types import SimpleNamespace

    import jax
    from jax.sharding import NamedSharding, PartitionSpec

    from jaxtron.config import CheckpointConfig, ConfigError

    mesh = jax.make_mesh((len(jax.devices()),), ("x",))
    shardings = {"w": NamedSharding(mesh, PartitionSpec("x"))}
    abstract = {"w": jax.ShapeDtypeStruct((1024,), np.float32)}  # 4 KiB, 8 places
    tier = local.LocalTier(CheckpointConfig(local_dir=str(tmp_path / "local"), local_keep=2),
                           tmp_path / "run", ("h",), print)
    try:
        usage = SimpleNamespace(free=3 * 4096 - 1)
        monkeypatch.setattr(local.shutil, "disk_usage", lambda where: usage)
        with pytest.raises(ConfigError, match=r"checkpoint.local_dir on host h \(process 0\) has "
                                              r".* less than the local tier needs"):
            tier.restore(abstract, shardings, None, print)
        usage.free = 3 * 4096
        assert tier.restore(abstract, shardings, None, print) is None  # nothing saved yet
    finally:
        tier.close()


def test_a_local_save_that_fails_in_the_background_stops_the_loop_in_one_line(tmp_path,
                                                                             monkeypatch):
    """The writer thread's failure (any error, not only the disk's) is raised by the loop's next
    check as a CheckpointSaveError (exit 4), and the writer goes on serving later saves."""
    import jax.numpy as jnp

    from jaxtron.checkpoint import CheckpointSaveError
    from jaxtron.config import CheckpointConfig

    tier = local.LocalTier(CheckpointConfig(local_dir=str(tmp_path / "local")), tmp_path / "run",
                           ("h",), print)
    state = {"w": jnp.arange(8.0)}
    try:
        def broken(self):
            raise ValueError("garbled")

        with monkeypatch.context() as patch:
            patch.setattr(local_files.Payload, "seal", broken)
            tier.save(10, state, {}, {})
            with pytest.raises(CheckpointSaveError, match="^local checkpoint 10 was not saved: "
                                                          "garbled$"):
                tier.wait()
        tier.save(20, state, {}, {})
        tier.wait()
        assert local_files.read_header(tier.root / "20" / "process_0")["step"] == 20
    finally:
        tier.close()
