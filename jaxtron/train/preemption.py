"""SIGTERM, SIGINT and SIGHUP as a flag the training loop reads at step boundaries."""

from __future__ import annotations

import signal
import threading

import jax
from jax.experimental import multihost_utils


class Preemption:
    """SIGTERM/SIGINT/SIGHUP -> a flag the loop reads at step boundaries. Under jax.distributed
    JAX's own notifier owns SIGTERM and its sync point makes every process stop at the same step."""

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "Preemption":
        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # HUP: the terminal closed
                previous = signal.getsignal(sig)
                if previous == signal.SIG_IGN:  # nohup, a background job: the user's choice
                    continue
                self._previous[sig] = signal.signal(sig, self._handle)
                if getattr(previous, "signalled", None):  # launch.py's, during start-up
                    self.signal = previous.signalled[0]
        return self

    def _handle(self, signum, frame) -> None:
        self.signal = signum

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def before_training(self) -> None:
        """Before the first step there is nothing new to save: a signal stops the start now
        (KeyboardInterrupt: exit 75, rerun to start) rather than after a compile and a step."""
        if self.signal is not None:
            raise KeyboardInterrupt

    def requested(self, step: int) -> bool:
        if jax.process_count() > 1:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.signal is not None
