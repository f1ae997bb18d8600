"""The preflight doctor: each set-up problem is found from a planted bad condition (a fake
environment, version table, host layout, disk or unshared run directory) and named with its fix; a
clean set-up gives none; tools/doctor.py and launch.py --strict stop on one with exit status 2 and
one line, plain launch.py warns and trains; two processes merge their problems."""

import collections
import os
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import assert_refused, free_port, multiprocess_env

import launch
from jaxtron import config as config_lib
from jaxtron.train import doctor
from jaxtron.train.doctor import Hosts

ROOT = Path(__file__).resolve().parent.parent
ONE_HOST = Hosts((8,), ("node0",))  # conftest's 8 CPU devices, as one host
VERSIONS = {"jax": "0.10.2", "jaxlib": "0.10.2", "jax-cuda12-plugin": "0.10.2",
            "jax-cuda12-pjrt": "0.10.2"}
JAX_NEEDS = "<=0.10.2,>=0.10.1"  # jax 0.10.2's own requirement on jaxlib (its package metadata)
# tiny: 7,342,336 float32 params, AdamW's mu and nu of the same size, and two int32 step counters
TINY_CHECKPOINT = 3 * 4 * 7_342_336 + 2 * 4
BLOCKING = ("CUDA_LAUNCH_BLOCKING=1 serialises every GPU kernel launch with the host (a debugging "
            "switch: steps run several times slower); unset CUDA_LAUNCH_BLOCKING")
PLATFORM = ("XLA_PYTHON_CLIENT_ALLOCATOR=platform makes every buffer a cudaMalloc and cudaFree (no "
            "pool: very slow); unset XLA_PYTHON_CLIENT_ALLOCATOR")
SMALL_RUN = ["train.steps=1", "train.seq_len=64", "train.eval_every=0", "run.tensorboard=false",
             "run.progress=lines"]


def _cfg(tmp_path: Path, *overrides: str) -> config_lib.Config:
    return config_lib.load([ROOT / "configs" / "tiny.yaml"], [f"run.dir={tmp_path / 'run'}",
                                                              *overrides])


def test_a_clean_set_up_has_no_problems(tmp_path):
    """Harmless values of every variable the checks read, and this machine's own installation."""
    environ = {"CUDA_LAUNCH_BLOCKING": "0", "XLA_PYTHON_CLIENT_PREALLOCATE": "true",
               "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9", "XLA_PYTHON_CLIENT_ALLOCATOR": "cuda_async",
               "http_proxy": "http://proxy:3128"}  # a proxy, but one process: no coordinator
    cfg = _cfg(tmp_path)
    assert doctor.check_all(cfg, environ, ONE_HOST, versions=VERSIONS) == []
    assert doctor.check_all(cfg, environ, ONE_HOST) == []  # the installed jax, jaxlib, plugins
    assert doctor.check_all(cfg, {}) == []  # jax's own view of this process's devices


def test_a_run_on_cpus_skips_the_gpu_settings(tmp_path):
    """A CPU run warned of CUDA_LAUNCH_BLOCKING and "24 GB of an H100's 80 GB"; launch.py passes
    gpu=False on CPU devices (tools/doctor.py keeps them: it checks a GPU node's set-up)."""
    environ = {"CUDA_LAUNCH_BLOCKING": "1", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"}
    cfg = _cfg(tmp_path)
    assert len(doctor.check_all(cfg, environ, ONE_HOST, versions=VERSIONS)) == 2
    assert doctor.check_all(cfg, environ, ONE_HOST, versions=VERSIONS, gpu=False) == []


def test_cuda_launch_blocking():
    assert doctor.check_launch_blocking({"CUDA_LAUNCH_BLOCKING": "0"}) == []
    assert doctor.check_launch_blocking({"CUDA_LAUNCH_BLOCKING": "1"}) == [BLOCKING]


ALLOCATOR = [
    ({"XLA_PYTHON_CLIENT_PREALLOCATE": "false"}, "unset XLA_PYTHON_CLIENT_PREALLOCATE"),
    ({"XLA_PYTHON_CLIENT_PREALLOCATE": "0"}, "fragments"),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"},
     "use 30% of each GPU's memory (24 GB of an H100's 80 GB)"),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.3"},
     "unset XLA_PYTHON_CLIENT_MEM_FRACTION (the run then sets xla.mem_fraction, 0.9 by default) "
     "or set it to at least 0.5"),
    ({"XLA_CLIENT_MEM_FRACTION": ".2"}, "unset XLA_CLIENT_MEM_FRACTION"),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "most"},
     "most must be a share of each GPU's memory in (0, 1], as xla.mem_fraction must"),
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "2"}, "=2 must be a share of each GPU's memory in (0, 1]"),
    ({"XLA_CLIENT_MEM_FRACTION": "0"}, "unset XLA_CLIENT_MEM_FRACTION and set xla.mem_fraction"),
    ({"XLA_CLIENT_MEM_FRACTION": "0.9", "XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"},
     "unset XLA_PYTHON_CLIENT_MEM_FRACTION (the deprecated name)"),
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}, "unset XLA_PYTHON_CLIENT_ALLOCATOR"),
    ({"XLA_PYTHON_CLIENT_ALLOCATOR": "Platform"}, "no pool"),  # jaxlib lowercases it
]


