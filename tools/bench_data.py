"""`jaxtron bench-data` from a checkout whose environment may not be activated:
python tools/bench_data.py --help (jaxtron/commands/bench_data.py)."""

import sys

import _environment  # noqa: F401  first: a Python without jaxtron gets one line naming the fix
from jaxtron.commands import run

if __name__ == "__main__":
    sys.exit(run("bench-data"))
