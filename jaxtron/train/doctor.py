"""Preflight checks: the set-up mistakes that waste a cluster's first hours, found before step 1.

Each check is a plain function returning zero or more problems, one line each, naming the fix: the
environment (CUDA_LAUNCH_BLOCKING, jax's GPU allocator variables, proxies in the coordinator's
way), jax/jaxlib/CUDA plugin versions, the devices against the mesh, and run.dir (a directory this
process can write, shared between hosts, with room for a checkpoint). `check_all` runs them all;
with several processes it is a collective that gives every process the same merged list, so a
--strict run stops everywhere at once. The environment comes in as a mapping (tests set conditions
without touching os.environ); jax is imported only where needed: a bad jaxlib stops `import jax`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import ipaddress
import math
import operator
import os
import re
import secrets
import shutil
import socket
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from jaxtron.cli import check_run_dir, plural
from jaxtron.config import Config, ConfigError, MeshConfig, XlaConfig
from jaxtron.lifecycle import EXIT_USAGE, script_name
from jaxtron.program import xla_flags
from jaxtron.train.distributed import allgather_text

MIN_MEM_FRACTION = 0.5  # below this share of GPU memory, XLA is starved (jax's default is 0.75)
PLUGINS = ("jax-cuda12-plugin", "jax-cuda12-pjrt", "jax-cuda13-plugin", "jax-cuda13-pjrt")
# Variables that proxy traffic: gRPC (jax.distributed's transport) reads grpc_proxy, https_proxy
# and http_proxy, in that order; the others send it through a proxy in other stacks.
PROXY_VARS = ("grpc_proxy", "https_proxy", "http_proxy", "all_proxy", "HTTPS_PROXY", "HTTP_PROXY",
              "ALL_PROXY")
NO_PROXY_VARS = ("no_grpc_proxy", "no_proxy", "NO_PROXY")  # gRPC takes the first one set
_COMPARE = {">=": operator.ge, "<=": operator.le, "==": operator.eq, "!=": operator.ne,
            ">": operator.gt, "<": operator.lt}  # ">=" before ">": the first prefix that matches
TOKEN_PREFIX = ".jaxtron-doctor-"  # + a fresh nonce: a new name no host can have cached as absent


# ---------------------------------------------------------------- environment
def check_launch_blocking(environ: Mapping[str, str]) -> list[str]:
    """CUDA_LAUNCH_BLOCKING=1 makes every kernel launch wait for the previous kernel."""
    if environ.get("CUDA_LAUNCH_BLOCKING", "").strip() != "1":
        return []
    return [("CUDA_LAUNCH_BLOCKING=1 serialises every GPU kernel launch with the host (a debugging "
             "switch: steps run several times slower); unset CUDA_LAUNCH_BLOCKING")]


def check_allocator(environ: Mapping[str, str]) -> list[str]:
    """jax's GPU memory variables, read as jaxlib's xla_client reads them."""
    problems = []
    if environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "") in ("false", "False", "0"):
        problems.append(
            f"XLA_PYTHON_CLIENT_PREALLOCATE={environ['XLA_PYTHON_CLIENT_PREALLOCATE']} makes jax "
            "allocate GPU memory on demand: slower, and it fragments, so a model that fits can "
            "run out of memory hours in; unset XLA_PYTHON_CLIENT_PREALLOCATE")
    names = [n for n in ("XLA_CLIENT_MEM_FRACTION", "XLA_PYTHON_CLIENT_MEM_FRACTION")
             if environ.get(n)]
    if len(names) == 2:
        problems.append("XLA_CLIENT_MEM_FRACTION and XLA_PYTHON_CLIENT_MEM_FRACTION are both set "
                        "and jax refuses to start its GPU backend; unset "
                        "XLA_PYTHON_CLIENT_MEM_FRACTION (the deprecated name)")
    elif names:
        problems += _check_fraction(names[0], environ[names[0]])
    if environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "").lower() == "platform":
        problems.append("XLA_PYTHON_CLIENT_ALLOCATOR=platform makes every buffer a cudaMalloc and "
                        "cudaFree (no pool: very slow); unset XLA_PYTHON_CLIENT_ALLOCATOR")
    return problems


def _check_fraction(name: str, value: str) -> list[str]:
    """A memory fraction in (0, 1] (as jaxtron train checks it), not so low that it starves XLA."""
    try:
        fraction = xla_flags.mem_fraction(name, value)
    except ConfigError as e:
        return [str(e)]
    if fraction >= MIN_MEM_FRACTION:
        return []
    return [(f"{name}={value} lets XLA use {fraction:.0%} of each GPU's memory "
             f"({fraction * 80:.0f} GB of an H100's 80 GB), starving its buffers and fusions; "
             f"unset {name} (the run then sets xla.mem_fraction, {XlaConfig().mem_fraction} by "
             f"default) or set it to at least {MIN_MEM_FRACTION}")]


def coordinator_host(environ: Mapping[str, str], coordinator: str | None = None) -> str | None:
    """The host every process dials to join the run: --coordinator, JAX_COORDINATOR_ADDRESS, or
    the first node of a Slurm job of several tasks; None for a one-process run."""
    address = coordinator or environ.get("JAX_COORDINATOR_ADDRESS", "")
    if address:  # host:port, [v6]:port, or a bare host
        host = address.rsplit(":", 1)[0] if address.count(":") == 1 or "]" in address else address
        return host.strip("[]")
    nodes = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
    tasks = environ.get("SLURM_NTASKS", "1")
    if not nodes or not tasks.isdigit() or int(tasks) <= 1:
        return None
    prefix, ranges = re.match(r"([^,\[]*)(?:\[([^\]]*)\])?", nodes).groups()  # node[003-8,12]
    return prefix + (ranges.split(",")[0].split("-")[0] if ranges else "")


def check_proxy(environ: Mapping[str, str], coordinator: str | None = None) -> list[str]:
    """A proxy that would carry the coordinator's gRPC traffic: one is set, and no_proxy misses
    the coordinator's host."""
    host = coordinator_host(environ, coordinator)
    proxies = [name for name in PROXY_VARS if environ.get(name)]
    if host is None or not proxies or _bypassed(host, environ):
        return []
    return [(f"{', '.join(proxies)} set and the coordinator {host} is not in no_proxy, so gRPC "
             "sends jax.distributed's traffic to it through the proxy (processes never join, or "
             f"time out); export no_proxy={host},$no_proxy (or unset the proxy variables in the "
             "job)")]


