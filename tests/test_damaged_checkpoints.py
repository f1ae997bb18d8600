"""A damaged checkpoint is skipped, not fatal (CPU, the real entry points).

One uninterrupted 16-step run saves checkpoints 5, 10, 15 and 16; each case copies 10 and 15 (a run
stopped at step 15), damages 15 in one of six ways, and reruns launch.py to step 15: it names the damage,
sets 15 aside in damaged_checkpoints/, resumes from 10 with the uninterrupted run's losses, and
saves 15 again; a run on to 16 then resumes from that new 15, again with the same loss.
"""

import importlib
import json
import re
import shutil
from pathlib import Path

import pytest
from helpers import assert_refused

import launch
from jaxtron import config
from jaxtron.checkpoint import damage, weights
from jaxtron.train.loop import train

ROOT = Path(__file__).resolve().parent.parent
ARGS = ["model.num_layers=1", "model.d_model=64", "model.num_heads=2", "model.num_kv_heads=1",
        "model.mlp_dim=128", "train.batch_size=8", "train.seq_len=32", "train.log_every=1",
        "train.eval_every=0", "optim.warmup_steps=2", "optim.decay_steps=16",  # any train.steps
        "checkpoint.every=5", "checkpoint.keep=4", "run.tensorboard=false", "run.progress=lines"]


def _garbage(step_dir: Path) -> None:
    for f in step_dir.rglob("*"):
        if f.is_file():
            f.write_bytes(b"\x00\x9f not a checkpoint \xff" * 10)


def _meta_deleted(step_dir: Path) -> None:
    for f in (step_dir / "meta").iterdir():
        f.unlink()


def _truncated(step_dir: Path) -> None:
    biggest = max((step_dir / "state").rglob("d/*"), key=lambda p: p.stat().st_size)
    biggest.write_bytes(biggest.read_bytes()[:1000])


def _marker_only(step_dir: Path) -> None:
    """Orbax's commit marker and _CHECKPOINT_METADATA, the items gone (one left empty)."""
    for item in ("state", "data", "meta"):
        shutil.rmtree(step_dir / item)
    (step_dir / "state").mkdir()


def _manifest_deleted(step_dir: Path) -> None:
    """The root of the OCDBT tree gone: no array can be found, though every metadata file reads."""
    (step_dir / "state" / "manifest.ocdbt").unlink()


def _emptied(step_dir: Path) -> None:
    shutil.rmtree(step_dir)
    step_dir.mkdir()


DAMAGE = {  # kind -> (how, the cause the warning names)
    "garbage": (_garbage, r"state/_METADATA is unreadable \(.+\)"),
    "meta_deleted": (_meta_deleted, r"meta/metadata is missing"),
    "truncated": (_truncated, r"OUT_OF_RANGE: Error reading .+"),  # TensorStore's words
    "marker_only": (_marker_only, r"state/_METADATA is missing"),
    "manifest_deleted": (_manifest_deleted, r"NOT_FOUND: .+"),  # TensorStore's words
    "emptied": (_emptied, r"its directory is empty"),
}


def _cfg(run_dir: Path, steps: int, cache: Path) -> config.Config:
    return config.load([str(ROOT / "configs" / "tiny.yaml")], [
        *ARGS, f"train.steps={steps}", f"run.dir={run_dir}", f"run.compile_cache={cache}"])


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """(the uninterrupted run's directory, step -> loss)."""
    root = tmp_path_factory.mktemp("damaged")
    rows = train(_cfg(root / "straight", 16, root / "xla"))
    return root / "straight", {row["step"]: row["loss"] for row in rows}


def _stopped_at_15(straight_dir: Path, run_dir: Path, kind: str) -> Path:
    """A run stopped after its save at step 15 (checkpoints 10 and 15), 15 damaged by `kind`."""
    for step in ("10", "15"):
        shutil.copytree(straight_dir / "checkpoints" / step, run_dir / "checkpoints" / step)
    DAMAGE[kind][0](run_dir / "checkpoints" / "15")
    return run_dir