@pytest.mark.parametrize("environ,fix", ALLOCATOR, ids=[str(e) for e, _ in ALLOCATOR])
def test_allocator_variables(environ, fix):
    [problem] = doctor.check_allocator(environ)
    assert fix in problem


@pytest.mark.parametrize("environ", [{"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"},
                                     {"XLA_PYTHON_CLIENT_PREALLOCATE": "true"},
                                     {"XLA_PYTHON_CLIENT_ALLOCATOR": "bfc"}])
def test_allocator_settings_that_are_fine(environ):
    assert doctor.check_allocator(environ) == []


def test_versions():
    assert doctor.check_plugins(VERSIONS) == [] and doctor.check_jaxlib(VERSIONS, JAX_NEEDS) == []
    [problem] = doctor.check_plugins(VERSIONS | {"jax-cuda12-plugin": "0.10.1"})
    assert problem.startswith("jax-cuda12-plugin 0.10.1 differ from jaxlib 0.10.2")
    assert "pip install 'jax[cuda12]==0.10.2' installs a matching set" in problem
    [problem] = doctor.check_plugins({"jax": "0.10.2", "jaxlib": "0.10.2",
                                      "jax-cuda13-pjrt": "0.10.0"})
    assert "jax[cuda13]==0.10.2" in problem
    # jax 0.10.2 takes jaxlib 0.10.1, but the plugin must be jaxlib's version, not jax's
    [problem] = doctor.check_plugins(VERSIONS | {"jaxlib": "0.10.1"})
    assert problem.startswith("jax-cuda12-plugin 0.10.2, jax-cuda12-pjrt 0.10.2 differ from "
                              "jaxlib 0.10.1")
    assert doctor.check_jaxlib(VERSIONS | {"jaxlib": "0.10.1"}, JAX_NEEDS) == []
    for jaxlib in ("0.10.3", "0.9.2"):
        [problem] = doctor.check_jaxlib(VERSIONS | {"jaxlib": jaxlib}, JAX_NEEDS)
        assert f"jaxlib {jaxlib} does not meet jax 0.10.2's requirement jaxlib{JAX_NEEDS}" in (
            problem)
        assert "pip install 'jax[cuda12]==0.10.2'" in problem
    [problem] = doctor.check_jaxlib({"jax": "0.10.2"}, JAX_NEEDS)
    assert "jaxlib (not installed)" in problem
    installed = doctor.installed_versions()  # this machine: a matching set
    assert installed["jaxlib"] == installed["jax-cuda12-plugin"]
    assert doctor.check_jaxlib(installed) == [] and doctor.check_plugins(installed) == []


PROXY = {"https_proxy": "http://proxy.corp:3128"}
SLURM = {"SLURM_NTASKS": "16", "SLURM_STEP_NODELIST": "gpu[007-009,12],login1"}


@pytest.mark.parametrize("environ,coordinator,host", [
    (PROXY, "10.1.2.3:1234", "10.1.2.3"),
    (PROXY | {"JAX_COORDINATOR_ADDRESS": "head.cluster:4321"}, None, "head.cluster"),
    (PROXY | SLURM, None, "gpu007"),
    ({"grpc_proxy": "http://p:1"}, "[fd00::1]:1234", "fd00::1"),
    # gRPC reads no_grpc_proxy first: no_proxy's entry does not help
    (PROXY | {"no_grpc_proxy": "other", "no_proxy": "10.1.2.3"}, "10.1.2.3:1234", "10.1.2.3"),
    (PROXY | {"no_proxy": "*"}, "10.1.2.3:1234", "10.1.2.3"),  # gRPC has no wildcard
])
def test_proxy_that_would_carry_the_coordinator(environ, coordinator, host):
    [problem] = doctor.check_proxy(environ, coordinator)
    assert f"the coordinator {host} is not in no_proxy" in problem
    assert f"export no_proxy={host},$no_proxy" in problem


