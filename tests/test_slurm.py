"""scripts/slurm/train.sbatch's restart loop, with srun, scontrol and sleep replaced by stubs that
record their arguments: a crash restarts from the checkpoint, a preemption (75) requeues the job,
a lost host (75, and its name in RUN_DIR/bad_hosts) restarts the run inside the allocation on a
spare, and requeues only when too few nodes are left; bad input (2) and a non-finite stop (3) end
it, and every process gets the shared run directory and the compile cache."""

import dataclasses
import os
import subprocess
from pathlib import Path

import pytest
from helpers import assert_refused

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm" / "train.sbatch"
LOST = "process 1 stopped answering"  # a supervisor's reason in bad_hosts


@dataclasses.dataclass
class Ran:
    status: int
    out: list[str]  # the script's stdout lines
    err: str
    sruns: list[str]  # each srun's arguments
    scontrols: list[str]
    sleeps: list[str]


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def _run(tmp_path: Path, attempts: list, *extra_env, nodes: int = 2,
         args: tuple[str, ...] = ("--config", "tiny", "mesh.fsdp=8")) -> Ran:
    """Run the script in an allocation of node1..node<nodes>, srun ending each attempt as
    `attempts` say in turn: a status, or (status, host) to add host to RUN_DIR/bad_hosts first,
    as a supervisor does when that host's process was lost."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "attempts").write_text(
        "".join(f"{a}\n" if isinstance(a, int) else f"{a[0]} {a[1]}\n" for a in attempts))
    bad = tmp_path / "runs" / "job" / "bad_hosts"
    _stub(bin_dir, "srun", f'echo "$*" >> {tmp_path}/srun.log\n'
          f'echo "$no_proxy $NO_PROXY" > {tmp_path}/proxy.log\n'
          f'read -r status host < {tmp_path}/attempts; sed -i 1d {tmp_path}/attempts\n'
          f'[[ -n "$host" ]] && printf "%s\\t{LOST}\\n" "$host" >> {bad}\n'
          'exit $status\n')
    hostnames = "\\n".join(f"node{i}" for i in range(1, nodes + 1))
    _stub(bin_dir, "scontrol", f'echo "$*" >> {tmp_path}/scontrol.log\n'
          f'[[ "$1 $2" == "show hostnames" ]] && printf "{hostnames}\\n"; exit 0\n')
    _stub(bin_dir, "sleep", f'echo "$*" >> {tmp_path}/sleep.log\n')
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "activate").write_text("")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(tmp_path),
           "SLURM_JOB_NAME": "job", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": f"node[1-{nodes}]",
           "SLURM_JOB_NUM_NODES": str(nodes), "VENV": str(tmp_path / "venv"),
           "HOME": str(tmp_path), **dict(extra_env)}
    proc = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, timeout=60, check=False)
    read = lambda name: ((tmp_path / name).read_text().splitlines()
                         if (tmp_path / name).exists() else [])
    return Ran(proc.returncode, proc.stdout.splitlines(), proc.stderr, read("srun.log"),
               read("scontrol.log"), read("sleep.log"))


def _srun(tmp_path: Path, nodes: str, tasks: str = "--ntasks-per-node=1",
          args: str = "--config tiny mesh.fsdp=8") -> str:
    """The srun command line of an attempt on `nodes` (comma-separated)."""
    run_dir = tmp_path / "runs" / "job"
    return (f"{tasks} --nodes={nodes.count(',') + 1} --nodelist={nodes} --kill-on-bad-exit=1 "
            f"{tmp_path}/venv/bin/jaxtron train run.compile_cache={run_dir}/compile_cache {args} "
            f"run.dir={run_dir} run.progress=lines")


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0


def test_a_crash_restarts_and_a_preemption_requeues(tmp_path):
    """Two crashes restart on the same nodes after 60 s each; a 75 that names no lost host
    (a preemption, the time limit) requeues the job, as a restart may not outlive it."""
    ran = _run(tmp_path, [1, 134, 75])
    assert ran.status == 0 and ran.sruns == [_srun(tmp_path, "node1,node2")] * 3
    assert ran.sleeps == ["60", "60"]
    assert ran.scontrols == ["show hostnames node[1-2]", "requeue 42"]
    assert ran.out[-1].startswith("jaxtron: stopped restartably (preempted")


@pytest.mark.parametrize("stop", [75, 134])
def test_a_lost_host_is_replaced_by_the_spare_inside_the_allocation(tmp_path, stop):
    """node2's process was lost (a supervisor wrote node2 into bad_hosts): the run restarts on
    node1 and node3, the spare, without requeueing; at once after a 75, in 60 s after a crash."""
    ran = _run(tmp_path, [(stop, "node2"), 0], ("TRAIN_NODES", "2"), nodes=3)
    assert ran.status == 0
    assert ran.sruns == [_srun(tmp_path, "node1,node2"), _srun(tmp_path, "node1,node3")]
    assert ran.scontrols == ["show hostnames node[1-3]"]  # no requeue
    why, when = ("a host failed", "now") if stop == 75 else (f"exit status {stop}", "in 60 s")
    assert ran.sleeps == ([] if stop == 75 else ["60"])
    assert ran.out == [f"jaxtron: {why} (restart 1 of 3): restarting {when} inside the allocation, "
                       f"without node2 (in {tmp_path}/runs/job/bad_hosts), from the newest "
                       "checkpoint", "jaxtron: done"]


@pytest.mark.parametrize("spares,excluded", [(0, "node2"), (1, "node2 node3")])
def test_too_few_healthy_nodes_requeue(tmp_path, spares, excluded):
    """Without a spare, the first lost host requeues the job; with one, the second does (the
    first restart ran on the spare)."""
    attempts = [(75, "node2"), (75, "node3"), 0][:spares + 1]
    ran = _run(tmp_path, attempts, ("TRAIN_NODES", "2"), nodes=2 + spares)
    assert ran.status == 0
    sruns = [_srun(tmp_path, "node1,node2"), _srun(tmp_path, "node1,node3")]
    assert ran.sruns == sruns[:spares + 1]
    assert ran.scontrols == [f"show hostnames node[1-{2 + spares}]", "requeue 42"]
    assert ran.out[-1] == (f"jaxtron: 1 of {2 + spares} nodes left without {excluded} "
                           f"({tmp_path}/runs/job/bad_hosts), fewer than TRAIN_NODES=2; "
                           "requeueing 42 for a fresh allocation")


def test_a_lost_host_after_the_last_restart_requeues(tmp_path):
    """Healthy nodes are left (node3, node4) but MAX_RESTARTS is spent: a 75 requeues, where a
    crash would give up."""
    ran = _run(tmp_path, [(75, "node2"), (75, "node1"), 0], ("TRAIN_NODES", "2"),
               ("MAX_RESTARTS", "1"), nodes=4)
    assert ran.status == 0
    assert ran.sruns == [_srun(tmp_path, "node1,node2"), _srun(tmp_path, "node1,node3")]
    assert ran.scontrols == ["show hostnames node[1-4]", "requeue 42"]
    assert ran.out[-1] == ("jaxtron: a host failed and no restarts are left (MAX_RESTARTS=1); "
                           "requeueing 42")


def test_the_first_attempt_prefers_healthy_hosts_but_starts_anyway(tmp_path):
    """bad_hosts from an earlier allocation names node1 and node3.cluster (node3 by its short
    name): the run takes node2, the only healthy one, and node1 to start, rather than requeue
    onto the same nodes again and again."""
    run_dir = tmp_path / "runs" / "job"
    run_dir.mkdir(parents=True)
    (run_dir / "bad_hosts").write_text(f"node1\t{LOST}\nnode3.cluster\t{LOST}\n")
    ran = _run(tmp_path, [0], ("TRAIN_NODES", "2"), nodes=3)
    assert ran.status == 0 and ran.sruns == [_srun(tmp_path, "node2,node1")]
    assert ran.out == [f"jaxtron: {run_dir}/bad_hosts names node1, but too few other nodes are in "
                       "the allocation: starting on them", "jaxtron: done"]


def test_the_compile_cache_is_on_and_an_override_wins(tmp_path):
    """Each attempt passes run.compile_cache=RUN_DIR/compile_cache before the script's arguments,
    so a restart loads the compiled step; the config takes the last override, so one in the
    arguments wins (read back by the real config loader)."""
    from jaxtron import config

    ran = _run(tmp_path, [0], args=("--config", "tiny", "run.compile_cache=/elsewhere"))
    assert ran.sruns == [_srun(tmp_path, "node1,node2", args="--config tiny "
                                                             "run.compile_cache=/elsewhere")]
    overrides = ran.sruns[0].split(" train ")[1].replace("--config tiny ", "").split()
    assert config.load(["tiny"], overrides).run.compile_cache == "/elsewhere"
    assert config.load(["tiny"], [overrides[0], *overrides[2:]]).run.compile_cache == \
        f"{tmp_path}/runs/job/compile_cache"


def test_local_dir_turns_the_local_tier_on(tmp_path):
    """LOCAL_DIR passes checkpoint.local_dir (single-quoted: `$VARS` in it reach the run, which
    expands them on each host) before the script's arguments; unset, nothing is passed."""
    ran = _run(tmp_path, [0], ("LOCAL_DIR", "/local/$SLURM_JOB_ID"))
    assert ran.sruns == [_srun(tmp_path, "node1,node2").replace(
        "/compile_cache --config", "/compile_cache checkpoint.local_dir=/local/$SLURM_JOB_ID "
        "--config")]