def _bypassed(host: str, environ: Mapping[str, str]) -> bool:
    """gRPC's rule: a no_proxy entry that ends the host name, or a network that holds its IP."""
    entries = next((environ[n] for n in NO_PROXY_VARS if n in environ), "")
    for entry in filter(None, (e.strip() for e in entries.split(","))):
        if host.lower().endswith(entry.lower()):
            return True
        try:
            if "/" in entry and ipaddress.ip_address(host) in ipaddress.ip_network(entry, False):
                return True
        except ValueError:  # a host name, or an entry that is not a network
            continue
    return False


# ---------------------------------------------------------------- versions
def installed_versions() -> dict[str, str]:
    """The installed versions of jax, jaxlib and the CUDA plugins (absent ones left out)."""
    found = {}
    for name in ("jax", "jaxlib", *PLUGINS):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def jaxlib_requirement() -> str:
    """The jaxlib versions the installed jax declares it needs, e.g. '<=0.10.2,>=0.10.1'."""
    for requirement in importlib.metadata.requires("jax") or []:
        if requirement.startswith("jaxlib") and ";" not in requirement:
            return requirement.removeprefix("jaxlib").strip()
    return ""


def check_jaxlib(versions: Mapping[str, str], required: str | None = None) -> list[str]:
    """jaxlib within the range jax requires (outside it, `import jax` itself fails)."""
    if "jax" not in versions:
        return []
    required = jaxlib_requirement() if required is None else required
    jaxlib = versions.get("jaxlib")
    if jaxlib is not None and _satisfies(jaxlib, required):
        return []
    return [(f"jaxlib {jaxlib or '(not installed)'} does not meet jax {versions['jax']}'s "
             f"requirement jaxlib{required}, so jax will not import; "
             f"{_reinstall(versions)} installs a matching set")]