@pytest.mark.parametrize("environ,coordinator", [
    (PROXY, None),  # one process: no coordinator to dial
    (PROXY | {"SLURM_NTASKS": "1", "SLURM_STEP_NODELIST": "gpu1"}, None),
    ({}, "10.1.2.3:1234"),  # no proxy
    (PROXY | {"no_proxy": "localhost,10.1.2.3"}, "10.1.2.3:1234"),
    (PROXY | {"NO_PROXY": "10.0.0.0/8"}, "10.1.2.3:1234"),
    (PROXY | {"no_proxy": ".cluster"}, "head.cluster:1"),
    (PROXY | SLURM | {"no_proxy": "gpu007"}, None),
])
def test_proxy_that_misses_the_coordinator(environ, coordinator):
    assert doctor.check_proxy(environ, coordinator) == []


def test_mesh_against_the_devices_found(tmp_path):
    mesh = _cfg(tmp_path, "mesh.fsdp=16").mesh
    [problem] = doctor.check_device_counts(mesh, ONE_HOST)
    assert "has 16 devices but 8 are available; make the product match" in problem
    assert problem.endswith("8 devices found (8 per host x 1 host)")
    [problem] = doctor.check_device_counts(_cfg(tmp_path).mesh, ONE_HOST, devices=16)
    assert problem == ("the mesh is planned for 16 devices (--devices) but 8 devices found (8 per "
                       "host x 1 host); run on 16 devices or plan for 8")
    # one process per GPU: 8 processes a host, the same devices on both hosts
    per_gpu = Hosts((1,) * 16, ("a",) * 8 + ("b",) * 8)
    assert doctor.check_device_counts(mesh, per_gpu) == []
    assert per_gpu.per_node() == {"a": 8, "b": 8} and per_gpu.per_host == 8


def test_a_host_with_fewer_devices(tmp_path):
    hosts = Hosts((8, 8, 7, 8), ("gpu1", "gpu2", "gpu3", "gpu4"))
    mesh, problem = doctor.check_device_counts(_cfg(tmp_path, "mesh.fsdp=8", "mesh.data=-1").mesh,
                                               hosts)
    assert "do not divide the 31 devices" in mesh or "does not divide the 31 devices" in mesh
    assert mesh.endswith("31 devices found (8 per host x 4 hosts)")
    assert problem.startswith("hosts hold different numbers of devices (gpu3 has 7; the others 8)")
    assert "check CUDA_VISIBLE_DEVICES and nvidia-smi on those hosts" in problem


def test_fsdp_or_tensor_across_hosts():
    sizes = {"data": 1, "stage": 1, "fsdp": 16, "tensor": 1}
    [problem] = doctor.check_crossing(sizes, 8)
    assert problem.startswith("mesh.fsdp=16 spans hosts of 8 devices")
    assert "use HSDP, mesh.data across nodes and mesh.fsdp within: mesh.data=2 mesh.fsdp=8 " in (
        problem)
    assert doctor.check_crossing(sizes | {"data": 2, "fsdp": 8}, 8) == []
    assert doctor.check_crossing(sizes, 16) == []  # one host of 16
    [problem] = doctor.check_crossing({"data": 1, "stage": 2, "fsdp": 4, "tensor": 16}, 8)
    assert problem.startswith("mesh.fsdp=4 and mesh.tensor=16 spans hosts of 8 devices")
    assert "mesh.data=8 mesh.fsdp=1 mesh.tensor=8 (the state is then split 16 ways" in problem
    # stage and data may cross hosts: their traffic is once per step or per microbatch
    assert doctor.check_crossing({"data": 2, "stage": 4, "fsdp": 2, "tensor": 4}, 8) == []


