"""`jaxtron plan` from a checkout whose environment may not be activated:
python tools/plan.py --help (jaxtron/commands/plan.py)."""

import os
import sys

# Estimates and --verify's compiles are for GPUs elsewhere, computed on this CPU; said before jax
# loads its plugins, so that CUDA's registers for compiling only (xla_flags.load_plugins_quietly).
os.environ["JAX_PLATFORMS"] = "cpu"

import _environment  # noqa: F401  first: a Python without jaxtron gets one line naming the fix
from jaxtron.commands import run

if __name__ == "__main__":
    sys.exit(run("plan"))
