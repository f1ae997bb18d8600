"""jaxtron: JAX/XLA SPMD training of Llama-family models on NVIDIA GPUs."""

import importlib.util
import os
import sys

# pyproject.toml's dependencies, by import name: a Python without them (the environment not
# activated) gets one line naming the fix, not a traceback from the first import that fails.
REQUIRED = ("jax", "flax", "optax", "orbax", "grain", "sentencepiece", "tokenizers", "omegaconf",
            "yaml", "tensorboardX", "tqdm", "numpy", "array_record", "pyarrow", "matplotlib")


def _check_installed() -> None:
    missing = [name for name in REQUIRED if importlib.util.find_spec(name) is None]
    if not missing:
        return
    message = (f"this Python ({sys.executable}) lacks jaxtron's dependencies ({', '.join(missing)})"
               "; activate its environment (. .venv/bin/activate) or install them (pip install -e .)")
    script = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0].endswith(".py") else ""
    if not script:
        raise ModuleNotFoundError(message)
    print(f"{script}: error: {message}", file=sys.stderr)
    raise SystemExit(2)


_check_installed()

from jaxtron.xla_flags import load_plugins_quietly  # after the check above

load_plugins_quietly()  # before any command's first output (see its docstring)