def test_run_dir_not_shared_between_hosts(tmp_path, monkeypatch):
    run_dir = tmp_path / "run"
    calls: list[str] = []
    process_0 = Hosts((8, 8), ("a", "b"), 0)
    assert doctor.check_shared_dir(str(run_dir), process_0, "abc123", calls.append) == []
    assert calls == ["jaxtron_doctor_token_written", "jaxtron_doctor_token_read"]
    assert list(run_dir.iterdir()) == []  # process 0 removed its token at the end

    def process_0_writes(name: str) -> None:  # process 1's view: process 0 wrote at the first sync
        if name == "jaxtron_doctor_token_written":
            (run_dir / f"{doctor.TOKEN_PREFIX}abc123").write_text("abc123")

    process_1 = Hosts((8, 8), ("a", "b"), 1)
    assert doctor.check_shared_dir(str(run_dir), process_1, "abc123", process_0_writes) == []
    monkeypatch.setattr(doctor, "_read_token", lambda path: None)  # another host's empty disk
    [problem] = doctor.check_shared_dir(str(run_dir), process_1, "abc123", process_0_writes)
    assert problem.startswith(f"run.dir {run_dir} is not shared between hosts")
    assert "put run.dir on storage every host mounts" in problem
    assert "checkpoints written by process 0's host must be readable by every process" in problem


def test_run_dir_not_writable(tmp_path):
    (tmp_path / "file").write_text("")
    [problem] = doctor.check_shared_dir(str(tmp_path / "file" / "run"), Hosts((8, 8), ("a", "b")),
                                        "abc", lambda name: None)
    assert "is not writable" in problem


@pytest.mark.parametrize("kind", ["file", "under_a_file"])
def test_run_dir_that_is_a_file(tmp_path, capsys, kind):
    """One process: run.dir a file, or a path under one, is found as launch.py would refuse it."""
    (tmp_path / "notes.txt").write_text("keep me")
    path = tmp_path / "notes.txt" if kind == "file" else tmp_path / "notes.txt" / "run"
    cfg = config_lib.load([ROOT / "configs" / "tiny.yaml"], [f"run.dir={path}"])
    message = ("is a file; set run.dir to a directory" if kind == "file" else
               "cannot be written (Not a directory)")
    assert doctor.check_all(cfg, {}, ONE_HOST, versions=VERSIONS) == [
        f"run.dir={path} {message}" + ("; choose a directory you can write" if kind != "file"
                                       else " (a new one, or a run to resume)")]
    from jaxtron.commands import doctor as tool

    assert_refused(tool.main(["--strict", f"run.dir={path}"]), capsys.readouterr().err,
                   "doctor.py: error:", f"run.dir={path} {message}")
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_an_unwritable_run_dir_is_its_one_problem(monkeypatch):
    """Nothing can be made under /proc (as root too): that is the problem, not also the free space
    there (none) nor, with several processes, that process 0 cannot write it (said already)."""
    run_dir = "/proc/jaxtron/run"
    cfg = config_lib.load([ROOT / "configs" / "tiny.yaml"], [f"run.dir={run_dir}"])
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda path: pytest.fail("disk checked"))
    [problem] = doctor.check_all(cfg, {}, ONE_HOST, versions=VERSIONS)
    assert problem.startswith(f"run.dir={run_dir} cannot be written (") and problem.endswith(
        "); choose a directory you can write")
    # process 0 of two: every process learns from process 0's nonce (none) to skip the sharing check
    monkeypatch.setattr(doctor, "allgather_text", lambda text: [text])
    monkeypatch.setattr(doctor, "check_shared_dir", lambda *args: pytest.fail("sharing checked"))
    problems = doctor.check_all(cfg, {}, Hosts((8, 8), ("a", "b")), versions=VERSIONS)
    assert [p for p in problems if "run.dir" in p] == [problem]


def test_planned_for_other_devices_gives_no_hsdp_advice(tmp_path, capsys):
    """--devices plans the mesh for hosts other than these: only the count is a problem, no HSDP
    hint built from this host (one CPU device: 'mesh.data=8 mesh.fsdp=1 ... split 1 ways')."""
    one_device = Hosts((1,), ("node0",))
    assert doctor.check_all(_cfg(tmp_path), {}, one_device, devices=8, versions=VERSIONS) == [
        "the mesh is planned for 8 devices (--devices) but 1 device found (1 per host x 1 host); "
        "run on 8 devices or plan for 1"]
    from jaxtron.commands import doctor as tool

    assert tool.main(["--devices", "16", f"run.dir={tmp_path}"]) == 0  # 8 devices here
    assert capsys.readouterr().out == (
        "doctor.py: warning: the mesh is planned for 16 devices (--devices) but 8 devices found (8 "
        "per host x 1 host); run on 16 devices or plan for 8\n")


