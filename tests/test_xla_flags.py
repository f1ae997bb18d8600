"""XLA flag presets (jaxtron/program/xla_flags.py): what each preset sets, which flag wins, and that a
flag this jaxlib does not know stops launch.py in one line instead of killing it inside XLA."""

import json
import os
import subprocess
import sys

import pytest
from helpers import ROOT, assert_refused, run_launch

import launch
from jaxtron.config import ConfigError, XlaConfig, load
from jaxtron.program import xla_flags

TYPO = "--xla_gpu_enable_latency_hidding_scheduler=true"  # "hidding": not a flag of any jaxlib


def test_presets_resolve_per_table(monkeypatch):
    assert xla_flags.for_config(XlaConfig(preset="none")) == []
    gpu = xla_flags.for_config(XlaConfig(preset="gpu"))
    assert gpu == list(xla_flags.XLA_PRESETS["gpu"])
    for flag in ("--xla_gpu_enable_latency_hiding_scheduler=true",
                 "--xla_gpu_enable_pipelined_all_gather=true",
                 "--xla_gpu_enable_pipelined_reduce_scatter=true",
                 "--xla_gpu_enable_pipelined_all_reduce=true",
                 "--xla_gpu_enable_while_loop_double_buffering=true",
                 "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
                 "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
                 "--xla_gpu_all_reduce_combine_threshold_bytes=134217728"):
        assert flag in gpu
    # auto: gpu exactly when a CUDA build of jax is installed and JAX_PLATFORMS lets it be used
    monkeypatch.setattr(xla_flags, "_installed", lambda name: name == "jax_plugins.xla_cuda12")
    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    assert xla_flags.resolve_preset("auto") == "gpu"
    monkeypatch.setenv("JAX_PLATFORMS", "cuda,cpu")
    assert xla_flags.for_config(XlaConfig(preset="auto")) == gpu
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    assert xla_flags.resolve_preset("auto") == "none"
    monkeypatch.setattr(xla_flags, "_installed", lambda module: False)
    monkeypatch.delenv("JAX_PLATFORMS")
    assert xla_flags.resolve_preset("auto") == "none"
    with pytest.raises(ConfigError, match="xla.preset=tpu is not one of auto, none, gpu"):
        xla_flags.resolve_preset("tpu")


def test_plugin_lookup_survives_a_missing_namespace_package():
    assert xla_flags._installed("jaxlib")
    assert not xla_flags._installed("jax_plugins_that_do_not_exist.xla_cuda12")


def test_later_flags_override_earlier_ones_of_the_same_name():
    # As on the command line: a YAML list through config.load.
    cfg = load([launch.DEFAULT_CONFIG], [
        "xla.preset=gpu",
        ("xla.flags=[--xla_gpu_all_reduce_combine_threshold_bytes=1, --xla_dump_to=/tmp/a, "
         "--xla_dump_to=/tmp/b]")])
    env = "--xla_force_host_platform_device_count=8 --xla_gpu_enable_latency_hiding_scheduler=false"
    flags = xla_flags.for_config(cfg.xla, env)
    names = [flag.split("=")[0] for flag in flags]
    assert len(names) == len(set(names)) == len(xla_flags.XLA_PRESETS["gpu"]) + 2
    assert flags[0] == "--xla_force_host_platform_device_count=8"  # the environment's stays
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" in flags  # the preset beats the env
    assert "--xla_gpu_all_reduce_combine_threshold_bytes=134217728" not in flags  # xla.flags wins
    assert flags[-2:] == ["--xla_gpu_all_reduce_combine_threshold_bytes=1", "--xla_dump_to=/tmp/b"]


def test_gpu_flags_are_known_to_this_jaxlib_and_the_check_is_real():
    # GPU DebugOptions flags are registered in every jaxlib build, the CPU-only one included.
    flags = xla_flags.for_config(XlaConfig(preset="gpu"))
    xla_flags.check(flags)
    with pytest.raises(ConfigError, match=f"has no XLA flag {TYPO} \\(from XLA_FLAGS\\), did you "
                                          "mean --xla_gpu_enable_latency_hiding_scheduler\\?"):
        xla_flags.check(flags + [TYPO])
    with pytest.raises(ConfigError, match="cannot read the value of XLA flag "
                                          "--xla_gpu_all_gather_combine_threshold_bytes=lots"):
        xla_flags.check(["--xla_gpu_all_gather_combine_threshold_bytes=lots"])


