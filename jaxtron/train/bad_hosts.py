"""The hosts that failed a run (a lost process's), so that the next attempt runs without them.

Two files in run.dir:
- HOSTS (hosts.json): the host of each process, in process order, a JSON list. Process 0 writes
  it when the run starts (`write_hosts`), so a supervisor that learns "process 7 was lost" can
  name its host (`host_of`).
- BAD (bad_hosts): one `<host>\\t<why>` line per host at fault, appended (`add`), for instance by
  the supervisor of every process that saw its peer go; `read` gives each host once.

scripts/slurm/train.sbatch reads bad_hosts when the run stops: it restarts the run inside its
allocation without those hosts (on a spare node), and requeues the job only when too few healthy
nodes are left. Stdlib only: the supervisor imports it without jax.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

HOSTS = "hosts.json"
BAD = "bad_hosts"


def write_hosts(run_dir: Path, nodes: list[str]) -> None:
    """Write hosts.json: `nodes[i]` is process i's host. Atomic (a tmp file, then os.replace),
    so a supervisor never reads half a list."""
    path = Path(run_dir) / HOSTS
    tmp = path.with_name(f".{HOSTS}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(list(nodes)) + "\n")
    os.replace(tmp, path)


def host_of(run_dir: Path, process: int) -> str | None:
    """Process `process`'s host from hosts.json; None when the file is missing, unreadable or
    has no such process."""
    try:
        nodes = json.loads((Path(run_dir) / HOSTS).read_text())
    except (OSError, ValueError):  # ValueError: bad JSON or bad UTF-8
        return None
    if not isinstance(nodes, list) or not 0 <= process < len(nodes):
        return None
    host = nodes[process]
    return host if isinstance(host, str) and host else None


def add(run_dir: Path, host: str, why: str) -> None:
    """Append `<host>\\t<why>` to bad_hosts. Never raises OSError: a run that cannot write it
    still ends with its own line. A host name with whitespace in it is no host name (the Slurm
    script reads the first field): it is left out."""
    if host.split() != [host]:
        return
    line = f"{host}\t{' '.join(why.split())}\n".encode()
    try:
        # One write to an O_APPEND file: lines written at once do not interleave (NFS may keep
        # only one of them; the survivors of a lost process add the same host).
        fd = os.open(Path(run_dir) / BAD, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)
        finally:
            os.close(fd)
    except OSError:
        pass


def read(run_dir: Path) -> list[str]:
    """The hosts in bad_hosts, each once, in the order they were first added; [] when none."""
    try:
        lines = (Path(run_dir) / BAD).read_text().splitlines()
    except (OSError, ValueError):
        return []
    hosts = (line.split("\t", 1)[0].strip() for line in lines)
    return list(dict.fromkeys(host for host in hosts if host))
