"""Profiler traces (run.profile_steps) and the persistent compilation cache (run.compile_cache).

A trace of steps [2, 3] holds exactly those two executions of the train step on each of the 8
devices, complete (the loop blocks on step 3's result before it stops the trace); no trace
without the key. The cache: a second start of the same run loads every program instead of
compiling it (the tiny preset's train step: 6.4 s -> 0.7 s, docs/performance.md),
while the same model on another mesh (data=8 instead of fsdp=8), or under other XLA_FLAGS,
compiles its train step anew: JAX's key holds the HLO with its shardings and the flags, never
the model alone.
"""

import gzip
import json
import logging
import os
import re

import jax
import pytest
from jax.experimental.compilation_cache import compilation_cache

from jaxtron import config
from jaxtron.train.loop import train

SMALL = ["model.num_layers=2", "model.d_model=64", "model.num_heads=2", "model.num_kv_heads=1",
         "model.mlp_dim=128", "train.seq_len=32", "train.batch_size=8", "train.eval_every=0",
         "train.log_every=1", "optim.warmup_steps=1", "run.tensorboard=false",
         "run.progress=lines"]
STEP = "jit_train_step"  # the train step's module name in the cache's log lines


def _cfg(run_dir, *extra: str) -> config.Config:
    return config.load(["configs/tiny.yaml"], [*SMALL, "train.steps=4", f"run.dir={run_dir}",
                                               *extra])


def _trace_events(run_dir) -> list[dict]:
    (trace,) = (run_dir / "profile").glob("plugins/profile/*/perfetto_trace.json.gz")
    return json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]


def test_profile_traces_the_named_steps_only(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rows = train(_cfg(run_dir, "run.profile_steps=[2,3]"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert len(list((run_dir / "profile").glob("plugins/profile/*/*.xplane.pb"))) == 1
    names = [e.get("name", "") for e in _trace_events(run_dir)]
    # Each execution of the step on a device ends with one wait for its completion on that
    # device: 2 steps x 8 devices, so step 1 is not in it, and step 3 ran to its end inside.
    assert names.count("ThunkExecutor::Execute (wait for completion)") == 2 * 8
    assert names.count("PjitFunction(jit(train_step))") == 2 * 2  # two dispatches, each nested
    out = capsys.readouterr().out
    assert f"profile: steps 2..3 traced into {run_dir / 'profile'}" in out
    assert "tensorboard --logdir" in out and "ui.perfetto.dev" in out


@pytest.mark.parametrize("steps", ["[3,2]", "[2]", "[-1,2]", "[1,5]", "[1,2,3]"])
def test_bad_profile_steps_are_one_line(steps):
    with pytest.raises(config.ConfigError) as e:
        config.load(["configs/tiny.yaml"], ["train.steps=4", f"run.profile_steps={steps}"])
    assert "run.profile_steps=" in str(e.value) and "\n" not in str(e.value)


class _Compiles:
    """What the persistent cache did for each program compiled while open: JAX's monitoring
    events count hits and misses, its debug log names the programs."""

    def __init__(self, caplog):
        self.caplog, self.events = caplog, []

    def listen(self, event: str, **kwargs) -> None:
        if event.startswith("/jax/compilation_cache/cache_"):
            self.events.append(event.rsplit("_", 1)[1])  # hits | misses

    def run(self, cfg: config.Config) -> dict:
        self.events.clear()
        self.caplog.clear()
        jax.monitoring.register_event_listener(self.listen)
        try:
            train(cfg)
        finally:
            jax.monitoring.unregister_event_listener(self.listen)
        lines = [r.getMessage() for r in self.caplog.records]
        return {"hits": self.events.count("hits"), "misses": self.events.count("misses"),
                "step_hit": any(f"cache hit for '{STEP}'" in line for line in lines),
                "step_miss": any(f"CACHE MISS for '{STEP}'" in line for line in lines)}


def _compile_seconds(out: str, suffix: str) -> float:
    """The train step's compile time that train() logged, with `suffix` after it."""
    return float(re.search(rf"compiled the train step in ([0-9.]+) s{re.escape(suffix)}\n",
                           out).group(1))


@pytest.fixture
def no_cache_after():
    """Leave JAX's cache as the session had it: off, for the tests that follow."""
    yield
    jax.config.update("jax_compilation_cache_dir", None)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 1.0)
    compilation_cache.reset_cache()


@pytest.mark.slow  # CI's time; `pytest -m slow` runs it
def test_compile_cache_reuses_a_run_never_another_mesh_or_flags(tmp_path, caplog, monkeypatch,
                                                                 capsys, no_cache_after):
    caplog.set_level(logging.DEBUG, logger="jax._src.compiler")
    cache = tmp_path / "cache"
    compiles = _Compiles(caplog)
    fsdp = lambda name, *extra: _cfg(tmp_path / name, "mesh.fsdp=8", "train.steps=2",
                                     f"run.compile_cache={cache}", *extra)

    first = compiles.run(fsdp("first"))
    assert first["hits"] == 0 and first["misses"] >= 2 and first["step_miss"]
    assert any(p.name.startswith(f"{STEP}-") for p in cache.iterdir())
    compiled = _compile_seconds(capsys.readouterr().out, " (and stored in run.compile_cache)")

    again = compiles.run(fsdp("again"))  # a restart of the same run: nothing compiles
    assert again["misses"] == 0 and again["hits"] >= 1 and again["step_hit"]
    loaded = _compile_seconds(capsys.readouterr().out, " (loaded from run.compile_cache)")
    assert loaded < compiled  # tracing and lowering remain; XLA's compile is skipped (the hits
    # above are the proof; a ratio of two wall times on a loaded machine is no more than a hint)

    data = compiles.run(fsdp("data", "mesh.fsdp=1", "mesh.data=8"))  # same model, other mesh
    assert data["step_miss"] and not data["step_hit"]

    monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"] + " --xla_cpu_enable_fast_math=true")
    flags = compiles.run(fsdp("flags"))  # same model and mesh, other XLA flags
    assert flags["step_miss"] and not flags["step_hit"]
    assert not list(tmp_path.glob("*/profile"))  # no run.profile_steps, no trace
