"""The supervisor of a multi-process run's training process: a lost peer in one line, status 75.

When another process of the run is lost, JAX's coordination service ends every process from C++
(LOG(FATAL): 30 lines and a stack, status 134); nothing in the training process can stop that or
change its status (jaxtron/train/distributed.py says why). So each multi-process `jaxtron train`
trains in a child process and supervises it (`supervise`): it passes the child's stdout through,
reads its stderr, keeps the runtime's error and fatal lines off the terminal (into
run.dir/logs/process_<i>.err), and when the child ends on the runtime's abort or on a collective
that lost its peer (distributed.end_if_lost), prints one line naming the lost process (and its
host, which it adds to run.dir/bad_hosts: jaxtron/train/bad_hosts.py) and exits 75; it kills a
child still alive run.peer_timeout_s after the first sign. Any other ending passes through
unchanged.

The pair behaves as one process: killing the supervisor kills the child (PR_SET_PDEATHSIG);
SIGTERM, SIGINT and SIGHUP are forwarded to the child, which has a process group of its own (a
terminal's Ctrl-C reaches it once); and a supervisor that is stopped (SIGSTOP, SIGTSTP: a frozen
process, Ctrl-Z) stops the child too, and continues it when it is continued (`follow_parent`).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from jaxtron import lifecycle
from jaxtron.train import bad_hosts
from jaxtron.train.distributed import _MARK, LOST_PEER, SUPERVISED
from jaxtron.train.watchdog import STUCK_MARK

FOLLOW_S = 0.2  # how often the training process looks whether its supervisor is stopped

# A runtime log line (absl): level, date, time, thread, file:line]
_LOG_LINE = re.compile(r"^([IWEF])\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ ([\w.-]+):\d+\]")
# JAX's coordination service, its client, and the preemption notices that go through it.
_RUNTIME_FILES = ("coordination_service", "client.h", "preemption_sync_manager")
# Who: "Task 1 heartbeat timeout", "unhealthy (stopped sending heartbeats):\n1"; else process 0,
# the coordination service's, if this process's RPCs to it failed (killed: refused; frozen: timed
# out heartbeats).
_LOST_TASK = re.compile(r"Task (\d+) heartbeat timeout|stopped sending heartbeats\):\s*(\d+)")
_LOST_LEADER = re.compile(r"Failed to send RPC to coordination service|"
                          r"CoordinationService/Heartbeat")

def follow_parent() -> None:
    """In a supervised training process: end when the supervisor ends (kill -9 included; the
    kernel does it: PR_SET_PDEATHSIG, Linux only), and stop while it is stopped (a frozen
    process of the run is frozen whole: its heartbeats stop, and the others notice)."""
    import ctypes

    parent = os.environ.get(SUPERVISED, "")
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if str(os.getppid()) != parent:  # it ended before prctl
        os._exit(1)
    threading.Thread(target=_stop_with, args=(int(parent),), name="follow-parent",
                     daemon=True).start()


def _state(pid: int) -> str:
    """A process's state letter from /proc ('T': stopped), '' when it is gone or unknown."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _stop_with(parent: int) -> None:
    """Stop this process whenever `parent` is stopped; the supervisor continues it when it is
    continued (its SIGCONT is forwarded: supervise)."""
    while True:
        if _state(parent) == "T":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(FOLLOW_S)


class _Stderr:
    """The training process's stderr, line by line: passed to the terminal, except the runtime's
    warning and error lines (from the coordination service and its client), everything after a
    fatal one, and end_if_lost's line, which are kept (for the log and the verdict). The
    watchdog's line is the process's own verdict: always passed on."""

    def __init__(self):
        self.kept: list[str] = []
        self.first_sign: float | None = None  # when the first kept error line came
        self.collective_failed = False
        # the process said that the run made no progress (jaxtron/train/watchdog.py)
        self.stuck = False
        self.fatal = False
        self.runtime_fatal = False  # the coordination client ended the process (LOG(FATAL))
        self._runtime = False  # in a kept runtime message's continuation lines
        self._sign = False  # ... of an error or a fatal one (a warning is no sign of a lost peer)

    def take(self, line: str) -> str | None:
        """The line to pass on, or None to keep it."""
        logged = _LOG_LINE.match(line)
        if logged:
            level = logged.group(1)
            self._runtime = level in "WEF" and logged.group(2).startswith(_RUNTIME_FILES)
            self._sign = self._runtime and level in "EF"
            self.fatal = self.fatal or level == "F"
            self.runtime_fatal = self.runtime_fatal or (self._runtime and level == "F")
        if STUCK_MARK in line:  # even after a fatal line: the supervisor adds none of its own
            self.stuck = True
            return line
        keep = (self.fatal or self._runtime or _MARK in line
                or line.startswith("*** Check failure"))
        if _MARK in line:
            self.collective_failed = True
        if not keep:
            return line
        self.kept.append(line)
        if self.first_sign is None and (self._sign or self.collective_failed):
            self.first_sign = time.monotonic()
        return None

    def lost_process(self) -> int | None:
        """The process the runtime names as lost, if it does."""
        text = "".join(self.kept)
        if match := _LOST_TASK.search(text):
            return int(match.group(1) or match.group(2))
        return 0 if _LOST_LEADER.search(text) else None


