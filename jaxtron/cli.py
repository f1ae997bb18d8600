"""What every command line shares: bad input ends in one line on stderr and exit status 2, never a
traceback; other expected failures end the same way with their own status. Every such line reads
`<script>: error: <message>` (argparse's own form), <script> the command's file name."""

from __future__ import annotations

import _thread
import argparse
import gc
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from jaxtron.config import ConfigError

EXIT_USAGE = 2  # bad input: the line says what to change
EXIT_STOPPED = 130  # stopped by Ctrl-C or SIGTERM: 128 + SIGINT, what a shell shows for Ctrl-C
PARENT_POLL_S = 0.2  # how often a worker looks whether its parent is still there
# What Python itself does with Ctrl-C and SIGTERM, which one_line_errors takes over.
_PYTHON_HANDLERS = {signal.SIGINT: signal.default_int_handler, signal.SIGTERM: signal.SIG_DFL}
REDELIVER_S = 0.01  # a signal that landed in a garbage-collection callback comes again this late
# The running command's file name (launch.py, plan.py), set by its Parser: a command called
# in-process (tests call main()) is named as it is from a shell, where sys.argv[0] names it.
_script = ""


def script_name() -> str:
    """The running command's file name, which its error lines start with."""
    return _script or Path(sys.argv[0]).name


def one_line_errors(run: Callable[[], int | None],
                    statuses: dict[type[BaseException], int] | None = None) -> int:
    """run()'s exit status; a ConfigError (status 2), or an exception of a type in `statuses`,
    becomes one line `<script>: error: <message>` on stderr and that status. Ctrl-C or SIGTERM
    becomes one line `<script>: stopped by a signal` and status 130, unless the command handles
    its signals itself (launch.py, prepare_data.py: their KeyboardInterrupt goes back to them)."""
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
    """Whether the command installed a SIGINT handler of its own, which says what a stop means."""
    handler = signal.getsignal(signal.SIGINT)
    return callable(handler) and handler not in (signal.default_int_handler, _raise_stop)


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


def _as_command() -> bool:
    """Whether the running command was started as a file from a shell (its Parser's name is
    __main__'s), not called in-process (tests call main()), in the main thread."""
    main_file = getattr(sys.modules["__main__"], "__file__", None) or ""
    return (bool(_script) and Path(main_file).name == _script
            and threading.current_thread() is threading.main_thread())


def ignore_signals_when_done() -> bool:
    """A command run from a shell whose outcome is decided (its line is out, its status known)
    ignores SIGINT and SIGTERM from here on: one during the interpreter's exit (jax's clean-up
    takes a moment) would end it with -2 or a traceback after the line. Whether it did so (a
    command called in-process keeps its handlers)."""
    if not _as_command():
        return False
    for sig in (signal.SIGINT, signal.SIGTERM):
        if signal.getsignal(sig) is not None:  # None: a handler not set from Python; left so
            signal.signal(sig, signal.SIG_IGN)
    return True


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line naming the command's --help, and exit status 2.
    `command` is how to run it ('tools/plan.py'; a subcommand's adds its name)."""

    def __init__(self, *args, command: str, **kwargs):
        global _script
        _script = Path(command.split()[0]).name
        kwargs.setdefault("prog", _script)  # what a shell would show, in-process too
        super().__init__(*args, **kwargs)
        self.command = command

    def error(self, message: str):
        print(f"{script_name()}: error: {message} (see python {self.command} --help)",
              file=sys.stderr)
        sys.exit(EXIT_USAGE)


def writable_file(path: str | Path, what: str = "") -> Path:
    """`path` as a file the command can write, checked before the work that produces it (a long
    compile, a benchmark), not after; a ConfigError naming `what` (e.g. '--out') otherwise. An
    existing file is left as it is; a probe file is removed again."""
    target = Path(path)
    name = f"{what} {path}" if what else str(path)
    if target.is_dir():
        raise ConfigError(f"{name} is a directory; name a file")
    if not target.parent.is_dir():
        missing = next(p for p in (target.parent, *target.parent.parents) if not p.is_dir())
        if missing.exists():
            raise ConfigError(f"{name}: {missing} is a file, not a directory")
        raise ConfigError(f"{name}: directory {missing} does not exist; create it first")
    existed = target.exists()
    try:
        target.touch()
    except OSError as e:
        raise ConfigError(f"cannot write {name}: {e.strerror}") from None
    if not existed:
        target.unlink()  # nothing empty left behind if the work fails
    return target


def check_run_dir(path: str, key: str = "run.dir") -> None:
    """run.dir (or the directory config key `key` names) is, or can become, a directory this
    process can write in: a ConfigError naming the fix otherwise. Creates nothing (a probe file
    in the nearest existing parent is removed again)."""
    if not str(path).strip():
        raise ConfigError(f"{key} is empty; name a directory (e.g. {key}=runs/NAME)")
    target = Path(path)
    try:
        is_file = target.exists() and not target.is_dir()
    except OSError as e:  # a name longer than the filesystem allows
        raise ConfigError(f"{key}={path} cannot be used ({e.strerror}); choose a shorter "
                          "path") from None
    if is_file:
        raise ConfigError(f"{key}={path} is a file; set {key} to a directory (a new one, or "
                          "a run to resume)")
    if key == "run.dir" and target.is_dir():
        _check_is_a_run(target, path)
    existing = target
    while not existing.exists():
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, "Not a directory")
        probe = existing / f".jaxtron-write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{key}={path} cannot be written ({e.strerror}); choose a directory "
                          "you can write") from None


RUN_FILES = ("config.yaml", "checkpoints", "metrics.jsonl", "goodput.json")  # what a run writes


def _check_is_a_run(directory: Path, path: str) -> None:
    """A run.dir that holds files but no run's (a source tree, a dataset) is not written into."""
    names = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
    if names and not any(name in RUN_FILES for name in names):
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ConfigError(f"run.dir={path} holds other files ({shown}) and no run; set run.dir to "
                          "a new or empty directory, or to a run to resume")


def check_counts(args: argparse.Namespace, **least: int) -> None:
    """Each named option of `args` (attribute=its minimum) at least its minimum: else a
    ConfigError naming the first that is not, as given (`--top -3 must be at least 1`). Options
    left at None (not given) pass."""
    for name, minimum in least.items():
        value = getattr(args, name)
        if value is not None and value < minimum:
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be at least {minimum}")


def plural(n: int, noun: str) -> str:
    """'1 device', '8 devices'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"



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
