"""One run at a time in a run.dir: an advisory lock held for the run's lifetime by process 0."""

from __future__ import annotations

import fcntl
import os
import socket
from pathlib import Path

from jaxtron.config import ConfigError

LOCK_FILE = ".jaxtron-run.lock"  # run.dir/<this>: flock'ed by the run's process 0 while it runs
IN_USE = "run.dir {} is in use by another run ({}); wait for it or choose another run.dir"


class RunDirLock:
    """An advisory lock on run.dir held for a run's lifetime by its process 0, so that a second
    run into the same run.dir is refused before it writes anything. flock: the kernel drops the
    lock when the process ends however it ends, so a killed run's lock file blocks nothing."""

    def __init__(self, run_dir: Path):
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / LOCK_FILE
        self.file = open(path, "a+")  # noqa: SIM115 - held open for the run's lifetime
        try:
            fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self.file.seek(0)
            holder = self.file.read().strip() or "pid ? on host ?"
            self.file.close()
            raise ConfigError(IN_USE.format(run_dir, holder)) from None
        self.file.truncate(0)
        self.file.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
        self.file.flush()

    def release(self) -> None:
        """Let the next run in (idempotent)."""
        if not self.file.closed:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
