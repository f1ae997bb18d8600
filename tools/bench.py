"""`jaxtron bench` from a checkout whose environment may not be activated:
python tools/bench.py --help (jaxtron/commands/bench.py)."""

import sys

import _environment  # noqa: F401  first: a Python without jaxtron gets one line naming the fix
from jaxtron.commands import run

if __name__ == "__main__":
    sys.exit(run("bench"))
