"""Host memory over many checkpoint saves: a run that saves at every one of 120 steps keeps its
resident memory flat. Peers have leaked host memory on every save until the job was killed (Orbax
handlers holding each save's host copies; ~26 GB per save at scale): over a week of hourly saves
a leak of one state copy per save ends the run.

The real launch.py runs in a subprocess (its own process: pytest's memory is not the run's), and
every metrics row carries the process's resident memory (`host_memory_gib`).
"""

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SAVES = 120
EARLY = 20  # the first saves start Orbax's thread pools and caches: "early on" is after them
# One layer of the tiny model: 4.5 M parameters, so one leaked copy of the state (params and
# Adam's two moments, 54 MB) per save would add 6.3 GB over 120 saves, 5x a ~1.2 GB process.
OVERRIDES = ["model.num_layers=1", "train.seq_len=32", "train.batch_size=8", "train.log_every=1",
             "train.eval_every=0", f"train.steps={SAVES}", "checkpoint.every=1", "checkpoint.keep=2",
             "run.tensorboard=false", "run.progress=lines"]


@pytest.fixture(scope="module")
def soak(tmp_path_factory) -> list[dict]:
    """The rows of a 120-step run with a checkpoint at every step."""
    run_dir = tmp_path_factory.mktemp("soak") / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}  # one CPU device: the fastest
    done = subprocess.run([sys.executable, str(ROOT / "launch.py"), *OVERRIDES,
                           f"run.dir={run_dir}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir()
                  if p.name.isdigit()) == [SAVES - 1, SAVES]  # every save landed; keep=2
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # CI's time; `pytest -m slow` runs it
def test_resident_memory_stays_flat_over_120_saves(soak):
    """The median over saves 101-120 within 10% of the median over saves 11-30 (medians: a row is
    written while the previous save's host copies may still be held)."""
    by_step = {row["step"]: row["host_memory_gib"] for row in soak}
    assert sorted(by_step) == list(range(1, SAVES + 1))
    early = statistics.median(by_step[step] for step in range(EARLY - 9, EARLY + 11))
    late = statistics.median(by_step[step] for step in range(SAVES - 19, SAVES + 1))
    print(f"resident memory: {by_step[1]:.3f} GiB at step 1, median {early:.3f} over steps "
          f"{EARLY - 9}-{EARLY + 10}, {late:.3f} over steps {SAVES - 19}-{SAVES} "
          f"({100 * (late / early - 1):+.1f}%)")
    assert late <= 1.10 * early, (early, late)


LOCAL_SAVES = 200


@pytest.mark.slow  # CI's time; `pytest -m slow` runs it
def test_local_tier_keeps_memory_flat_and_blocks_the_loop_briefly(tmp_path):
    """200 local saves (checkpoint.local_dir, one at every step): the median resident memory over
    saves 181-200 within 10% of that over saves 11-30, and the loop blocked on a local save for
    less than a tenth of the median step (a ratio within one run: the bound the local tier
    promises, jaxtron/train/local_tier.py)."""
    run_dir = tmp_path / "run"
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}
    overrides = [o for o in OVERRIDES if not o.startswith(("train.steps", "checkpoint.every"))]
    done = subprocess.run([sys.executable, str(ROOT / "launch.py"), *overrides,
                           f"train.steps={LOCAL_SAVES}", "checkpoint.every=0",
                           f"checkpoint.local_dir={tmp_path / 'local'}",
                           "checkpoint.local_every=1", f"run.dir={run_dir}"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    kept = sorted(int(p.name) for p in (tmp_path / "local").glob("*/*") if p.name.isdigit())
    assert kept == [LOCAL_SAVES - 2, LOCAL_SAVES - 1]  # the last step is the persistent save's
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    by_step = {row["step"]: row["host_memory_gib"] for row in rows}
    early = statistics.median(by_step[step] for step in range(EARLY - 9, EARLY + 11))
    late = statistics.median(by_step[step] for step in range(LOCAL_SAVES - 19, LOCAL_SAVES + 1))
    line = next(line for line in done.stdout.splitlines() if "local checkpoints: " in line
                and " s each)" in line)
    each = float(line.rsplit("(", 1)[1].split(" s each")[0])
    step_s = statistics.median(row["step_time"] for row in rows[10:])
    print(f"resident memory: median {early:.3f} GiB over steps {EARLY - 9}-{EARLY + 10}, "
          f"{late:.3f} over steps {LOCAL_SAVES - 19}-{LOCAL_SAVES} "
          f"({100 * (late / early - 1):+.1f}%); {line.split(' ', 1)[1]}; median step "
          f"{step_s:.4f} s")
    assert late <= 1.10 * early, (early, late)
    assert each < 0.1 * step_s, (each, step_s)
