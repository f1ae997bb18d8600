"""Test environment, set before jax or jaxtron is imported anywhere.

- Eight simulated CPU devices for every test, and JAX_PLATFORMS=cpu: even on a GPU machine the
  suite runs on the CPU. Except when the run selects the `gpu` marker (pytest -m gpu): then
  JAX_PLATFORMS is left as it is (unset: jax starts the GPU, and jax.devices("cpu") still has the
  eight CPU devices) and jax allocates GPU memory as needed instead of taking 75% at start, so
  that subprocesses of the GPU tests get the GPU's memory too. Both are decided in
  pytest_configure, after the command line is read and before any test module imports jax.
- Tests marked `gpu` are skipped where no GPU backend starts (every run but `pytest -m gpu` on a
  GPU machine).
- A hermetic cache: JAXTRON_CACHE points at a fresh temporary directory made once per pytest
  session and removed at exit, so every run measures a cold start and never reads or writes the
  user's ~/.cache/jaxtron; subprocesses started by tests inherit it. An already-set JAXTRON_CACHE
  is deliberately ignored. To reuse one cache across sessions (faster local reruns), set
  JAXTRON_TEST_CACHE=/some/dir: it is used as is and kept.
- Each test starts with the signal handlers pytest started with: launch.main() called in-process
  keeps its start-up handler installed (a process ends after it), which changed what a later
  test's Ctrl-C meant.

Only hooks and fixtures live here: what test modules share is in helpers.py (its asserts are
rewritten by pytest, as a test module's are).
"""

import atexit
import functools
import inspect
import itertools
import os
import re
import shutil
import signal
import sys
import tempfile

import pytest

pytest.register_assert_rewrite("helpers")  # before a test module imports it

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

NO_GPU = "needs an NVIDIA GPU: run with pytest -m gpu on a GPU machine"


def gpu_selected(markexpr: str) -> bool:
    """Whether the -m expression selects by the gpu marker, unnegated: for some set of other
    markers, adding gpu turns a test from deselected to selected ("gpu", "gpu and not slow",
    "slow or gpu"; not "not slow", "not gpu")."""
    if "gpu" not in markexpr:
        return False
    from _pytest.mark.expression import Expression

    try:
        expression = Expression.compile(markexpr)
    except Exception:  # a malformed expression: pytest itself reports it when it selects tests
        return False
    others = sorted(set(re.findall(r"[A-Za-z_]\w*", markexpr)) - {"and", "or", "not", "gpu"})
    for present in itertools.product((False, True), repeat=min(len(others), 8)):
        marks = {name for name, on in zip(others, present) if on}
        if (expression.evaluate(lambda name, **kwargs: name == "gpu" or name in marks)
                and not expression.evaluate(lambda name, **kwargs: name in marks)):
            return True
    return False


def pytest_configure(config: pytest.Config) -> None:
    if gpu_selected(config.option.markexpr or ""):
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        return
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if "jax" in sys.modules:  # imported before this hook (a plugin): it read the variable already
        import jax

        jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])


@functools.cache
def _gpu_missing() -> str | None:
    """None when jax's CUDA backend starts here, else why not (starts jax's backends, so only
    the first gpu test asks)."""
    platforms = os.environ.get("JAX_PLATFORMS", "").replace(" ", "")
    if platforms and not {"cuda", "gpu"} & set(platforms.split(",")):
        return f"JAX_PLATFORMS={platforms}"  # e.g. cpu, as every run but -m gpu sets it
    import jax

    try:
        jax.devices("cuda")
    except RuntimeError as e:  # "Unknown backend cuda": no plugin, or it found no GPU
        return str(e).split("\n")[0]
    return None


# What an end-to-end test calls: a command (launch.py, a tool, in-process or as a process), the
# training loop, or the compile of the whole step for GPUs. A test that calls one of these, or a
# helper of its module or of helpers.py that does (one level), is marked e2e; the rest are unit
# tests.
E2E_CALLS = re.compile(r"\b(?:run_launch|launch\.main|subprocess\.(?:run|Popen)|train(?:_lib)?\.train"
                       r"|train\(|compile_step_for|compile_for|\w+_tool\.main|bench\.main)\b")


def _end_to_end(function, helpers: set[str]) -> bool:
    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        return False
    return bool(E2E_CALLS.search(source)) or any(f"{name}(" in source for name in helpers)


def slow_for_time() -> set[str]:
    """The node ids tests/slow_tests.txt marks `slow` (each line's id, before its comment)."""
    path = os.path.join(os.path.dirname(__file__), "slow_tests.txt")
    with open(path, encoding="utf-8") as f:
        return {line.split("  #")[0].strip() for line in f
                if line.strip() and not line.startswith("#")}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test `e2e` or `unit` (pytest -m unit: the fast ones), by what it calls, and
    `slow` those tests/slow_tests.txt lists. Runs before pytest's own -m selection reads the
    marks."""
    helpers: dict[object, set[str]] = {}
    slow = slow_for_time()
    for item in items:
        if item.nodeid in slow:
            item.add_marker("slow")
        module = item.module
        if module not in helpers:
            helpers[module] = {name for name, value in vars(module).items()
                               if inspect.isfunction(value) and not name.startswith("test")
                               and value.__module__ in (module.__name__, "helpers")
                               and _end_to_end(value, set())}
        function = getattr(item, "function", None)
        end_to_end = function is not None and _end_to_end(function, helpers[module])
        item.add_marker("e2e" if end_to_end else "unit")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is None or (missing := _gpu_missing()) is None:
        return
    if os.path.exists("/proc/driver/nvidia") and not missing.startswith("JAX_PLATFORMS="):
        # A driver, so a GPU, is here: a CUDA backend that does not start is the finding.
        pytest.fail(f"an NVIDIA driver is present but jax's CUDA backend did not start: {missing}",
                    pytrace=False)
    pytest.skip(f"{NO_GPU} ({missing})")


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