def test_misspelled_flag_exits_2_with_one_line_naming_it():
    proc = run_launch("--dry-run", f"xla.flags=[{TYPO}]")
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    assert lines[0] == (f"launch.py: error: jaxlib {xla_flags._version('jaxlib')} has no XLA flag "
                        f"{TYPO} (from xla.flags), did you mean "
                        "--xla_gpu_enable_latency_hiding_scheduler?")


@pytest.mark.parametrize("flag", ["xla_dump_to=/tmp/a", "-xla_dump_to=/tmp/a", "--xla dump",
                                  "--=1", "--xla_dump_to=/tmp/a b"])
def test_malformed_flag_is_one_line_and_status_2(capsys, flag):
    assert_refused(launch.main(["--dry-run", f"xla.flags=['{flag}']"]), capsys.readouterr().err,
                   f"'{flag}'", "xla.flags", "--name=value")


def test_malformed_environment_flag_names_xla_flags():
    with pytest.raises(ConfigError, match="'oops' \\(in XLA_FLAGS\\) is not an XLA flag"):
        xla_flags.for_config(XlaConfig(preset="none"), "--xla_dump_to=/tmp/a oops")


def test_flags_take_effect_in_the_launch_process():
    # conftest's XLA_FLAGS asks for 8 CPU devices; xla.flags overrides it, and the dry run's
    # device count shows which value the backend started with.
    proc = run_launch("--dry-run", "xla.flags=[--xla_force_host_platform_device_count=2]")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "xla flags: --xla_force_host_platform_device_count=2\n" in proc.stdout
    assert "(2 devices)" in proc.stdout


def test_apply_refuses_new_flags_once_a_backend_started(monkeypatch):
    import jax

    jax.devices()  # this process's backend, started with conftest's XLA_FLAGS
    monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"])  # restored afterwards
    flags = xla_flags.apply(XlaConfig(preset="none"))  # nothing new: allowed
    assert flags[-1] == "--xla_force_host_platform_device_count=8"
    with pytest.raises(RuntimeError, match="started: XLA would ignore --xla_dump_to=/tmp/a;"):
        xla_flags.apply(XlaConfig(preset="none", flags=["--xla_dump_to=/tmp/a"]))


