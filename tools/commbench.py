"""`jaxtron commbench` from a checkout whose environment may not be activated:
python tools/commbench.py --help (jaxtron/commands/commbench.py)."""

import sys

import _environment  # noqa: F401  first: a Python without jaxtron gets one line naming the fix
from jaxtron.commands import run

if __name__ == "__main__":
    sys.exit(run("commbench"))