def check_plugins(versions: Mapping[str, str]) -> list[str]:
    """Every installed CUDA plugin at exactly jaxlib's version."""
    jaxlib = versions.get("jaxlib")
    off = [f"{name} {versions[name]}" for name in PLUGINS
           if name in versions and versions[name] != jaxlib]
    if not off or jaxlib is None:
        return []
    return [(f"{', '.join(off)} differ from jaxlib {jaxlib}: a CUDA plugin built for another "
             "jaxlib fails to load, and jax then runs on the CPU or stops with a PJRT error; "
             f"{_reinstall(versions)} installs a matching set")]


def _reinstall(versions: Mapping[str, str]) -> str:
    extra = "cuda13" if any(name.startswith("jax-cuda13") for name in versions) else "cuda12"
    return f"pip install 'jax[{extra}]=={versions['jax']}'"


def _satisfies(version: str, specifiers: str) -> bool:
    """`version` within comma-separated bounds (>=, <=, ==, !=, >, <) on release numbers."""
    for spec in filter(None, (s.strip() for s in specifiers.split(","))):
        op = next((op for op in _COMPARE if spec.startswith(op)), None)
        if op and not _COMPARE[op](_release(version), _release(spec[len(op):])):
            return False
    return True


def _release(version: str) -> tuple[int, ...]:
    """'0.10.2.dev1' -> (0, 10, 2, 0): the release numbers, padded to compare."""
    match = re.match(r"\d+(?:\.\d+)*", version.strip())
    numbers = [int(x) for x in match.group().split(".")] if match else []
    return tuple(numbers + [0] * (4 - len(numbers)))[:4]


# ---------------------------------------------------------------- devices and the mesh
def host_name() -> str:
    """This host's name: JAXTRON_HOST where set (containers that share a hostname; processes on
    one machine standing for several hosts), else Slurm's name of the node (what `srun
    --exclude` takes: scripts/slurm/train.sbatch leaves out run.dir/bad_hosts by it), else the
    machine's."""
    return (os.environ.get("JAXTRON_HOST", "").strip()
            or os.environ.get("SLURMD_NODENAME", "").strip() or socket.gethostname())


@dataclass(frozen=True)
class Hosts:
    """Where the run's devices are: how many each process holds and the host it runs on."""

    devices: tuple[int, ...]  # process i holds devices[i] devices
    nodes: tuple[str, ...]  # process i runs on the host named nodes[i]
    index: int = 0  # this process

    @staticmethod
    def here() -> Hosts:
        """This run's processes, from jax (after jax.distributed joined them: a collective)."""
        import jax

        counts = Counter(device.process_index for device in jax.devices())
        devices = tuple(counts[i] for i in range(jax.process_count()))
        name = host_name()
        nodes = allgather_text(name) if len(devices) > 1 else [name]
        return Hosts(devices, tuple(nodes), jax.process_index())

    @property
    def total(self) -> int:
        return sum(self.devices)

    def per_node(self) -> dict[str, int]:
        """Devices on each host (a host may run one process per GPU)."""
        counts: dict[str, int] = {}
        for node, n in zip(self.nodes, self.devices):
            counts[node] = counts.get(node, 0) + n
        return counts

    @property
    def per_host(self) -> int:
        """Devices on the first process's host: the mesh's rows, laid out host-major."""
        return self.per_node()[self.nodes[0]]


def check_device_counts(mesh: MeshConfig, hosts: Hosts, devices: int = 0) -> list[str]:
    """The mesh (over `devices`, default all found) against the devices found, and every host
    holding the same number."""
    from jaxtron import parallel

    per_node = hosts.per_node()
    usual, _ = Counter(per_node.values()).most_common(1)[0]
    found = (f"{plural(hosts.total, 'device')} found ({usual} per host x "
             f"{plural(len(per_node), 'host')})")
    problems = []
    try:
        planned = math.prod(parallel.mesh_shape(mesh, devices or hosts.total).values())
        if planned != hosts.total:
            planned_for = plural(planned, "device")
            problems.append(f"the mesh is planned for {planned_for} (--devices) but {found}; "
                            f"run on {planned_for} or plan for {hosts.total}")
    except ConfigError as e:
        problems.append(f"{e}; {found}")
    short = sorted(node for node, n in per_node.items() if n != usual)
    if short:
        shown = ", ".join(f"{node} has {per_node[node]}" for node in short[:8])
        problems.append(f"hosts hold different numbers of devices ({shown}; the others {usual}): "
                        "check CUDA_VISIBLE_DEVICES and nvidia-smi on those hosts, or leave them "
                        "out of the job; the mesh needs the same devices on every host")
    return problems


