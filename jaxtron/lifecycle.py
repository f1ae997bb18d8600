"""A command's life from start to exit: signals, preemption, exit statuses and what reaches
stderr. Bad input ends in one line on stderr and exit status 2, never a traceback; other expected
failures end the same way with their own status. Every such line reads
`<script>: error: <message>` (argparse's own form), <script> the command's file name.

While a command imports (jax takes a second or two), SIGINT and SIGTERM are only recorded: a
KeyboardInterrupt raised inside an import is a traceback, or an extension's ImportError.
`jaxtron train`'s recorder (jaxtron/__init__.py's, SIGHUP too, from jaxtron's first import; taken
over by jaxtron/commands/train.py: a signal then stops start-up with 75, read by Preemption);
tools/_environment.py's (which launch.py and the tools import first) runs before jaxtron imports;
the `jaxtron` command's is start_command's. take_over_signals reads the latter two."""

from __future__ import annotations

import _thread
import atexit
import contextlib
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from jaxtron.config import ConfigError

# Exit statuses, every command's (docs/faults.md has the table). 1 is an unexpected error (a
# traceback); `jaxtron train` keeps its own copy of 75, which it may return before this imports.
EXIT_USAGE = 2  # bad input: the line says what to change
EXIT_NONFINITE = 3  # train.on_nonfinite stopped the run; nothing new was saved
EXIT_SAVE_FAILED = 4  # a checkpoint that was due was not written; the run stopped there
EXIT_PREEMPTED = 75  # SIGTERM/SIGINT/SIGHUP: the current step was checkpointed; rerun to resume
EXIT_LOST_PEER = 75  # another process was lost: restartable as a preemption (Slurm requeues)
EXIT_STOPPED = 130  # stopped by Ctrl-C or SIGTERM: 128 + SIGINT, what a shell shows for Ctrl-C
PARENT_POLL_S = 0.2  # how often a worker looks whether its parent is still there
# What Python itself does with Ctrl-C and SIGTERM, which one_line_errors takes over.
_PYTHON_HANDLERS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
REDELIVER_S = 0.01  # a signal that landed in a garbage-collection callback comes again this late
# The running command's name (launch.py, plan.py, `jaxtron plan`), set by its Parser or by
# start_command: a command called in-process (tests call main()) is named as it is from a shell,
# where sys.argv[0] names it.
_script = ""
_started = False  # start_command ran: this process is the command (`jaxtron NAME`)


def name_command(name: str) -> None:
    """The running command's file name (its Parser says it): what its error lines start with."""
    global _script
    _script = name


def start_command(name: str | None) -> None:
    """This process runs a command of jaxtron.commands, as `name` (`jaxtron plan`; None: as
    sys.argv[0] says, a shim of tools/ whose own recorder is in place). Until the command takes
    its signals over, SIGINT and SIGTERM that Python handles as usual are recorded."""
    global _started
    _started = True
    if name:
        name_command(name)
    for sig, default in _PYTHON_HANDLERS.items():
        if signal.getsignal(sig) == default:  # nohup's SIG_IGN stays, as does a recorder
            signal.signal(sig, _record)


def _record(signum, frame) -> None:
    _record.signalled.append(signum)


_record.signalled = []
_record.startup_recorder = True  # what take_over_signals looks for


def invoked_as() -> str:
    """How the running command was started when start_command named it (`jaxtron plan`), else
    ""."""
    return _script if _started and " " in _script else ""


def script_name() -> str:
    """The running command's file name, which its error lines start with."""
    return _script or Path(sys.argv[0]).name