@pytest.mark.parametrize("environ,expected", [
    ({}, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"}),  # xla.mem_fraction's default
    ({"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.8"}, {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.8"}),
    ({"XLA_CLIENT_MEM_FRACTION": "0.7"}, {"XLA_CLIENT_MEM_FRACTION": "0.7"}),  # the new name
])
def test_apply_gives_jax_the_configured_memory_share_unless_the_environment_does(environ,
                                                                                 expected):
    """Before the backend starts (a fresh process): the variable jax reads its memory share
    from is set to xla.mem_fraction, and a user's own value, under either name, is kept."""
    code = ("import json, os; from jaxtron.program import xla_flags; from jaxtron.config import XlaConfig;"
            "xla_flags.apply(XlaConfig(preset='none'));"
            "print(json.dumps({k: v for k, v in os.environ.items() if 'MEM_FRACTION' in k}))")
    env = {k: v for k, v in os.environ.items() if "MEM_FRACTION" not in k} | environ
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                          check=False, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout) == expected


@pytest.mark.parametrize("value", ["2", "0", "-0.5", "most", "nan"])
def test_an_environment_memory_share_is_checked_like_xla_mem_fraction(monkeypatch, value):
    """XLA_PYTHON_CLIENT_MEM_FRACTION outside (0, 1] is refused as xla.mem_fraction=2 is: one
    line naming the variable, launch.py's dry run included. (The first name is cleared: an
    earlier test's in-process run may have set it, and it is read first.)"""
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION", raising=False)
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", value)
    with pytest.raises(ConfigError, match=f"^XLA_CLIENT_MEM_FRACTION={value} must be a share of "
                                          r"each GPU's memory in \(0, 1\]"):
        xla_flags.apply(XlaConfig(preset="none"))
    monkeypatch.setenv("XLA_CLIENT_MEM_FRACTION", "1")
    assert xla_flags.env_mem_fraction() == ("XLA_CLIENT_MEM_FRACTION", 1.0)
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--dry-run"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, check=False,
                          env=os.environ | {"XLA_PYTHON_CLIENT_MEM_FRACTION": value})
    assert proc.returncode == 2 and proc.stderr.splitlines() == [(
        f"launch.py: error: XLA_PYTHON_CLIENT_MEM_FRACTION={value} must be a share of each GPU's "
        "memory in (0, 1], as xla.mem_fraction must; set e.g. XLA_PYTHON_CLIENT_MEM_FRACTION=0.9, "
        "or unset XLA_PYTHON_CLIENT_MEM_FRACTION and set xla.mem_fraction")], proc.stderr[-2000:]


@pytest.mark.skipif(os.path.exists("/proc/driver/nvidia"), reason="a GPU: cuda starts here")
@pytest.mark.parametrize("platforms,reason,fix", [
    ("cuda", "no NVIDIA GPU visible",
     "pip install -e '.[cuda12]' on a GPU machine, or unset JAX_PLATFORMS"),
    ("garbage", "Backend 'garbage' is not in the list of known backends", "unset JAX_PLATFORMS"),
])
@pytest.mark.parametrize("mode", [("--dry-run",), ("train.steps=1",)])
def test_a_backend_that_cannot_start_is_one_line(tmp_path, platforms, reason, fix, mode):
    """JAX_PLATFORMS naming a backend that cannot start here (jax's CUDA plugin without a GPU, a
    misspelling): one line naming the variable, exit status 2, for a plan and a training run."""
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), *mode, f"run.dir={tmp_path}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, check=False,
                          env=os.environ | {"JAX_PLATFORMS": platforms})
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.splitlines()
    assert line.startswith(f"launch.py: error: JAX_PLATFORMS={platforms}, but no {platforms} "
                           "backend starts here (") and reason in line and fix in line


@pytest.mark.skipif(os.path.exists("/proc/driver/nvidia"), reason="a GPU: gpu starts here")
def test_the_old_platform_variable_is_named_when_it_asks_for_a_missing_backend(tmp_path):
    """JAX_PLATFORM_NAME=gpu (jax's old name) was reported as `JAX_PLATFORMS=cpu, but no cpu
    backend starts here`, the JAX_PLATFORMS=cpu that jaxtron sets itself where the CUDA plugin has
    no GPU (xla_flags.load_plugins_quietly), with advice to set JAX_PLATFORMS=cpu."""
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), "--dry-run",
                           f"run.dir={tmp_path}"], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env=env | {"JAX_PLATFORM_NAME": "gpu"})
    assert proc.returncode == 2, proc.stderr[-2000:]
    [line] = proc.stderr.splitlines()
    assert line.startswith("launch.py: error: JAX_PLATFORM_NAME=gpu, but no gpu backend starts "
                           "here (Unknown backend"), line
    assert line.endswith("; unset JAX_PLATFORM_NAME (jax's old name for JAX_PLATFORMS; jax then "
                         "picks what it finds)"), line
    assert "JAX_PLATFORMS=cpu" not in line


def test_a_jax_platforms_set_by_jaxtron_is_not_blamed_on_the_user(monkeypatch):
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.delenv("JAX_PLATFORM_NAME", raising=False)
    monkeypatch.setattr(xla_flags, "_PLATFORMS_SET_HERE", True)
    assert xla_flags._no_backend("some plugin failed") == (
        "jax could not start a backend (some plugin failed); set JAX_PLATFORMS=cpu to skip a "
        "failing plugin, or reinstall: pip install -e .")