def test_device_counts_in_words(tmp_path):
    """'1 device found (1 per host x 1 host)', never '1 devices'."""
    [problem] = doctor.check_device_counts(_cfg(tmp_path).mesh, Hosts((1,), ("node0",)),
                                           devices=2)
    assert problem == ("the mesh is planned for 2 devices (--devices) but 1 device found (1 per "
                       "host x 1 host); run on 2 devices or plan for 1")
    [problem] = doctor.check_device_counts(_cfg(tmp_path).mesh, ONE_HOST, devices=1)
    assert problem.startswith("the mesh is planned for 1 device (--devices) but 8 devices found")


def test_disk_smaller_than_a_checkpoint(tmp_path, monkeypatch):
    cfg = _cfg(tmp_path)
    assert doctor.checkpoint_bytes(cfg, 8) == TINY_CHECKPOINT  # 88,108,040 bytes
    usage = collections.namedtuple("usage", "total used free")
    seen = []
    free = 10 * 2**20

    def disk_usage(path):
        seen.append(path)
        return usage(2**40, 2**40 - free, free)

    monkeypatch.setattr(doctor.shutil, "disk_usage", disk_usage)
    [problem] = doctor.check_all(cfg, {}, ONE_HOST, versions=VERSIONS)
    assert seen == [tmp_path]  # run.dir does not exist yet: its nearest existing parent
    assert problem == (f"run.dir {cfg.run.dir} has 0.01 GiB (10,485,760 bytes) free on its "
                       "filesystem, less than one checkpoint (0.08 GiB (88,108,040 bytes): params "
                       "+ optimizer state), so the first save fails; free space there or point "
                       "run.dir at a larger filesystem")
    assert doctor.check_disk(cfg.run.dir, free) == []  # exactly enough


def test_merge_names_the_processes_unless_all_have_it():
    merged = doctor.merge([["a", "b"], ["a"], ["a", "c"], ["b", "c"], ["c"]])
    assert merged == ["a (processes 0-2)", "b (processes 0, 3)", "c (processes 2-4)"]
    assert doctor.merge([["a"], ["a"]]) == ["a"] and doctor.merge([[], []]) == []


def _run(script: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / script), *args], check=False, cwd=ROOT,
                          text=True, capture_output=True, timeout=600, env=os.environ | env)


@pytest.mark.parametrize("devices", ["0", "-4"])
def test_doctor_tool_refuses_a_device_count_below_1(tmp_path, devices):
    """`--devices 0` said "no problems found", `-4` planned a mesh for -4 devices."""
    proc = _run("tools/doctor.py", "--devices", devices, f"run.dir={tmp_path}")
    assert (proc.returncode, proc.stderr) == (2, f"doctor.py: error: --devices {devices} must be "
                                                 "at least 1\n")


def test_doctor_tool_strict_is_one_line_and_status_2(tmp_path):
    proc = _run("tools/doctor.py", "--strict", f"run.dir={tmp_path}", CUDA_LAUNCH_BLOCKING="1")
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"doctor.py: error: {BLOCKING}"]
    assert "no problems" not in proc.stdout


@pytest.mark.skipif(os.path.exists("/proc/driver/nvidia"), reason="a GPU: cuda starts here")
@pytest.mark.parametrize("platforms,reason", [("cuda", "no NVIDIA GPU visible"),
                                              ("garbage", "is not in the list of known backends")])
def test_doctor_tool_reports_a_backend_that_cannot_start(tmp_path, platforms, reason):
    """JAX_PLATFORMS naming a backend that cannot start here is a problem line, not a traceback;
    the environment's checks still run."""
    proc = _run("tools/doctor.py", f"run.dir={tmp_path}", JAX_PLATFORMS=platforms,
                XLA_PYTHON_CLIENT_MEM_FRACTION="2")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    backend, fraction = proc.stdout.splitlines()
    assert backend.startswith(f"doctor.py: warning: JAX_PLATFORMS={platforms}, but no {platforms} "
                              "backend starts here (") and reason in backend
    assert fraction.startswith("doctor.py: warning: XLA_PYTHON_CLIENT_MEM_FRACTION=2 must be")
    strict = _run("tools/doctor.py", "--strict", f"run.dir={tmp_path}", JAX_PLATFORMS=platforms)
    assert strict.returncode == 2 and len(strict.stderr.splitlines()) == 1
    assert strict.stderr.startswith(f"doctor.py: error: JAX_PLATFORMS={platforms}, but")


