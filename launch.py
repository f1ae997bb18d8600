"""`jaxtron train` from a checkout whose environment may not be activated:
python launch.py --help (jaxtron/commands/train.py)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "tools"))
import _environment  # noqa: F401  first: a Python without jaxtron gets one line naming the fix
from jaxtron.commands import run
from jaxtron.commands.train import DEFAULT_CONFIG, EXIT_PREEMPTED, main, parse_args  # noqa: F401

if __name__ == "__main__":
    sys.exit(run("train"))
