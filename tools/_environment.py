"""What each command of tools/ imports first when run: a Python that has not installed jaxtron (its
virtual environment not activated) gets one line naming the fix and exit status 2, as launch.py
does, not a ModuleNotFoundError traceback; jaxtron's own import then names any dependency this
Python lacks (jaxtron/__init__.py). SIGINT and SIGTERM are recorded from here on, until the
command (jaxtron/commands/) takes them over."""

import importlib.util
import signal
import sys
from pathlib import Path

if __name__ == "__main__":  # run by mistake: it is no command
    print("_environment.py: error: a module the commands of tools/ import, not a command; run "
          "one of them (python tools/plan.py --help)", file=sys.stderr)
    sys.exit(2)

if importlib.util.find_spec("jaxtron") is None:
    print(f"{Path(sys.argv[0]).name}: error: this Python ({sys.executable}) lacks jaxtron; "
          "activate its environment (. .venv/bin/activate) or install it (pip install -e .)",
          file=sys.stderr)
    sys.exit(2)



def _record(signum, frame) -> None:
    """Ctrl-C or SIGTERM while the command imports (jax: a second or two) is only recorded: a
    KeyboardInterrupt raised inside an import is a traceback, or an extension's ImportError.
    jaxtron.lifecycle.take_over_signals (the command's start) takes the signals over, and a
    recorded stop ends the command there in its one line."""
    _record.signalled.append(signum)


_record.signalled = []
_record.startup_recorder = True  # what jaxtron.lifecycle.take_over_signals looks for
# A worker of prepare-data's pool starting: spawn runs this script again as __mp_main__, beside
# the worker's own __main__. Its signals stay the pool's.
_worker = sys.modules.get("__mp_main__", sys.modules["__main__"]) is not sys.modules["__main__"]
for _sig in (signal.SIGINT, signal.SIGTERM):
    if signal.getsignal(_sig) in (signal.SIG_DFL, signal.default_int_handler) and not _worker:
        signal.signal(_sig, _record)  # nohup's SIG_IGN stays

import jaxtron  # noqa: E402,F401  its check of the dependencies, in one line
