"""`jaxtron plot` from a checkout whose environment may not be activated:
python tools/plot.py --help (jaxtron/commands/plot.py)."""

import sys

import _environment  # noqa: F401  first: a Python without jaxtron gets one line naming the fix
from jaxtron.commands import run

if __name__ == "__main__":
    sys.exit(run("plot"))
