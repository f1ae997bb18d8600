"""jax.distributed bootstrap: join the other processes of a multi-process run, or do nothing; and
end the run cleanly and restartably when one of them is lost.

A run is multi-process when `jaxtron train` is given --coordinator/--num-processes/--process-id, or
when Slurm (srun) or Open MPI (mpirun) started several tasks; JAX reads those clusters' variables
itself. Call `initialize` before anything touches jax devices.

A lost process (killed, frozen, its node gone) must stop the others within run.peer_timeout_s,
with one line naming it and exit status 75 (restartable: the newest checkpoint is intact, the same
command resumes). JAX notices it by itself: a collective with a killed peer fails at once (Gloo:
"Connection reset by peer"), and the coordination service (on process 0) marks a process whose
heartbeats stop, after JAX's heartbeat timeout (half of run.peer_timeout_s), frozen ones too; a
process that loses process 0 notices at its next heartbeat. That also bounds every wait in a
collective or a barrier (Orbax's around save and restore, multihost_utils'). But JAX then ends
every process from C++ (LOG(FATAL): 30 lines and a stack, status 134), and jaxlib's hook for that
(missed_heartbeat_callback) cannot be used from Python (it throws std::bad_cast); a watchdog thread
in the training process could not help either: the abort comes from a C++ thread, which writes to
the terminal first. So each multi-process `jaxtron train` trains in a child process that it
supervises (jaxtron/train/supervisor.py), which prints the one line and exits 75. Here:
`end_if_lost`, the training process's side (a collective that lost its peer: no traceback), and
`announce_exit`: a process that leaves on an error of its own (a failed save: status 4) says so
first, so that the others keep their own error.
"""

from __future__ import annotations

import os
import re
import select
import signal
import sys
import threading
import time
from collections.abc import Callable

from jaxtron import lifecycle
from jaxtron.config import ConfigError
from jaxtron.program import xla_flags

# A process whose heartbeats stop for run.peer_timeout_s / 2 is dead (JAX's heartbeat timeout).
# JAX's default (100 s) leaves a job hanging for minutes; heartbeats come from a C++ thread, so a
# busy or compiling process still sends them; 30 s also rides out network trouble.
PEER_TIMEOUT_S = 60  # config.RunConfig.peer_timeout_s's default
# How long processes that finished wait at exit for the others. Every step, and the last
# checkpoint's commit, is synchronous across processes, so healthy processes end within seconds of
# each other; a longer wait means a peer stopped early (an exception) and is waiting for nothing.
SHUTDOWN_TIMEOUT_S = 30
# How long processes wait for each other to start (JAX's default): big jobs start slowly.
INIT_TIMEOUT_S = 300
STOPPED = 75  # a signal while joining: `jaxtron train`'s status for a stop before training started
LOST_PEER = lifecycle.EXIT_LOST_PEER  # another process was lost: 75, restartable
SUPERVISED = "JAXTRON_SUPERVISOR"  # in a training process's environment: its supervisor's pid

_ADDRESS = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")  # host:port, [v6]:port

# The variables JAX's own detection reads (jax/_src/clusters): process count, this process's rank,
# and what else it needs to find process 0.
CLUSTERS = {
    "Slurm": ("SLURM_NTASKS", "SLURM_PROCID",
              ("SLURM_JOB_ID", "SLURM_STEP_NODELIST", "SLURM_LOCALID")),
    "Open MPI": ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", ("OMPI_MCA_orte_hnp_uri",)),
}


def cluster_processes() -> tuple[str, int, int]:
    """(cluster manager, process count, this process's rank) when Slurm or Open MPI started
    several processes here; ("", 1, 0) otherwise."""
    for name, (count_var, rank_var, needed) in CLUSTERS.items():
        count = os.environ.get(count_var, "1")
        if not count.isdigit():
            raise ConfigError(f"{count_var}={count} is not a number of processes")
        if int(count) <= 1:
            continue
        missing = [var for var in (rank_var, *needed) if var not in os.environ]
        if missing:
            raise ConfigError(
                f"{count_var}={count} but {', '.join(missing)} unset, so JAX cannot find the other "
                f"processes ({name}: launch with srun/mpirun); or pass --coordinator HOST:PORT "
                "--num-processes N --process-id I")
        return name, int(count), int(os.environ.get(rank_var, "0"))
    return "", 1, 0


