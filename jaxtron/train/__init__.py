"""A training run: the loop (loop.py) and what keeps it alive on a cluster: the preflight checks,
the jax.distributed bootstrap, the supervisor and watchdog of a multi-process run, preemption,
the compilation cache, and goodput."""
