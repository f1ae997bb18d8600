"""The dependency ranges admit no jax/flax pair that fails at import, and an environment that pairs
them anyway (an install with --no-deps or --target) is told so in one line."""

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from helpers import assert_refused
from packaging.requirements import Requirement

import jaxtron

ROOT = Path(__file__).resolve().parents[1]


def _admitted(package: str, python: str) -> list[Requirement]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    found = [Requirement(d) for d in deps]
    return [r for r in found if r.name == package
            and (r.marker is None or r.marker.evaluate({"python_version": python}))]


@pytest.mark.parametrize("python, flax, admitted", [
    ("3.11", "0.12.8", True),   # with jax 0.10.2, the only jax there for Python 3.11
    ("3.12", "0.12.8", False),  # with jax 0.11: jax.experimental.hijax has no HiPrimitive
    ("3.12", "0.12.9", False),  # with jax 0.12: the same
    ("3.12", "0.12.10", True),
    ("3.13", "0.12.9", False),
    ("3.13", "0.12.10", True),
    ("3.13", "0.12.12", True),
    ("3.12", "0.13.0", False),  # untested
])
def test_flax_range_depends_on_python(python, flax, admitted):
    (flax_range,) = _admitted("flax", python)
    assert flax_range.specifier.contains(flax) is admitted
    (jax_range,) = _admitted("jax", python)
    assert all(jax_range.specifier.contains(v) for v in ("0.10.2", "0.11.2", "0.12.0.1"))
    assert not jax_range.specifier.contains("0.13.0")  # untested


def test_python_range_admits_3_11_to_3_13():
    """3.13 was refused ("requires a different Python") while jax ships wheels for it."""
    from packaging.specifiers import SpecifierSet

    python = SpecifierSet(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
                          ["requires-python"])
    assert [v for v in ("3.10", "3.11", "3.12", "3.13", "3.14") if v in python] == \
        ["3.11", "3.12", "3.13"]


@pytest.mark.parametrize("jax, flax, said", [
    ("0.11.2", "0.12.8", "flax 0.12.8 does not work with jax 0.11.2; install flax 0.12.9 or "
                         "newer (pip install 'flax>=0.12.9,<0.13')"),
    ("0.11.2", "0.12.9", ""),
    ("0.11.2", "0.12.12", ""),
    ("0.10.2", "0.12.8", ""),
    ("0.12.0.1", "0.12.9", "flax 0.12.9 does not work with jax 0.12.0; install flax 0.12.10 or "
                           "newer (pip install 'flax>=0.12.10,<0.13')"),
    ("0.12.0.1", "0.12.8", "flax 0.12.8 does not work with jax 0.12.0; install flax 0.12.10 or "
                           "newer (pip install 'flax>=0.12.10,<0.13')"),
    ("0.12.0.1", "0.12.10", ""),
    ("0.11.2.dev20261101+cuda13", "0.12.8", "flax 0.12.8 does not work with jax 0.11.2; "
                                            "install flax 0.12.9 or newer (pip install "
                                            "'flax>=0.12.9,<0.13')"),
])
def test_a_mismatched_pair_is_named(monkeypatch, jax, flax, said):
    versions = {"jax": jax, "flax": flax}
    monkeypatch.setattr(jaxtron.importlib.metadata, "version", versions.__getitem__)
    assert jaxtron.mismatch() == said


@pytest.mark.parametrize("entry", ["launch.py", "jaxtron"])
def test_a_command_given_a_mismatched_pair_says_it_in_one_line(tmp_path, entry):
    """launch.py, and the installed `jaxtron train`, with flax's metadata claiming 0.12.8 beside
    jax 0.11.2: one line, exit 2, before anything imports flax (which would fail with an
    AttributeError traceback). The console script raised an ImportError traceback."""
    script = Path(sys.executable).parent / "jaxtron"
    if entry == "jaxtron" and not script.is_file():
        pytest.skip("no jaxtron console script beside this Python (pip install -e .)")
    (tmp_path / "sitecustomize.py").write_text(
        "import importlib.metadata as m\n_real = m.version\n"
        "m.version = lambda p: {'jax': '0.11.2', 'flax': '0.12.8'}.get(p) or _real(p)\n")
    start = [sys.executable, str(ROOT / "launch.py")] if entry == "launch.py" else [str(script),
                                                                                   "train"]
    proc = subprocess.run([*start, "--dry-run"], capture_output=True, text=True, cwd=tmp_path,
                          env={**__import__("os").environ, "PYTHONPATH": str(tmp_path)})
    assert proc.stdout == ""
    assert_refused(proc.returncode, proc.stderr, f"{entry}: error:", "flax 0.12.8", "jax 0.11.2",
                   "pip install 'flax>=0.12.9,<0.13'")


@pytest.mark.parametrize("version, admitted", [("2.3.0", False), ("2.4.0", True)])
def test_omegaconf_range_leaves_out_the_release_that_refuses_the_merge(version, admitted):
    """omegaconf 2.3.0 raises ReadonlyConfigError on config.load's merge into the frozen schema
    (model.vocab_size), so every run fails with it."""
    (omegaconf,) = _admitted("omegaconf", "3.12")
    assert omegaconf.specifier.contains(version) is admitted
