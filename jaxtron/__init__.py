"""jaxtron: JAX/XLA SPMD training of Llama-family models on NVIDIA GPUs."""

import time

# When this process first imported jaxtron, before anything else here (importlib.metadata alone
# takes ~50 ms): where an attempt's start-up begins (jaxtron/train/goodput.py). launch.py imports
# jaxtron as it starts, so this is Python's start give or take some milliseconds; /proc's start
# of the pid is not, where a shell exec'ed python into it after other work (`pip install -e . &&
# python launch.py`).
STARTED = time.time()

import os  # noqa: E402
import sys  # noqa: E402


def _record(signum, frame) -> None:
    _record.signalled.append(signum)


_record.signalled = []
_record.startup_recorder = True  # what jaxtron.commands.train takes over, with what it recorded


def _record_stops_while_training_starts() -> None:
    """`jaxtron train` (launch.py, `python -m jaxtron.commands train`): from here on SIGINT,
    SIGTERM and SIGHUP are recorded until the command takes them over, and then stop its start
    with 75 (jaxtron/commands/train.py); jax imports next, a second or two, where a
    KeyboardInterrupt would be a traceback and SIGTERM or SIGHUP would kill it."""
    argv = sys.argv or [""]
    name = os.path.basename(argv[0])
    if name != "launch.py" and not (name in ("jaxtron", "-m", "__main__.py")
                                    and argv[1:2] == ["train"]):
        return
    import signal

    stops = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    for sig in stops:
        if signal.getsignal(sig) in (signal.SIG_DFL, signal.default_int_handler):
            signal.signal(sig, _record)  # nohup's SIG_IGN stays, as does a shim's recorder
    # A mask inherited across exec (a parent thread that blocked them) held a batch system's stop
    # pending for ever: the run went on and exited 0. One pending arrives now, and is recorded.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, stops)


_record_stops_while_training_starts()  # first: what follows imports jax

import importlib.metadata
import importlib.util
import re

# pyproject.toml's dependencies, by import name: a Python without them (the environment not
# activated) gets one line naming the fix, not a traceback from the first import that fails.
REQUIRED = ("jax", "flax", "optax", "orbax", "grain", "sentencepiece", "tokenizers", "omegaconf",
            "yaml", "tensorboardX", "tqdm", "numpy", "array_record", "pyarrow", "matplotlib")


def _release(package: str) -> tuple[int, ...]:
    """The installed `package`'s version as numbers (0.12.9 -> (0, 12, 9)); () when unknown."""
    try:
        version = importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return ()
    return tuple(int(part) for part in re.findall(r"\d+", version.split("+")[0])[:3])


# (jax, the first flax release that imports with it): each jax removed a class of
# jax.experimental.hijax that the flax releases before subclass (HiPrimitive)
FIRST_FLAX = {(0, 11): (0, 12, 9), (0, 12): (0, 12, 10)}


def mismatch() -> str:
    """What to change when the installed jax and flax cannot work together, else "". pip's
    resolver keeps them apart (pyproject.toml's ranges), but an install with --no-deps or
    --target can pair them."""
    jax, flax = _release("jax"), _release("flax")
    first = max((need for since, need in FIRST_FLAX.items() if jax >= since), default=())
    if () < flax < first:
        needed = ".".join(map(str, first))
        return (f"flax {'.'.join(map(str, flax))} does not work with jax "
                f"{'.'.join(map(str, jax))}; install flax {needed} or newer "
                f"(pip install 'flax>={needed},<0.13')")
    return ""


def _check_installed() -> None:
    missing = [name for name in REQUIRED if importlib.util.find_spec(name) is None]
    if missing:
        message = (f"this Python ({sys.executable}) lacks jaxtron's dependencies "
                   f"({', '.join(missing)}); activate its environment (. .venv/bin/activate) or "
                   "install them (pip install -e .)")
    else:
        message = mismatch()
    if not message:
        return
    script = os.path.basename(sys.argv[0]) if sys.argv else ""  # a command: a .py, `jaxtron`
    if not (script.endswith(".py") or script == "jaxtron"):  # imported by other code: raised
        raise (ModuleNotFoundError if missing else ImportError)(message)
    print(f"{script}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


_check_installed()

from jaxtron.program.xla_flags import load_plugins_quietly  # after the check above

load_plugins_quietly()  # before any command's first output (see its docstring)