@pytest.mark.parametrize("stop", [2, 3, 4])
def test_bad_input_and_nonfinite_stops_are_not_retried(tmp_path, stop):
    ran = _run(tmp_path, [(stop, "node2"), 0], nodes=3)  # a lost host changes nothing
    assert ran.status == stop and len(ran.sruns) == 1 and ran.sleeps == []
    assert ran.scontrols == ["show hostnames node[1-3]"]


def test_restarts_are_bounded_and_one_task_per_gpu_on_request(tmp_path):
    ran = _run(tmp_path, [1] * 10, ("MAX_RESTARTS", "2"), ("PER_GPU", "1"))
    assert ran.status == 1
    per_gpu = "--ntasks-per-node=8 --gpus-per-task=1"
    assert ran.sruns == [_srun(tmp_path, "node1,node2", per_gpu)] * 3
    assert ran.out[-1] == "jaxtron: exit status 1; gave up after 2 restarts"


def test_more_train_nodes_than_the_allocation_is_refused(tmp_path):
    ran = _run(tmp_path, [0], ("TRAIN_NODES", "3"))
    assert_refused(ran.status, ran.err, "TRAIN_NODES=3", "1 to 2")
    assert ran.sruns == [] and ran.out == []


def test_the_coordinator_stays_off_proxies(tmp_path):
    """The nodes' names join no_proxy (and NO_PROXY) in the environment srun passes on, so gRPC
    never sends the coordinator's traffic to a proxy."""
    ran = _run(tmp_path, [0], ("no_proxy", "localhost"))
    assert ran.status == 0 and len(ran.sruns) == 1
    assert (tmp_path / "proxy.log").read_text().split() == ["localhost,node1,node2"] * 2


def test_without_slurm_it_says_so_in_one_line_and_starts_nothing(tmp_path):
    """`bash train.sbatch` outside a job died on `SLURM_SUBMIT_DIR: unbound variable`; now one
    line names sbatch and the local command, and nothing is started or written."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _stub(bin_dir, "srun", f"touch {tmp_path}/srun-called\n")
    env = {key: value for key, value in os.environ.items() if not key.startswith("SLURM_")}
    proc = subprocess.run(["bash", str(SCRIPT), "--config", "tiny", "mesh.fsdp=8"],
                          env={**env, "PATH": f"{bin_dir}:{env['PATH']}"}, cwd=tmp_path,
                          capture_output=True, text=True, timeout=60, check=False)
    assert_refused(proc.returncode, proc.stderr, "sbatch --nodes=N scripts/slurm/train.sbatch",
                   "jaxtron train --config tiny mesh.fsdp=8")
    assert proc.stdout == "" and sorted(p.name for p in tmp_path.iterdir()) == ["bin"]
