"""jaxtron: JAX/XLA SPMD training for large language models."""