def test_doctor_tool_without_problems(tmp_path, capsys):
    from jaxtron.commands import doctor as tool

    assert tool.main([f"run.dir={tmp_path}"]) == 0
    assert capsys.readouterr().out == "doctor.py: no problems found\n"
    assert tool.main(["--strict", "mesh.fsdp=3"]) == 2
    assert "doctor.py: error: mesh (data=1, stage=1, fsdp=3, tensor=1) has 3 devices" in (
        capsys.readouterr().err)


def test_launch_strict_stops_before_compiling(tmp_path, capsys, monkeypatch):
    """A set-up problem (here a CUDA plugin of another version: a CPU run skips the GPU
    variables, so one is planted) is one line and exit 2 under --strict, a warning without."""
    run_dir = tmp_path / "run"
    monkeypatch.setattr(doctor, "check_plugins", lambda versions: [PLATFORM])
    assert launch.main(["--strict", *SMALL_RUN, f"run.dir={run_dir}"]) == 2
    out, err = capsys.readouterr()
    assert err.splitlines() == [f"launch.py: error: {PLATFORM}"]
    assert "compiled" not in out and not run_dir.exists()  # stopped before train()
    assert launch.main([*SMALL_RUN, f"run.dir={run_dir}"]) == 0
    assert f"warning: {PLATFORM}" in capsys.readouterr().out.splitlines()


def test_launch_strict_is_for_training_runs(capsys):
    assert_refused(launch.main(["--strict", "--dry-run"]), capsys.readouterr().err, "--strict",
                   "jaxtron doctor --strict")


def test_launch_on_cpus_trains_without_the_gpu_warnings(tmp_path):
    """CUDA_LAUNCH_BLOCKING and a low memory fraction concern GPUs: a CPU run said "24 GB of an
    H100's 80 GB"; now it says nothing of them (tools/doctor.py still does)."""
    run_dir = tmp_path / "run"
    proc = _run("launch.py", "--strict", *SMALL_RUN, f"run.dir={run_dir}", CUDA_LAUNCH_BLOCKING="1",
                XLA_PYTHON_CLIENT_MEM_FRACTION="0.3",
                XLA_FLAGS="--xla_force_host_platform_device_count=1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    warnings = [line for line in proc.stdout.splitlines() if line.startswith("warning: ")]
    assert warnings == []
    assert (run_dir / "metrics.jsonl").read_text().count("\n") == 1  # step 1 logged
    # tiny's 20 warm-up steps in a 1-step run: one line in the run's log, after `run:`
    log = [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line[:2].isdigit()]
    assert log[1] == ("warning: optim.warmup_steps=20 is more than train.steps=1: the run ends "
                      "during warm-up, before the learning rate reaches optim.lr=0.003; lower "
                      "optim.warmup_steps (or raise train.steps)")
    assert log[2] == "xla flags: --xla_force_host_platform_device_count=1"
    assert log[3] == "mesh: data=1, stage=1, fsdp=1, tensor=1 over 1 cpu device"


def test_two_processes_merge_their_problems(tmp_path):
    """Two real processes joined at a coordinator (4 CPU devices each): process 1 alone has
    CUDA_LAUNCH_BLOCKING set and a run.dir process 0 never wrote to (as on a host-local disk);
    process 0 prints both, naming process 1, and both stop with status 2."""
    port, procs = free_port(), []
    for i in range(2):
        env = multiprocess_env() | ({"CUDA_LAUNCH_BLOCKING": "1"} if i else {})
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "tools" / "doctor.py"), "--strict", "--coordinator",
             f"127.0.0.1:{port}", "--num-processes", "2", "--process-id", str(i),
             f"run.dir={tmp_path / f'run{i}'}"],
            cwd=ROOT, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    outputs = [p.communicate(timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [2, 2], outputs
    errors = [line for line in outputs[0][1].splitlines() if line.startswith("doctor.py: error: ")]
    unshared = (f"run.dir {tmp_path / 'run1'} is not shared between hosts: the file process 0 "
                "wrote there is not seen here; put run.dir on storage every host mounts (NFS, "
                "Lustre, ...): checkpoints written by process 0's host must be readable by every "
                "process on restart")
    assert errors == [f"doctor.py: error: {BLOCKING} (process 1)",
                      f"doctor.py: error: {unshared} (process 1)"]
    assert "doctor.py: error" not in outputs[1][1]  # process 0 alone prints
    assert list((tmp_path / "run0").iterdir()) == []  # the token is gone