def supervise_launch(args, configs: list) -> int | None:
    """`jaxtron train`'s training run of several processes trains in a child process that this one
    supervises: the child's exit status. None: train here (one process, a plan, or the child
    itself; a config error is said by the run, as without several processes)."""
    from jaxtron.config import ConfigError, load
    from jaxtron.train import distributed

    if args.dry_run or args.compile_for or os.environ.get(SUPERVISED):
        return None
    try:
        _, count, rank = distributed.cluster_processes()
        if args.coordinator is not None or args.num_processes is not None:
            distributed.check_flags(args.coordinator, args.num_processes, args.process_id)
            count, rank = args.num_processes, args.process_id
        cfg = load(configs, args.overrides)
    except ConfigError:
        return None
    if count == 1:
        return None
    return supervise([sys.executable, *sys.orig_argv[1:]], rank, count, Path(cfg.run.dir),
                     cfg.run.peer_timeout_s)


def supervise(command: list[str], process_id: int, num_processes: int, run_dir: Path,
              peer_timeout_s: int) -> int:
    """Run `command` (this `jaxtron train`, again) as the training process and return its exit
    status; LOST_PEER with one line when it ended because another process was lost (see the
    module's docstring)."""
    # Its own process group: a terminal's Ctrl-C, or a signal to this process's group, reaches
    # it once, forwarded from here.
    child = subprocess.Popen(command, env={**os.environ, SUPERVISED: str(os.getpid())},
                             stderr=subprocess.PIPE, process_group=0)
    # SIGCONT: this process goes on after a stop, which the child followed (follow_parent).
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGCONT):
        signal.signal(sig, lambda signum, frame: child.send_signal(signum))
    stderr = _Stderr()
    reader = threading.Thread(target=_pass_on, args=(child.stderr, stderr), daemon=True)
    reader.start()
    killed = False
    while child.poll() is None:
        if stderr.first_sign and time.monotonic() - stderr.first_sign > peer_timeout_s:
            child.kill()  # past the bound: JAX never named the process
            killed = True
        time.sleep(0.2)
    reader.join(10)
    status = child.returncode
    aborted = status == -signal.SIGABRT and stderr.runtime_fatal
    if stderr.stuck:  # its line is out; the runtime's that followed are kept for the log
        _keep_log(run_dir, process_id, stderr.kept, "no progress")
        return LOST_PEER
    if not (killed or aborted or stderr.collective_failed):
        if stderr.fatal:  # not the coordination service's: shown as it came
            sys.stderr.write("".join(stderr.kept))
        else:
            _keep_log(run_dir, process_id, stderr.kept, f"exit status {status}")
        return 128 - status if status < 0 else status
    _keep_log(run_dir, process_id, stderr.kept, "lost peer")
    lost = stderr.lost_process()
    line = _lost_line(lost, num_processes, run_dir, _mark_bad(run_dir, lost))
    print(f"{lifecycle.script_name()}: error: {line}", file=sys.stderr, flush=True)
    return LOST_PEER


def _pass_on(stream, stderr: _Stderr) -> None:
    """Copy the child's stderr to ours, line by line, through `stderr`."""
    for raw in iter(stream.readline, b""):
        line = stderr.take(raw.decode(errors="replace"))
        if line is not None:
            try:
                sys.stderr.write(line)
                sys.stderr.flush()
            except (OSError, ValueError):  # nobody reads it any more: the run goes on
                pass


def _keep_log(run_dir: Path, process_id: int, lines: list[str], why: str) -> None:
    """The kept lines, for a closer look: run_dir/logs/process_<i>.err (appended)."""
    if not run_dir.is_dir() or not lines:
        return
    try:
        (run_dir / "logs").mkdir(exist_ok=True)
        with (run_dir / "logs" / f"process_{process_id}.err").open("a") as f:
            f.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')}: {why}\n{''.join(lines)}")
    except OSError:
        pass


def _mark_bad(run_dir: Path, lost: int | None) -> str | None:
    """The lost process's host, added to run_dir/bad_hosts (the Slurm script restarts without
    it); None when the runtime did not name the process or hosts.json does not name its host.
    Every surviving process adds it: bad_hosts.read gives it once."""
    host = None if lost is None else bad_hosts.host_of(run_dir, lost)
    if host is not None:
        bad_hosts.add(run_dir, host, f"process {lost} stopped answering")
    return host


def _lost_line(lost: int | None, num_processes: int, run_dir: Path,
               host: str | None = None) -> str:
    """'process 1 of 2 (host node7) stopped answering (lost peer) after step 7; the last
    checkpoint, step 6, is intact: rerun the same command to resume'."""
    from jaxtron.checkpoint import weights

    notes = ["the coordinator"] if lost == 0 else []
    notes += [f"host {host}"] if host else []
    who = (f"another process of {num_processes}" if lost is None else
           f"process {lost} of {num_processes}" + (f" ({', '.join(notes)})" if notes else ""))
    step = _last_logged_step(run_dir / "metrics.jsonl")
    after = f" after step {step}" if step else ""
    try:
        saved = weights.complete_steps(run_dir / "checkpoints")
    except OSError:
        saved = []
    newest = int(saved[-1].name) if saved else None
    kept = (f"the last checkpoint, step {newest}, is intact" if saved else
            "no checkpoint was saved yet")
    from jaxtron.train.local_tier import newest_here  # imports jax: only on this way out

    local = newest_here(run_dir)
    if local is not None and (newest is None or local > newest):
        return (f"{who} stopped answering (lost peer){after}; {kept}, and this host holds local "
                f"checkpoint {local} (checkpoint.local_dir): rerun the same command to resume "
                "from the newest one every host can read")
    again = "resume" if saved else "start"
    return f"{who} stopped answering (lost peer){after}; {kept}: rerun the same command to {again}"


def _last_logged_step(metrics: Path) -> int | None:
    """The step of the last row in metrics.jsonl (process 0 writes it), if any."""
    import json

    try:
        lines = metrics.read_text().splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        try:
            return int(json.loads(line)["step"])
        except (ValueError, KeyError, TypeError):
            continue
    return None
