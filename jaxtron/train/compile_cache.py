"""JAX's persistent compilation cache for a run (run.compile_cache): turned on before anything
compiles, and watched while the train step compiles, to say whether it was loaded or stored."""

from __future__ import annotations

import contextlib

import jax
from jax.experimental.compilation_cache import compilation_cache


def use(directory: str) -> None:
    """Turn on JAX's persistent compilation cache in `directory` ("" leaves JAX's own settings):
    a restart loads each compiled program instead of compiling it again. JAX keys an entry on the
    program's HLO (its shardings, so the mesh), compile options, devices, jaxlib and XLA_FLAGS:
    a changed mesh or XLA flag compiles anew (tests/test_run_tools.py checks both)."""
    if not directory:
        return
    if jax.config.jax_compilation_cache_dir != directory:
        jax.config.update("jax_compilation_cache_dir", directory)
        compilation_cache.reset_cache()  # one opened earlier in this process, on another directory
    # Every program, however quick to compile: a restart then compiles nothing (the init, eval and
    # step programs are a handful of entries, the step's the only large one).
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


@contextlib.contextmanager
def events():
    """A list that gathers the persistent compilation cache's "hits" (a program loaded) and
    "misses" (compiled and stored) while open, from JAX's monitoring events."""
    events = []

    def listen(event: str, **kwargs) -> None:
        if event.startswith("/jax/compilation_cache/cache_"):
            events.append(event.rsplit("_", 1)[1])

    jax.monitoring.register_event_listener(listen)
    try:
        yield events
    finally:
        jax.monitoring.unregister_event_listener(listen)
