"""tools/inspect_ckpt.py on a real 2-step run of the tiny config: it prints what was saved."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest
from helpers import assert_refused

from jaxtron import config
from jaxtron.train.loop import train

TOOL = Path(__file__).resolve().parents[1] / "tools" / "inspect_ckpt.py"
ARRAY_LINE = re.compile(r"^  (\S+)\s+(\(.*?\))\s+(\w+)\s+([\d,]+) B$")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("inspect") / "run"
    train(config.load(["configs/tiny.yaml"], [
        "train.steps=2", "train.seq_len=64", "train.log_every=1", "train.eval_every=0",
        "checkpoint.every=1", "run.tensorboard=false", "run.progress=lines", f"run.dir={run_dir}",
    ]))
    return run_dir


def _inspect(path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), str(path)], capture_output=True, text=True,
                          timeout=120)


def _field(out: str, name: str) -> str:
    return re.search(rf"^{name}:\s+(.*)$", out, re.MULTILINE).group(1)


def _logged_losses(run_dir) -> dict[int, float]:
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows}


def test_run_dir_lists_checkpoints_and_shows_the_latest(run_dir):
    (run_dir / "checkpoints" / "3.orbax-checkpoint-tmp-99").mkdir()  # a save killed mid-write
    result = _inspect(run_dir)
    assert result.returncode == 0, result.stderr
    out, losses = result.stdout, _logged_losses(run_dir)
    assert out.startswith(f"{run_dir / 'checkpoints'}: 2 complete checkpoints\n")
    listed = re.findall(r"^  step\s+(\d+)\s+loss (\S+)$", out, re.MULTILINE)
    assert [(int(s), float(loss)) for s, loss in listed] == [(1, losses[1]), (2, losses[2])]
    assert _field(out, "step") == "2"
    assert float(_field(out, "loss")) == losses[2]  # printed with full precision: exactly equal
    assert _field(out, "tokens seen") == f"{2 * 16 * 64:,}"
    assert _field(out, "parameters") == "7,342,336"
    assert _field(out, "params bytes").startswith(f"{7_342_336 * 4:,} ")
    assert "num_layers=4, d_model=256" in _field(out, "model")
    assert _field(out, "saved mesh") == "data=1 stage=1 fsdp=8 tensor=1"


def test_table_matches_the_restored_arrays(run_dir):
    """Shapes, dtypes and bytes read from metadata alone equal those of the loaded state."""
    result = _inspect(run_dir / "checkpoints" / "1")
    assert result.returncode == 0, result.stderr
    assert _field(result.stdout, "step") == "1"
    table = {m[1]: (m[2], m[3], int(m[4].replace(",", "")))
             for m in map(ARRAY_LINE.match, result.stdout.splitlines()) if m}
    state = ocp.StandardCheckpointer().restore((run_dir / "checkpoints" / "1" / "state").absolute())
    leaves = jax.tree_util.tree_flatten_with_path(state)[0]
    loaded = {jax.tree_util.keystr(path, simple=True, separator="."):
              (str(tuple(x.shape)), np.dtype(x.dtype).name, x.nbytes) for path, x in leaves}
    assert table == loaded
    optimizer_bytes = sum(b for name, (_, _, b) in table.items() if name.startswith("opt_state."))
    assert _field(result.stdout, "optimizer bytes").startswith(f"{optimizer_bytes:,} ")


@pytest.mark.parametrize("name", ["missing", "empty_dir", "metrics.jsonl"])
def test_not_a_checkpoint_exits_2_with_one_line(run_dir, tmp_path, name):
    path = {"missing": tmp_path / "nowhere", "empty_dir": tmp_path,
            "metrics.jsonl": run_dir / "metrics.jsonl"}[name]
    result = _inspect(path)
    assert result.returncode == 2
    assert result.stdout == ""
    assert len(result.stderr.splitlines()) == 1 and str(path) in result.stderr


def test_a_run_with_no_checkpoint_yet_is_called_so(run_dir, tmp_path):
    """A run still before its first save (its config.yaml and metrics, checkpoints/ empty or not
    made yet): one line saying so and when it saves, not 'not a run'."""
    for name in ("config.yaml", "metrics.jsonl"):
        (tmp_path / name).write_bytes((run_dir / name).read_bytes())
    result = _inspect(tmp_path)
    assert result.stdout == ""
    assert_refused(result.returncode, result.stderr, str(tmp_path), "no complete checkpoint",
                   "checkpoint.every=1")
    (tmp_path / "checkpoints" / "5.orbax-checkpoint-tmp-1").mkdir(parents=True)  # mid-save
    assert "is a run with no complete checkpoint yet" in _inspect(tmp_path).stderr


def test_no_path_is_one_usage_line():
    result = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True,
                            timeout=120)
    assert result.stdout == ""
    assert_refused(result.returncode, result.stderr, "inspect_ckpt.py: error:", "path",
                   "tools/inspect_ckpt.py --help")


def test_a_closed_pipe_ends_quietly(run_dir):
    """`inspect_ckpt.py RUN | head -1`: the reader leaves early; no BrokenPipeError traceback."""
    proc = subprocess.run(f"{sys.executable} {TOOL} {run_dir} | head -1", shell=True,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.stdout.count("\n") == 1 and proc.stderr == "", proc.stderr


def test_a_damaged_checkpoint_read_by_the_tools_is_one_line(run_dir, tmp_path):
    """generate.py and convert_hf.py export read weights through jaxtron/checkpoint/weights.py: a truncated
    array file was a 30-line ValueError traceback from TensorStore."""
    import shutil

    from jaxtron.checkpoint import weights
    from jaxtron.config import ConfigError

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    # Every file of array data (the B+tree's nodes are the small ones): which arrays share a
    # file is Orbax's threads' choice, so cutting only the biggest left the params whole in some
    # runs, and read_params then read them without an error.
    for data_file in (copy / "checkpoints" / "2" / "state").rglob("d/*"):
        if data_file.stat().st_size > 100_000:
            data_file.write_bytes(data_file.read_bytes()[:1000])
    with pytest.raises(ConfigError, match=rf"^checkpoint {copy}/checkpoints/2 is damaged \(OUT_OF_"
                                          r"RANGE: Error reading .*; name an older one"):
        weights.read_params(copy)
    weights.read_params(copy / "checkpoints" / "1")  # the older one reads back
    proc = subprocess.run([sys.executable, str(TOOL.parent / "generate.py"), str(copy),
                           "--prompt", "x", "--max-new-tokens", "2"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"generate.py: error: checkpoint {copy}/checkpoints/2 is damaged")


def test_an_import_used_as_run_dir_is_refused_before_anything_is_written(tmp_path, capsys):
    """tools/convert_hf.py import writes weights only; as run.dir it read as an unreadable
    checkpoint, and the advice (move it aside) would have thrown the weights away."""
    import launch
    from jaxtron.checkpoint import weights

    imported = tmp_path / "imp"
    step = imported / "checkpoints" / "0"
    (step / "state").mkdir(parents=True)
    (step / "state" / "_METADATA").write_text("{}")
    (step / "meta").mkdir()
    cfg = config.load(["configs/tiny.yaml"], [])
    (step / "meta" / "metadata").write_text(json.dumps({"step": 0, "layout": weights.LAYERED,
                                                        "config": config.to_yaml(cfg)}))
    before = sorted(p.name for p in imported.rglob("*"))
    for dry in (["--dry-run"], []):
        assert_refused(launch.main([*dry, f"run.dir={imported}", "train.steps=2"]),
                       capsys.readouterr().err, f"run.dir={imported}", "import",
                       f"checkpoint.restore={imported}", "checkpoint.weights_only=true")
    assert sorted(p.name for p in imported.rglob("*")) == before


def test_a_damaged_checkpoint_is_listed_as_damaged_and_exits_1(run_dir, tmp_path):
    """A truncated data file of the newest checkpoint was listed as complete (exit 0); the next
    run found it unreadable (OUT_OF_RANGE) and moved it aside."""
    import shutil

    copy = tmp_path / "run"
    shutil.copytree(run_dir, copy)
    files = list((copy / "checkpoints" / "2" / "state").rglob("d/*"))
    biggest = max(files, key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[:1000])
    name = biggest.relative_to(copy / "checkpoints" / "2")
    for path in (copy, copy / "checkpoints" / "2"):
        result = _inspect(path)
        assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr
        assert re.match(rf"inspect_ckpt.py: error: checkpoint {copy}/checkpoints/2 is damaged "
                        rf"\({name} holds 1,000 bytes; the checkpoint needs [\d,]+\); a resume "
                        r"moves it aside and starts from step 1$", result.stderr), result.stderr
    out = _inspect(copy).stdout
    assert out.startswith(f"{copy / 'checkpoints'}: 2 complete checkpoints, 1 of them damaged\n")
    assert re.search(r"^  step +1  loss \S+$", out, re.MULTILINE)
    assert re.search(rf"^  step +2  damaged \({name} holds 1,000 bytes; ", out, re.MULTILINE)
    biggest.unlink()
    assert f"({name} is missing; the checkpoint needs" in _inspect(copy).stderr
    assert _inspect(copy / "checkpoints" / "1").returncode == 0  # the older one is whole


def test_a_jax_platforms_that_cannot_start_here_is_no_damage(run_dir):
    """JAX_PLATFORMS=cuda without a GPU said `unreadable state metadata (AssertionError)`, as if
    the checkpoint were damaged: the metadata is read with the CPU, whatever JAX_PLATFORMS says."""
    proc = subprocess.run([sys.executable, str(TOOL), str(run_dir)], capture_output=True,
                          text=True, timeout=120, env={**os.environ, "JAX_PLATFORMS": "cuda"})
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr[-2000:]
    assert proc.stdout == _inspect(run_dir).stdout


def test_the_model_line_names_experts_fp8_and_qk_norm_where_set(run_dir):
    """The model line left out experts, top-k, FP8 and q/k norms: a mixture of experts with FP8
    read as the dense model of its attention. They are shown where set, and a dense run's line
    has none of them."""
    from jaxtron.commands.inspect_ckpt import model_summary

    moe = config.load(["configs/tiny_moe.yaml"], ["model.fp8=delayed", "model.qk_norm=true",
                                                  "model.moe.mlp_dim=192"])
    line = model_summary(config.to_yaml(moe))
    assert line.endswith(", remat=none, moe.num_experts=8, moe.experts_per_token=2, moe.mlp_dim=192, "
                         "fp8=delayed, qk_norm=True"), line
    dense = _field(_inspect(run_dir).stdout, "model")
    assert not re.search("experts|moe|fp8|qk_norm|qkv_bias|sliding_window", dense), dense
    assert dense.startswith("num_layers=4, d_model=256")
