"""jaxtron: JAX/XLA SPMD training of Llama-family models on NVIDIA GPUs."""

from jaxtron.xla_flags import load_plugins_quietly

load_plugins_quietly()  # before any command's first output (see its docstring)