def one_line_errors(run: Callable[[], int | None],
                    statuses: dict[type[BaseException], int] | None = None) -> int:
    """run()'s exit status; a ConfigError (status 2), or an exception of a type in `statuses`,
    becomes one line `<script>: error: <message>` on stderr and that status. Ctrl-C or SIGTERM
    becomes one line `<script>: stopped by a signal` and status 130, unless the command handles
    its signals itself (`jaxtron train`, prepare_data.py: their KeyboardInterrupt goes back to them;
    also where only its SIGTERM handler is in place, SIGINT ignored in a background job)."""
    handled = {ConfigError: EXIT_USAGE, **(statuses or {})}
    stopped_early = take_over_signals()
    own = _own_handler()
    previous = _stop_on_signals()
    try:
        if stopped_early:
            raise KeyboardInterrupt
        return run() or 0
    except BrokenPipeError:  # the reader went away (`| head`): stop quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit's flush
        return 0
    except KeyboardInterrupt:
        if _own_handler():
            raise
        return _stopped()
    except tuple(handled) as e:
        print(f"{script_name()}: error: {e}", file=sys.stderr)
        return next(code for kind, code in handled.items() if isinstance(e, kind))
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if not own:
            ignore_signals_when_done()


def take_over_signals() -> bool:
    """Python's own SIGINT and SIGTERM handling again where a command's start-up only recorded
    them (tools/_environment.py); whether a signal came meanwhile (the command then stops)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    stopped = False
    for sig, default in _PYTHON_HANDLERS.items():
        handler = signal.getsignal(sig)
        if getattr(handler, "startup_recorder", False):
            signal.signal(sig, default)
            stopped = stopped or bool(handler.signalled)
    return stopped


@contextlib.contextmanager
def signals_held(*signals: int) -> Iterator[None]:
    """`signals` blocked in this thread meanwhile, delivered when it ends: processes started
    meanwhile inherit the block (across exec), and keep it until they unblock them."""
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signals)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def deferred(signum: int, frame) -> bool:
    """Whether a signal handler was called inside a garbage-collection callback (jax runs one at
    every collection), where an exception is printed as "ignored" and dropped, the stop lost.
    The signal then comes again once the callback has returned, and the handler does nothing
    now. Handlers that raise KeyboardInterrupt ask this first."""
    callbacks = {getattr(callback, "__code__", None) for callback in gc.callbacks}
    while frame is not None:
        if frame.f_code in callbacks:  # again in 10 ms, from a thread: at once would land here
            later = threading.Timer(REDELIVER_S, _thread.interrupt_main, (signum,))
            later.daemon = True
            later.start()
            return True
        frame = frame.f_back
    return False


def _raise_stop(signum, frame) -> None:
    if not deferred(signum, frame):
        raise KeyboardInterrupt


def _stop_on_signals() -> dict:
    """Ctrl-C, and SIGTERM (kill, a batch system's end) as Ctrl-C, raise KeyboardInterrupt (also
    when they land in a garbage-collection callback); the handlers replaced, to restore. Left
    as they are: a command's own, an ignored one, any outside the main thread."""
    if threading.current_thread() is not threading.main_thread() or _own_handler():
        return {}
    return {sig: signal.signal(sig, _raise_stop) for sig, handler in _PYTHON_HANDLERS.items()
            if signal.getsignal(sig) == handler}


def _own_handler() -> bool:
    """Whether the command installed a SIGINT or SIGTERM handler of its own, which says what a
    stop means (`jaxtron train`: 75). Both are asked: a job a script starts in the background
    (`cmd &`) begins with SIGINT ignored, and its own handler is then on SIGTERM only."""
    return any(callable(handler) and handler not in (signal.default_int_handler, _raise_stop)
               for handler in map(signal.getsignal, _PYTHON_HANDLERS))


def _stopped() -> int:
    """One line for a stop by a signal. Run as a command, the process ends here (os._exit):
    a stop during a compile leaves XLA's threads working, and the interpreter's normal exit then
    crashes in them (status 139, after the line). Called in-process (tests), it returns 130."""
    command = ignore_signals_when_done()  # a second Ctrl-C cannot cut the line short
    print(f"{script_name()}: stopped by a signal", file=sys.stderr)
    if not command:
        return EXIT_STOPPED
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # the reader went away, or the stream was closed
            pass
    os._exit(EXIT_STOPPED)


