"""What each command of tools/ imports first when run: a Python that has not installed jaxtron (its
virtual environment not activated) gets one line naming the fix and exit status 2, as launch.py
does, not a ModuleNotFoundError traceback; jaxtron's own import then names any dependency this
Python lacks (jaxtron/__init__.py), before a command imports numpy or yaml itself."""

import importlib.util
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

import jaxtron  # noqa: F401  its check of the dependencies, in one line