def add_flags(parser) -> None:
    """The flags that join several processes without a cluster manager (`jaxtron train`, tools)."""
    parser.add_argument("--coordinator", metavar="HOST:PORT",
                        help="several processes: process 0's address and a free port there")
    parser.add_argument("--num-processes", type=int, metavar="N",
                        help="several processes: how many (with --coordinator and --process-id)")
    parser.add_argument("--process-id", type=int, metavar="I",
                        help="several processes: this one's index, 0..N-1")


def check_flags(coordinator: str | None, num_processes: int | None,
                process_id: int | None) -> None:
    """The three launch flags come together, with a host:port and a process id in range."""
    given = {"--coordinator": coordinator, "--num-processes": num_processes,
             "--process-id": process_id}
    missing = [flag for flag, value in given.items() if value is None]
    if missing:
        raise ConfigError(f"{', '.join(missing)} missing: --coordinator, --num-processes and "
                          "--process-id go together (or none, for one process or Slurm/Open MPI)")
    match = _ADDRESS.match(coordinator)
    if match is None or not 0 < int(match.group(2)) < 65536:
        raise ConfigError(f"--coordinator={coordinator} is not HOST:PORT (e.g. 10.0.0.1:1234, "
                          "the address of process 0 and a free port there)")
    if num_processes < 1:
        raise ConfigError(f"--num-processes={num_processes} must be at least 1")
    if not 0 <= process_id < num_processes:
        raise ConfigError(f"--process-id={process_id} must be in 0..{num_processes - 1}")