def end_with_parent(*_) -> None:
    """In a worker process (prepare_data's pool, Grain's data workers; any arguments, as a
    worker_init_fn): a thread ends it within PARENT_POLL_S once its parent is gone (kill -9, the
    out-of-memory killer), instead of leaving it running, writing, holding memory. (The kernel's
    PR_SET_PDEATHSIG would kill it also at a normal exit, before it frees its shared memory.)"""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch, name="end-with-parent", daemon=True).start()


def quiet_worker(*_) -> None:
    """A data worker (Grain's worker_init_fn): Ctrl-C, which a terminal sends to every process of
    the job, and SIGTERM are its parent's to handle (the parent then stops it: a traceback per
    worker otherwise); it ends with its parent (end_with_parent)."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    end_with_parent()


def as_command() -> bool:
    """Whether the running command was started from a shell (by start_command, or as a file
    that its Parser names: launch.py), not called in-process (tests call main()), in the main
    thread."""
    main_file = getattr(sys.modules["__main__"], "__file__", None) or ""
    return ((_started or bool(_script) and Path(main_file).name == _script)
            and threading.current_thread() is threading.main_thread())


def ignore_signals_when_done() -> bool:
    """A command run from a shell whose outcome is decided (its line is out, its status known)
    ignores SIGINT and SIGTERM from here on: one during the interpreter's exit (jax's clean-up
    takes a moment) would end it with -2 or a traceback after the line. Whether it did so (a
    command called in-process keeps its handlers)."""
    if not as_command():
        return False
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not None:  # None: a handler not set from Python; left so
            signal.signal(sig, signal.SIG_IGN)
    return True


class _Unread:
    """A text stream that, once its reader has gone (`| head` exited, the terminal closed),
    sends the rest to /dev/null instead of raising into the work that is printing."""

    def __init__(self, stream):
        self._stream = stream

    def _guarded(self, method: str, *args):
        try:
            return getattr(self._stream, method)(*args)
        except OSError:  # BrokenPipeError; EIO from a terminal that hung up
            os.dup2(os.open(os.devnull, os.O_WRONLY), self._stream.fileno())
            return None

    def write(self, text: str):
        return self._guarded("write", text)

    def flush(self):
        return self._guarded("flush")

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def outlive_readers() -> None:
    """A long command (training) keeps working when nobody reads its output any more: the log
    goes on in the run directory, and a lost stdout or stderr is not an exception."""
    if not isinstance(sys.stdout, _Unread):
        sys.stdout, sys.stderr = _Unread(sys.stdout), _Unread(sys.stderr)


class Preemption:
    """SIGTERM/SIGINT/SIGHUP -> a flag the loop reads at step boundaries. Under jax.distributed
    JAX's own notifier owns SIGTERM and its sync point makes every process stop at the same step."""

    def __init__(self):
        self.signal: int | None = None
        self._previous: dict = {}

    def __enter__(self) -> "Preemption":
        import jax

        if jax.process_count() == 1 and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # HUP: the terminal closed
                previous = signal.getsignal(sig)
                if previous == signal.SIG_IGN:  # nohup, a background job: the user's choice
                    continue
                self._previous[sig] = signal.signal(sig, self._handle)
                if getattr(previous, "signalled", None):  # `jaxtron train`'s, during start-up
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
        import jax
        from jax.experimental import multihost_utils

        if jax.process_count() > 1:
            return multihost_utils.reached_preemption_sync_point(step)
        return self.signal is not None


def silence_at_exit() -> None:
    """Once the command's last line is out (a failed save or restore): what the interpreter
    prints while it shuts down (reads and writes in flight completing into a closed event loop)
    goes to /dev/null."""
    atexit.register(_silence)


def _silence() -> None:
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stderr.fileno())
