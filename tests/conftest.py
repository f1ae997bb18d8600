"""Test environment, set before jax or jaxtron is imported anywhere.

- Eight simulated CPU devices for every test.
- A hermetic cache: JAXTRON_CACHE points at a fresh temporary directory made once per pytest
  session and removed at exit, so every run measures a cold start and never reads or writes the
  user's ~/.cache/jaxtron; subprocesses started by tests inherit it. An already-set JAXTRON_CACHE
  is deliberately ignored. To reuse one cache across sessions (faster local reruns), set
  JAXTRON_TEST_CACHE=/some/dir: it is used as is and kept.
- Each test starts with the signal handlers pytest started with: launch.main() called in-process
  keeps its start-up handler installed (a process ends after it), which changed what a later
  test's Ctrl-C meant.
"""

import atexit
import os
import shutil
import signal
import tempfile

import pytest

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


def _session_cache() -> str:
    """JAXTRON_TEST_CACHE if set, else a temporary directory deleted when pytest exits."""
    reused = os.environ.get("JAXTRON_TEST_CACHE")
    if reused:
        return reused
    path = tempfile.mkdtemp(prefix="jaxtron-test-cache-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


os.environ["JAXTRON_CACHE"] = _session_cache()


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
_STARTING = {sig: signal.getsignal(sig) for sig in _SIGNALS}


@pytest.fixture(autouse=True)
def _signal_handlers_as_at_start():
    for sig, handler in _STARTING.items():
        signal.signal(sig, handler)
    yield
