"""The dry run's memory verdict (`launch.py --dry-run --gpu h100`) against the compiled program's
(`--compile-for h100`): where the dry run says a layout fits or does not, the compiled step
agrees, and nearer the limit than its error it says so instead of guessing."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Llama-3-70B as TP8 / PP2 / FSDP8 on 128 H100s, the stage gradients summed whole: about 69 GiB
# per GPU, just inside the 71.2 GiB jax may use at xla.mem_fraction=0.9.
LAYOUT = ["--config", str(ROOT / "configs" / "llama3_70b.yaml"), "--devices", "128",
          "train.batch_size=512", "train.seq_len=4096", "mesh.tensor=8", "mesh.stage=2",
          "mesh.fsdp=8", "mesh.data=1", "train.microbatches=16", "model.remat=full",
          "pipeline.grad_sum=whole"]


def _launch(*args: str, fraction: str | None = None) -> str:
    env = {k: v for k, v in os.environ.items() if "MEM_FRACTION" not in k}
    if fraction:
        env["XLA_PYTHON_CLIENT_MEM_FRACTION"] = fraction
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], capture_output=True,
                          text=True, env=env, check=False, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _verdict(fraction: str | None, *overrides: str) -> str:
    out = _launch("--dry-run", "--gpu", "h100", *LAYOUT, *overrides, fraction=fraction)
    return re.search(r"^verdict: (fits|DOES NOT FIT|too close to call)", out, re.MULTILINE)[1]


@pytest.fixture(scope="module")
def compiled(tmp_path_factory) -> dict:
    report = tmp_path_factory.mktemp("fit") / "report.json"
    _launch("--compile-for", "h100", *LAYOUT, "--report", str(report))
    return json.loads(report.read_text())


@pytest.mark.parametrize("fraction,expected", [
    ("0.9", None),  # the default: the compiled peak is 97% of the limit
    ("0.95", None),  # 75.2 GiB usable: 8% under
    ("0.75", "DOES NOT FIT"),  # jax's own default, 59.4 GiB: 16% over
])
def test_the_dry_run_verdict_agrees_with_the_compiled_program(compiled, fraction, expected):
    """A verdict of fits or DOES NOT FIT is the compiled program's; 'too close to call' comes
    only where the estimate is within 10% of the limit."""
    verdict = _verdict(fraction)
    usable = compiled["memory"]["capacity_bytes"] * float(fraction)
    fits = compiled["memory"]["peak_bytes"] <= usable
    if verdict == "too close to call":
        assert expected is None and abs(compiled["plan_peak_bytes"] / usable - 1) <= 0.1
    else:
        assert verdict == ("fits" if fits else "DOES NOT FIT") == (expected or verdict)


def test_far_from_the_limit_the_verdict_is_clear():
    """Summed sharded, the same layout needs 45.5 GiB compiled: it fits, and the dry run says so."""
    assert _verdict("0.9", "pipeline.grad_sum=sharded") == "fits"
