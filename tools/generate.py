"""`jaxtron generate` from a checkout whose environment may not be activated:
python tools/generate.py --help (jaxtron/commands/generate.py)."""

import sys

import _environment  # noqa: F401  first: a Python without jaxtron gets one line naming the fix
from jaxtron.commands import run

if __name__ == "__main__":
    sys.exit(run("generate"))
