"""tools/plan.py and jaxtron/planner.py: the layouts it enumerates, the arithmetic of its step-time
terms, its ranking, the estimate beside the compiled peak (--verify), and one-line refusals."""

import json
import re
import sys
from pathlib import Path

import pytest

from jaxtron import aot, metrics, planner
from jaxtron import config as config_lib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import plan as plan_tool

TINY = ROOT / "configs" / "tiny.yaml"
SMALL = ["train.batch_size=32", "train.seq_len=256", "model.num_layers=4"]


def _cfg(*overrides):
    return aot.for_gpus(config_lib.load([TINY], [*SMALL, *overrides]))


def _mesh(**axes) -> dict[str, int]:
    return {"data": 1, "stage": 1, "fsdp": 1, "tensor": 1} | axes


def test_meshes_cover_the_gpus_with_tensor_inside_a_node():
    cfg = _cfg()
    meshes = planner.meshes(cfg, 16, 8)
    assert all(m["data"] * m["stage"] * m["fsdp"] * m["tensor"] == 16 for m in meshes)
    assert {m["tensor"] for m in meshes} == {1, 2}  # tiny: 4 heads, 2 KV heads
    assert {m["stage"] for m in meshes} == {1, 2, 4}  # 4 layers
    assert _mesh(data=2, fsdp=4, tensor=2) in meshes and _mesh(fsdp=16) in meshes


def test_bubble_and_data_terms():
    """The bubble is compute x (S-1)/(M R); the gradient all-reduce moves 2 (d-1)/d of the
    float32 gradients, over the network when data crosses nodes."""
    cfg = planner.configure(_cfg(), _mesh(data=2, stage=2, fsdp=4), "circular", 2, 4, "full")
    parts = planner.step_time(cfg, _mesh(data=2, stage=2, fsdp=4), 8, "h100")
    assert parts["bubble"] == pytest.approx(parts["compute"] * 1 / 8)
    grads = metrics.matmul_params(cfg.model) * 4 / (2 * 4)
    assert parts["data"] == pytest.approx(2 * grads / 2 / (planner.NETWORK_GBPS * 1e9))
    tokens = 32 * 256
    flops = metrics.flops_per_token(cfg.model, 256) * tokens / 16 * 8 / 6
    assert parts["compute"] == pytest.approx(flops / (planner.ACHIEVABLE_TFLOPS["h100"] * 1e12))


def test_fsdp_across_nodes_pays_the_network():
    """The same fsdp traffic costs NVLink time inside a node and network time across nodes."""
    cfg = _cfg("train.batch_size=64")
    inside = planner.step_time(planner.configure(cfg, _mesh(fsdp=8), "gpipe", 1, 1, "none"),
                               _mesh(fsdp=8), 8, "h100")
    across = planner.step_time(planner.configure(cfg, _mesh(fsdp=8), "gpipe", 1, 1, "none"),
                               _mesh(fsdp=8), 4, "h100")
    eta, compute = planner.FSDP_OVERLAP, inside["compute"]
    traffic = inside["fsdp"] / (1 - eta)  # inside a node the overlapped share hides in compute
    assert eta * traffic <= compute
    traffic *= planner.NVLINK_GBPS / planner.NETWORK_GBPS
    assert across["fsdp"] == pytest.approx(traffic * (1 - eta) + max(0, eta * traffic - compute))
    assert across["fsdp"] > 4 * inside["fsdp"]


def test_ranking_puts_fitting_layouts_first_fastest_first():
    cfg = _cfg()
    ranked = planner.evaluate(cfg, 16, 8, "h100", aot.capacity_bytes("h100"), ["none", "full"])
    assert ranked and all(x.fits for x in ranked[:5])
    fitting = [x.step_seconds for x in ranked if x.fits]
    assert fitting == sorted(fitting)
    first_misfit = next((i for i, x in enumerate(ranked) if not x.fits), len(ranked))
    assert all(not x.fits for x in ranked[first_misfit:])
    usable = aot.capacity_bytes("h100") * planner.USABLE_FRACTION
    assert all(x.fits == (x.peak_bytes <= usable) for x in ranked)


def test_cli_ranks_writes_json_and_verifies_against_the_compiled_peak(tmp_path, capsys):
    out = tmp_path / "plan.json"
    rc = plan_tool.main(["--config", str(ROOT / "configs" / "llama3_1b.yaml"), "--gpus", "16",
                         "--top", "3", "--json", str(out), "--verify", "1",
                         "train.batch_size=32", "train.seq_len=2048"])
    text = capsys.readouterr().out
    assert rc == 0, text
    assert re.search(r"^1\. TP\d .*: [\d.]+ m?s per step, [\d.]+ GiB per GPU", text, re.MULTILINE)
    assert "   below #1: " in text and "   below #2: " in text
    rows = json.loads(out.read_text())
    assert {"mesh", "schedule", "microbatches", "remat", "step_seconds", "peak_bytes",
            "fits"} <= set(rows[0])
    assert set(rows[0]["mesh"]) == {"data", "fsdp", "tensor", "stage"}
    (line,) = [x for x in text.splitlines() if x.startswith("verify ")]
    gap = float(re.search(r"\(([+-][\d.]+)%\)", line).group(1))
    assert abs(gap) <= 15, line


@pytest.mark.parametrize("args,message", [
    (["--gpus", "0"], "--gpus, --gpus-per-node and --top must be at least 1"),
    (["--gpus", "12"], "--gpus 12 is not a whole number of nodes of --gpus-per-node 8"),
    (["--gpus", "8", "--remat", "fastest"], "--remat fastest is not one of"),
    (["--gpus", "8", "train.lr=1"], "unknown config key 'train.lr'"),
    (["--gpus", "8", "--json", "/nonexistent/plan.json"],
     "--json /nonexistent/plan.json: directory /nonexistent does not exist"),
])
def test_bad_input_is_one_line_and_status_2(capsys, args, message):
    try:
        rc = plan_tool.main(["--config", str(TINY), *args])
    except SystemExit as e:
        rc = e.code
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1 and message in err, err


def test_durations_keep_three_digits_at_any_scale():
    """A small model's step is 381 us, not "0.00 s"; a large one's 22.2 s."""
    assert [planner.duration(x) for x in (22.24, 0.0433, 0.000381, 0.0)] == [
        "22.2 s", "43.3 ms", "381 us", "0 us"]
