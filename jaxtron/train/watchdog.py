"""A bound on waiting for a peer that is alive but stuck (several processes).

A process that is killed, frozen or cut off stops sending heartbeats, and JAX's coordination
service ends the run (jaxtron/train/supervisor.py says it in one line). One that is alive but stuck
(a Python deadlock, storage that never answers, a collective that never completes) keeps sending
them, and the others wait for it in the step's collectives and in Orbax's barriers around restore
and save, which are collectives too: for ever on NCCL, for Gloo's own timeout on CPUs. So each
process watches its own progress: when the start-up's restore, or the loop (a step, a save, an
evaluation batch), makes none for run.stuck_timeout_s, it stops with one line and status 75, as
every other process of the run then does (they wait for it, or for each other); the newest
committed checkpoint is intact and the same command resumes.
"""

from __future__ import annotations

import os
import sys
import threading
import time

from jaxtron import lifecycle

STUCK = 75  # restartable: the same command resumes from the newest checkpoint
STUCK_MARK = "(run.stuck_timeout_s)"  # in the line: the supervisor adds no line of its own


class Watchdog:
    """`tick(what)` after each piece of progress; a thread ends the process once none came for
    `timeout_s` while armed (between `tick`s; `pause()` disarms it, for work of this process
    alone whose length has no bound here: compiling)."""

    def __init__(self, timeout_s: float, clock=time.monotonic):
        self.timeout_s, self.clock = timeout_s, clock
        self.last, self.doing = clock(), "starting"
        self.armed = False
        self._done = threading.Event()
        if timeout_s > 0:
            threading.Thread(target=self._watch, name="stuck-watchdog", daemon=True).start()

    def tick(self, doing: str) -> None:
        """Progress was made; next comes `doing` (said in the line if it never finishes)."""
        self.last, self.doing, self.armed = self.clock(), doing, True

    def pause(self) -> None:
        self.armed = False

    def close(self) -> None:
        self._done.set()

    def _watch(self) -> None:
        while not self._done.wait(min(self.timeout_s / 10, 5.0)):
            if self.armed and self.clock() - self.last > self.timeout_s:
                self._fire()

    def _fire(self) -> None:
        print(f"{lifecycle.script_name()}: error: no progress in {self.timeout_s:g} s while "
              f"{self.doing} {STUCK_MARK}: a process of the run is stuck, or waits for "
              "one that is; the newest checkpoint is intact: rerun the same command to resume",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(STUCK)