def initialize(coordinator: str | None, num_processes: int | None, process_id: int | None,
               peer_timeout_s: int = PEER_TIMEOUT_S) -> None:
    """Join the run's other processes: from the flags, else from Slurm/Open MPI, else do nothing.
    A process silent for half of `peer_timeout_s` is lost (JAX's heartbeat timeout)."""
    if (coordinator, num_processes, process_id) == (None, None, None):
        cluster, count, rank = cluster_processes()
        if count == 1:
            return
        where = f"the {count} {cluster} processes"
    else:
        check_flags(coordinator, num_processes, process_id)
        rank, where = process_id, f"{num_processes} processes at {coordinator}"
    import jax

    timeout = join_timeout()
    if rank == 0:
        print(f"jax.distributed: waiting up to {timeout:g} s for {where}", flush=True)
    joined = _give_up_after(timeout, where, manual=coordinator is not None)
    try:
        jax.distributed.initialize(  # JAX's own timeout, later, ends in a C++ abort (134)
            coordinator, num_processes, process_id, initialization_timeout=int(timeout) + 60,
            heartbeat_timeout_seconds=max(peer_timeout_s // 2, 2),
            shutdown_timeout_seconds=SHUTDOWN_TIMEOUT_S,
        )
    finally:
        joined()
    devices = xla_flags.start_backend()  # a backend that cannot start: one line, not a trace
    if jax.process_index() == 0:
        print(joined_summary(devices, peer_timeout_s), flush=True)


def check_same_config(text: str) -> None:
    """Every process was given the same resolved config (`text`, its YAML): else a ConfigError on
    each, naming the fields in which the first that differs differs from process 0. Processes
    that differ part at some step and wait for each other for ever (train.steps), or fail in a
    mismatched collective (model.num_layers)."""
    import jax
    import yaml

    if jax.process_count() == 1:
        return
    texts = allgather_text(text)
    other = next((i for i, t in enumerate(texts) if t != texts[0]), None)
    if other is None:
        return
    me = jax.process_index()
    theirs = texts[0] if me else texts[other]
    here, there = (_flat(yaml.safe_load(t)) for t in (text, theirs))
    where = f"process {0 if me else other}"
    changed = [f"{key}={here.get(key)} here, {there.get(key)} on {where}"
               for key in sorted(set(here) | set(there)) if here.get(key) != there.get(key)]
    jax.distributed.shutdown()  # every process is here: leave together, none aborts another
    raise ConfigError(f"this process ({me}) was given another config than {where}: "
                      f"{'; '.join(changed[:3]) or 'its text differs'}; give every process "
                      "the same --config files and overrides")


def allgather_text(text: str) -> list[str]:
    """Every process's `text`, in process order (a collective)."""
    import numpy as np
    from jax.experimental import multihost_utils

    data = np.frombuffer(text.encode(), np.uint8)
    longest = int(multihost_utils.process_allgather(np.array([data.size], np.int32)).max())
    padded = np.zeros(max(longest, 1), np.uint8)
    padded[:data.size] = data
    rows = multihost_utils.process_allgather(padded)
    return [bytes(row).rstrip(b"\0").decode() for row in rows]


def _flat(tree: dict, prefix: str = "") -> dict:
    """{'train': {'steps': 6}} -> {'train.steps': 6}."""
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def join_timeout(environ=os.environ) -> float:
    """Seconds the processes wait for each other to join: JAXTRON_JOIN_TIMEOUT_S, else
    INIT_TIMEOUT_S."""
    text = environ.get("JAXTRON_JOIN_TIMEOUT_S", "").strip()
    try:
        value = float(text) if text else INIT_TIMEOUT_S
    except ValueError:
        value = -1
    if not 0 < value < float("inf"):
        raise ConfigError(f"JAXTRON_JOIN_TIMEOUT_S={text} must be a number of seconds above 0")
    return value


def _give_up_after(timeout: float, where: str, manual: bool) -> Callable[[], None]:
    """While the processes join (C++ waits, no Python signal handler runs): one line if they have
    not all joined within `timeout`, before JAX's own timeout aborts from C++ with a stack; exit
    status 2 with --coordinator's flags (a process never started, two given one --process-id),
    1 in a Slurm or MPI job (a node late or down: its script restarts it). A SIGINT/SIGTERM/SIGHUP
    meanwhile stops it at once, as at start-up: exit 75, nothing to save. Returns what to call
    (from the main thread) once they joined."""
    joined = threading.Event()
    read, write = os.pipe()
    os.set_blocking(write, False)
    previous = signal.set_wakeup_fd(write)  # the C signal handler writes the signal here
    fix = ("start every process with the same --coordinator and --num-processes and its own "
           "--process-id (0 to N-1)" if manual else "check that every task of the job started")

    def stop(line: str, status: int) -> None:
        print(f"{lifecycle.script_name()}: {line}", file=sys.stderr, flush=True)
        os._exit(status)

    def watch() -> None:
        deadline = time.monotonic() + timeout
        while not joined.is_set():
            if (left := deadline - time.monotonic()) <= 0:
                stop(f"error: {where} did not all join within {timeout:g} s; {fix}, or wait "
                     "longer with JAXTRON_JOIN_TIMEOUT_S", 2 if manual else 1)
            if select.select([read], [], [], min(left, 0.2))[0] and not joined.is_set():
                if os.read(read, 1)[0] in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                    stop("stopped by a signal while the processes joined (nothing to save); run "
                         "the same command to start", STOPPED)
        os.close(read)

    def done() -> None:
        joined.set()
        signal.set_wakeup_fd(previous)
        os.close(write)

    threading.Thread(target=watch, name="join-timeout", daemon=True).start()
    return done


def joined_summary(devices: list, peer_timeout_s: int = PEER_TIMEOUT_S) -> str:
    """One line: how many processes joined and which devices each brought."""
    by_process: dict[int, list[int]] = {}
    for device in devices:
        by_process.setdefault(device.process_index, []).append(device.id)
    shown = list(by_process.items())[:8]
    parts = [f"process {p}: {_ids(ids)}" for p, ids in shown]
    if len(by_process) > len(shown):
        parts.append(f"... {len(by_process) - len(shown)} more")
    return (f"jax.distributed: {len(by_process)} processes joined, {len(devices)} "
            f"{devices[0].device_kind} devices ({'; '.join(parts)}); a lost process stops the "
            f"others within {peer_timeout_s} s (run.peer_timeout_s)")


def _ids(ids: list[int]) -> str:
    """Device ids, a contiguous run written first-last."""
    ids = sorted(ids)
    if len(ids) > 2 and ids == list(range(ids[0], ids[-1] + 1)):
        return f"devices {ids[0]}-{ids[-1]}"
    return "devices " + ",".join(map(str, ids))


# --- A lost process: the supervisor (see the module's docstring) ---------------------------------

# What a collective or the coordination service says when another process is gone.
_LOST = re.compile(r"Gloo .*failed|NCCL|[Cc]onnection (reset|closed|refused)|[Bb]roken pipe|"
                   r"heartbeat|coordination service|UNAVAILABLE|DEADLINE_EXCEEDED")
_LEFT = "jaxtron/left_on_error/"  # key-value store: the processes that left on their own error
_MARK = "(lost peer): "  # end_if_lost's line, which the supervisor keeps for the log


def end_if_lost(error: BaseException) -> None:
    """A collective that failed because another process is gone (several processes), or an
    error it caused (a checkpoint's save): one line, no traceback, then exit LOST_PEER;
    supervised, first wait for JAX's coordination service to name the process (it aborts this
    one; the supervisor says it, or ends the wait). Returns for any other error."""
    import jax

    if not jax.distributed.is_initialized() or (text := _lost_collective(error)) is None:
        return
    if _ask_coordinator(lambda client: client.key_value_dir_get(_LEFT)):
        return  # a process left on an error of its own (its line says it): not a lost one
    first = text.strip().splitlines()[0] if text.strip() else "JaxRuntimeError"
    print(f"{lifecycle.script_name()}: error: a collective with another process failed "
          f"{_MARK}{first}; rerun the same command to resume", file=sys.stderr, flush=True)
    if os.environ.get(SUPERVISED):
        while True:
            time.sleep(60)
    sys.stdout.flush()
    os._exit(LOST_PEER)


def announce_exit(status: int) -> None:
    """Before this process leaves the others on an error of its own (its line is out): tell
    them, so that their collectives failing with it are not taken for a lost process."""
    import jax

    if jax.distributed.is_initialized():
        _ask_coordinator(lambda client: client.key_value_set(
            f"{_LEFT}{jax.process_index()}", str(status), allow_overwrite=True))


def _ask_coordinator(request: Callable, timeout_s: float = 2.0):
    """request(client) on the coordination service's key-value store (Orbax uses the same
    client); None when it fails or takes longer than `timeout_s` (process 0 gone or frozen)."""
    from jax._src import distributed as jax_distributed

    client, answer = jax_distributed.global_state.client, []
    if client is None:
        return None

    def ask() -> None:
        try:
            answer.append(request(client))
        except Exception:  # noqa: BLE001 - no answer is the answer
            pass

    thread = threading.Thread(target=ask, name="coordinator", daemon=True)
    thread.start()
    thread.join(timeout_s)
    return answer[0] if answer else None


def _lost_collective(error: BaseException | None) -> str | None:
    """The message of the JaxRuntimeError naming a lost connection that is `error` or, through
    its causes and contexts, led to it (Checkpoints wraps one in CheckpointSaveError)."""
    for _ in range(8):
        if error is None:
            return None
        if type(error).__name__ == "JaxRuntimeError" and _LOST.search(str(error)):
            return str(error)
        error = error.__cause__ or error.__context__
    return None
