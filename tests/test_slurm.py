"""scripts/slurm/train.sbatch's restart loop, with srun and scontrol replaced by stubs that record
their arguments: a crash restarts from the checkpoint, a preemption (75) requeues the job, bad
input (2) and a non-finite stop (3) end it, and every process gets the shared run directory."""

import os
import subprocess
from pathlib import Path

import pytest
from helpers import assert_refused

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "slurm" / "train.sbatch"


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + body)
    path.chmod(0o755)


def _run(tmp_path: Path, statuses: list[int], *extra_env) -> tuple[int, list[str], list[str]]:
    """Run the script with srun exiting with `statuses` in turn; (status, srun calls,
    scontrol calls)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "statuses").write_text("\n".join(map(str, statuses)) + "\n")
    _stub(bin_dir, "srun", f'echo "$*" >> {tmp_path}/srun.log\n'
          f'echo "$no_proxy $NO_PROXY" > {tmp_path}/proxy.log\n'
          f'status=$(head -1 {tmp_path}/statuses); sed -i 1d {tmp_path}/statuses; exit $status\n')
    _stub(bin_dir, "scontrol", f'echo "$*" >> {tmp_path}/scontrol.log\n'
          '[[ "$1 $2" == "show hostnames" ]] && printf "node1\\nnode2\\n"; exit 0\n')
    _stub(bin_dir, "sleep", "exit 0\n")
    venv = tmp_path / "venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "activate").write_text("")
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_SUBMIT_DIR": str(tmp_path),
           "SLURM_JOB_NAME": "job", "SLURM_JOB_ID": "42", "SLURM_JOB_NODELIST": "node[1-2]",
           "VENV": str(tmp_path / "venv"), "HOME": str(tmp_path), **dict(extra_env)}
    proc = subprocess.run(["bash", str(SCRIPT), "--config", "tiny", "mesh.fsdp=8"],
                          env=env, capture_output=True, text=True, timeout=60, check=False)
    read = lambda name: ((tmp_path / name).read_text().splitlines()
                         if (tmp_path / name).exists() else [])
    return proc.returncode, read("srun.log"), read("scontrol.log")


def test_the_script_parses():
    assert subprocess.run(["bash", "-n", str(SCRIPT)], check=False).returncode == 0


def test_a_crash_restarts_and_a_preemption_requeues(tmp_path):
    status, sruns, scontrols = _run(tmp_path, [1, 134, 75])
    assert status == 0 and len(sruns) == 3
    for call in sruns:
        assert call.endswith(f" {tmp_path}/venv/bin/jaxtron train --config tiny mesh.fsdp=8 "
                             f"run.dir={tmp_path}/runs/job run.progress=lines")
        assert "--ntasks-per-node=1" in call and "--kill-on-bad-exit=1" in call
    assert "requeue 42" in scontrols


@pytest.mark.parametrize("stop", [2, 3, 4])
def test_bad_input_and_nonfinite_stops_are_not_retried(tmp_path, stop):
    status, sruns, scontrols = _run(tmp_path, [stop, 0])
    assert status == stop and len(sruns) == 1 and "requeue 42" not in scontrols


def test_restarts_are_bounded_and_one_task_per_gpu_on_request(tmp_path):
    status, sruns, _ = _run(tmp_path, [1] * 10, ("MAX_RESTARTS", "2"), ("PER_GPU", "1"))
    assert status == 1 and len(sruns) == 3
    assert all("--ntasks-per-node=8 --gpus-per-task=1" in call for call in sruns)


def test_the_coordinator_stays_off_proxies(tmp_path):
    """The nodes' names join no_proxy (and NO_PROXY) in the environment srun passes on, so gRPC
    never sends the coordinator's traffic to a proxy."""
    status, sruns, _ = _run(tmp_path, [0], ("no_proxy", "localhost"))
    assert status == 0 and len(sruns) == 1
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