@pytest.mark.parametrize("kind", DAMAGE)
def test_a_damaged_newest_checkpoint_is_set_aside_and_saved_again(straight, tmp_path, capsys,
                                                                   kind):
    straight_dir, losses = straight
    cache = straight_dir.parent / "xla"
    run_dir = _stopped_at_15(straight_dir, tmp_path / "run", kind)
    capsys.readouterr()
    # launch.py, to the same step: a damaged newest checkpoint is not "nothing to do"
    assert launch.main([*ARGS, "train.steps=15", f"run.dir={run_dir}",
                        f"run.compile_cache={cache}"]) == 0
    out = capsys.readouterr().out
    again = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert re.search(rf"warning: checkpoint {run_dir}/checkpoints/15 is unreadable "
                     rf"\({DAMAGE[kind][1]}\); trying an older one", out), out
    moved = list((run_dir / "damaged_checkpoints").iterdir())
    assert [p.name.split("-")[0] for p in moved] == ["15"], moved
    assert f"resumed from {run_dir}/checkpoints step 10 " in out
    assert {r["step"]: r["loss"] for r in again} == {s: losses[s] for s in range(11, 16)}
    saved = run_dir / "checkpoints" / "15"  # the rerun's own save of the damaged step
    assert damage.damage(saved) is None and weights.read_meta(saved)["step"] == 15
    further = train(_cfg(run_dir, 16, cache))
    assert f"resumed from {run_dir}/checkpoints step 15 " in capsys.readouterr().out
    assert [(r["step"], r["loss"]) for r in further] == [(16, losses[16])]


def test_the_dry_run_names_each_kind_of_damage(straight, tmp_path, capsys):
    """Seen from the files alone: no array is read, nothing is moved."""
    straight_dir, _ = straight
    for kind, (_, cause) in DAMAGE.items():
        run_dir = _stopped_at_15(straight_dir, tmp_path / kind, kind)
        if kind == "truncated":  # the OCDBT tree says how long the file should be
            cause = r"state/ocdbt\.process_0/d/\w+ holds 1,000 bytes; the checkpoint needs [\d,]+"
        if kind == "manifest_deleted":
            cause = r"state/manifest\.ocdbt is missing"
        assert launch.main(["--dry-run", *ARGS, "train.steps=15", f"run.dir={run_dir}"]) == 0
        out = capsys.readouterr().out
        assert re.search(rf"^start: resumes from {run_dir}/checkpoints/10 \(step 10 of 15: 5 steps "
                         rf"to go\); checkpoint 15 is damaged \({cause}\) and will be set aside; ",
                         out, re.MULTILINE), (kind, out)
        assert not (run_dir / "damaged_checkpoints").exists()


def test_inspect_ckpt_names_each_damaged_checkpoint(straight, tmp_path, capsys):
    """Garbage was a UnicodeDecodeError traceback; deleted meta files left the step unlisted.
    In-process: an exception other than the tool's one line would fail the test."""
    inspect_ckpt = importlib.import_module("jaxtron.commands.inspect_ckpt")
    straight_dir, losses = straight
    for kind, (_, cause) in DAMAGE.items():
        run_dir = _stopped_at_15(straight_dir, tmp_path / kind, kind)
        if kind == "truncated":
            cause = r"state/ocdbt\.process_0/d/\w+ holds 1,000 bytes; the checkpoint needs [\d,]+"
        if kind == "manifest_deleted":
            cause = r"state/manifest\.ocdbt is missing"
        assert inspect_ckpt.main([str(run_dir)]) == 1
        out, err = capsys.readouterr()
        assert re.match(rf"{run_dir}/checkpoints: 2 complete checkpoints, 1 of them damaged\n"
                        rf"  step       10  loss {losses[10]!r}\n"
                        rf"  step       15  damaged \({cause}\)\n\n", out), (kind, out)
        assert re.fullmatch(rf"inspect_ckpt.py: error: checkpoint {run_dir}/checkpoints/15 is "
                            rf"damaged \({cause}\); a resume moves it aside and starts from step "
                            r"10\n", err), (kind, err)


def test_no_readable_checkpoint_is_one_line_and_status_2(straight, tmp_path, capsys):
    """Both checkpoints damaged: the warnings name each, one error line, and nothing is moved."""
    run_dir = _stopped_at_15(straight[0], tmp_path / "run", "garbage")
    _meta_deleted(run_dir / "checkpoints" / "10")
    files = lambda: sorted(run_dir.glob("checkpoints/**/*"))  # noqa: E731
    before = files()
    assert launch.main(["--dry-run", *ARGS, "train.steps=15", f"run.dir={run_dir}"]) == 2
    assert re.fullmatch(
        rf"launch.py: error: none of the 2 checkpoints in {run_dir}/checkpoints is readable "
        rf"\(checkpoint 10: meta/metadata is missing; checkpoint 15: {DAMAGE['garbage'][1]}\); "
        "move them aside to start over, or set run.dir to a new directory\n",
        capsys.readouterr().err)
    status = launch.main([*ARGS, "train.steps=15", f"run.dir={run_dir}"])
    out, err = capsys.readouterr()
    assert_refused(status, err, f"2 checkpoints in {run_dir}/checkpoints", "run.dir")
    assert re.search(rf"checkpoints/15 is unreadable \({DAMAGE['garbage'][1]}\)", out)
    assert "checkpoints/10 is unreadable (meta/metadata is missing)" in out
    assert files() == before and not (run_dir / "damaged_checkpoints").exists()