def check_crossing(sizes: dict[str, int], per_host: int, need=None) -> list[str]:
    """fsdp or tensor spanning hosts where a node could hold it (`need`: autofit.layout_need)."""
    from jaxtron import parallel

    crossing = [a for a in parallel.crossing_axes(sizes, per_host) if a in ("fsdp", "tensor")]
    if not crossing:
        return []
    tensor = math.gcd(sizes["tensor"], per_host)  # what fits within a host, tensor innermost
    fsdp = math.gcd(sizes["fsdp"], per_host // tensor)
    data = sizes["data"] * (sizes["tensor"] // tensor) * (sizes["fsdp"] // fsdp)
    hint = f"mesh.data={data} mesh.fsdp={fsdp}"
    if "tensor" in crossing:
        hint += f" mesh.tensor={tensor}"
    elif need is not None and need({**sizes, "data": data, "fsdp": fsdp}):
        return []  # fsdp must cross hosts at this size: the run's log says so
    axes = " and ".join(f"mesh.{a}={sizes[a]}" for a in crossing)
    return [(f"{axes} spans hosts of {plural(per_host, 'device')}, so its all-gathers and "
             "reduce-scatters leave NVLink for the network every layer; use HSDP, mesh.data across "
             f"nodes and mesh.fsdp within: {hint} (the state is then split "
             f"{fsdp * tensor * sizes['stage']} ways: check memory with jaxtron train --dry-run)")]


def _layout_need(cfg: Config, sizes: dict[str, int], gpu: bool):
    """autofit.layout_need on this machine's GPUs (None elsewhere: no memory limit is known)."""
    import jax

    from jaxtron.plan import autofit

    if not gpu or jax.devices()[0].platform != "gpu":
        return None
    return autofit.layout_need(cfg, math.prod(sizes.values()),
                               autofit.usable_here(jax.devices())[0])


# ---------------------------------------------------------------- the run directory
def check_shared_dir(run_dir: str, hosts: Hosts, nonce: str,
                     sync: Callable[[str], None]) -> list[str]:
    """Process 0 writes a token into run.dir; every process then reads it back (a collective:
    every process calls this with the same nonce). This process's problem if it cannot."""
    token = Path(run_dir) / f"{TOKEN_PREFIX}{nonce}"
    problems = []
    if hosts.index == 0:
        try:
            token.parent.mkdir(parents=True, exist_ok=True)
            token.write_text(nonce)
        except OSError as e:
            problems.append(f"run.dir {run_dir} is not writable ({e.strerror}); use a directory "
                            "that process 0 can write, on storage every host mounts")
    sync("jaxtron_doctor_token_written")
    if hosts.index and not problems and _read_token(token) != nonce:
        problems.append(f"run.dir {run_dir} is not shared between hosts: the file process 0 wrote "
                        "there is not seen here; put run.dir on storage every host mounts (NFS, "
                        "Lustre, ...): checkpoints written by process 0's host must be readable by "
                        "every process on restart")
    sync("jaxtron_doctor_token_read")
    if hosts.index == 0 and not problems:
        token.unlink(missing_ok=True)
    return problems


def _read_token(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def checkpoint_bytes(cfg: Config, num_devices: int) -> int:
    """One checkpoint's size: the params and optimizer state, whole (each shard once)."""
    from jaxtron.step.optim import make_optimizer
    from jaxtron.step.state import make_plan

    return make_plan(cfg, make_optimizer(cfg),
                     num_devices).checkpoint_bytes()


def check_disk(run_dir: str, need: int) -> list[str]:
    """Room for one checkpoint on run.dir's filesystem (run.dir itself may not exist yet)."""
    where = Path(run_dir).absolute()
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free >= need:
        return []
    return [(f"run.dir {run_dir} has {_size(free)} free on its filesystem, less than one "
             f"checkpoint ({_size(need)}: params + optimizer state), so the first save fails; free "
             "space there or point run.dir at a larger filesystem")]


def _size(n: int) -> str:
    return f"{n / 2**30:.2f} GiB ({n:,} bytes)"


# ---------------------------------------------------------------- all of them
def check_all(cfg: Config, environ: Mapping[str, str], hosts: Hosts | None = None, *,
              devices: int = 0, coordinator: str | None = None,
              versions: Mapping[str, str] | None = None, disk: bool = True,
              gpu: bool = True) -> list[str]:
    """Every check (`disk`: room for a checkpoint, a run refuses that itself; `gpu`: the GPU
    environment, a run on CPUs skips it); `devices` plans the mesh for that many (default: those
    found). With several processes a collective: all get every process's problems, merged."""
    hosts = Hosts.here() if hosts is None else hosts
    versions = installed_versions() if versions is None else versions
    environment = check_launch_blocking(environ) + check_allocator(environ) if gpu else []
    problems = [*environment, *check_jaxlib(versions),
                *check_plugins(versions), *check_proxy(environ, coordinator),
                *check_device_counts(cfg.mesh, hosts, devices)]
    writable = True
    try:
        check_run_dir(cfg.run.dir)  # one this process can write, or can make (jaxtron train's)
    except ConfigError as e:  # then its free space and sharing are beside the point
        problems, writable = [*problems, str(e)], False
    from jaxtron import parallel

    sizes = None
    with contextlib.suppress(ConfigError):  # check_device_counts reported it
        sizes = parallel.mesh_shape(cfg.mesh, devices or hosts.total)
    if sizes and devices in (0, hosts.total):  # planned for other hosts: their size is unknown
        problems += check_crossing(sizes, hosts.per_host, _layout_need(cfg, sizes, gpu))
    if sizes and writable and disk:
        problems += check_disk(cfg.run.dir, checkpoint_bytes(cfg, math.prod(sizes.values())))
    if len(hosts.devices) == 1:
        return problems
    from jax.experimental import multihost_utils

    nonce = allgather_text(secrets.token_hex(8) if writable else "")[0]  # process 0's
    if nonce:  # else process 0 cannot write run.dir, and said so: every process skips this
        problems += check_shared_dir(cfg.run.dir, hosts, nonce, multihost_utils.sync_global_devices)
    everyone = allgather_text("\n".join(problems))
    return merge([text.split("\n") if text else [] for text in everyone])


def merge(per_process: Sequence[Sequence[str]]) -> list[str]:
    """Every process's problems as one list: each once, naming its processes unless all have it."""
    where: dict[str, list[int]] = {}
    for i, problems in enumerate(per_process):
        for problem in problems:
            where.setdefault(problem, []).append(i)
    return [problem if len(ids) == len(per_process) else f"{problem} ({_processes(ids)})"
            for problem, ids in where.items()]


def _processes(ids: list[int]) -> str:
    """'process 3', 'processes 0-7, 12'."""
    runs: list[list[int]] = []
    for i in ids:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    text = ", ".join(f"{r[0]}-{r[-1]}" if len(r) > 1 else str(r[0]) for r in runs)
    return f"process{'es' if len(ids) > 1 else ''} {text}"


def report(problems: Sequence[str], strict: bool, prefix: str = "", show: bool = True) -> int:
    """Print each problem on one line (if `show`): `<prefix>warning: ...` on stdout, or with
    `strict` `<script>: error: ...` on stderr. The exit status: 2 if strict and any, else 0."""
    if show:
        for problem in problems:
            print(f"{script_name()}: error: {problem}" if strict else f"{prefix}warning: {problem}",
                  file=sys.stderr if strict else sys.stdout, flush=True)
    return EXIT_USAGE if strict and problems else 0
