"""tools/plot.py on a real 6-step run of `tiny` and a resumed run written in the same format (steps
3-4 logged twice, the second time after a restart): the series it plots are the logged values, one
per step (the last), at the tokens the trainer counted (also across a resume that doubled the
batch); the PNGs are written; bad input exits 2."""

import json
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

import launch
from jaxtron.plan import costs

TOOL = Path(__file__).resolve().parents[1] / "tools" / "plot.py"
STEMS = ("loss", "lr", "throughput", "mfu", "grad_norm")


from helpers import assert_refused

from jaxtron.commands import plot


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("plot") / "real"
    assert launch.main([
        "train.steps=6", "train.log_every=1", "train.eval_every=3", "train.seq_len=64",
        "run.tensorboard=false", "run.progress=lines", f"run.dir={run_dir}",
    ]) == 0
    return run_dir


@pytest.fixture(scope="module")
def resumed_run(real_run, tmp_path_factory) -> Path:
    """Steps 1-4 logged at 4 x 32 tokens per step, a restart from the step-2 checkpoint with
    train.batch_size 8 (256 tokens per step), steps 3-6 logged again (other losses and an MFU this
    time), and a last line cut short by a kill."""
    run_dir = tmp_path_factory.mktemp("plot") / "resumed"
    run_dir.mkdir()
    real = _rows(real_run / "metrics.jsonl")
    first = [{**r, "loss": 10.0 + r["step"], "tokens": 128 * r["step"]} for r in real[:4]]
    second = [{**r, "loss": 5.0 - r["step"] / 4, "mfu": r["step"] / 8,
               "tokens": 256 + 256 * (r["step"] - 2)} for r in real[2:]]
    assert all(tuple(r) == costs.KEYS for r in first + second)
    lines = [json.dumps(r) + "\n" for r in first + second]
    (run_dir / "metrics.jsonl").write_text("".join(lines) + '{"step": 7, "loss": 4.')
    evals = [{"step": 3, "eval_loss": 9.5}, {"step": 3, "eval_loss": 8.5},
             {"step": 6, "eval_loss": 7.5}]
    (run_dir / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in evals))
    (run_dir / "config.yaml").write_text("train:\n  batch_size: 8\n  seq_len: 32\n")
    return run_dir


def test_real_run_series_are_the_logged_values(real_run):
    run = plot.load_run(real_run, "real")
    logged, evals = _rows(real_run / "metrics.jsonl"), _rows(real_run / "eval.jsonl")
    assert [r["step"] for r in run.rows] == [1, 2, 3, 4, 5, 6]
    assert run.tokens_per_step == 16 * 64  # tiny's batch_size x train.seq_len=64
    assert run.tokens(run.rows) == [1024, 2048, 3072, 4096, 5120, 6144]
    assert [r["loss"] for r in run.rows] == [r["loss"] for r in logged]
    assert run.series("lr") == ([1, 2, 3, 4, 5, 6], [r["lr"] for r in logged])
    assert run.series("mfu")[1] == [None] * 6  # CPU: no peak
    assert [(r["step"], r["eval_loss"]) for r in run.evals] == [(3, evals[0]["eval_loss"]),
                                                                (6, evals[1]["eval_loss"])]
    assert run.tokens(run.evals) == [3072, 6144]


def test_restarted_steps_keep_their_last_row(resumed_run, real_run):
    run = plot.load_run(resumed_run, "resumed")
    assert [r["step"] for r in run.rows] == [1, 2, 3, 4, 5, 6]  # the cut-short step 7 dropped
    assert [r["loss"] for r in run.rows] == [11.0, 12.0, 4.25, 4.0, 3.75, 3.5]
    assert run.series("mfu")[1] == [None, None, 0.375, 0.5, 0.625, 0.75]
    assert run.tokens(run.rows) == [128, 256, 512, 768, 1024, 1280]  # not step x 8 x 32
    assert run.tokens(run.evals) == [512, 1280]
    assert run.tokens([{"step": 8}]) == [1280 + 2 * 256]  # past the last row: at 8 x 32 per step
    assert [(r["step"], r["eval_loss"]) for r in run.evals] == [(3, 8.5), (6, 7.5)]
    assert run.series("grad_norm")[1] == [r["grad_norm"] for r in _rows(real_run / "metrics.jsonl")]


def test_figures_draw_the_series(real_run, resumed_run):
    runs = [plot.load_run(real_run, "real"), plot.load_run(resumed_run, "resumed")]
    made, notes = plot.figures(runs)
    assert tuple(made) == STEMS and notes == []
    lines = {line.get_label(): line.get_xydata().tolist() for line in made["loss"].axes[0].lines}
    assert lines["resumed train"] == [[t, loss] for t, loss in zip(
        [128, 256, 512, 768, 1024, 1280], [11.0, 12.0, 4.25, 4.0, 3.75, 3.5])]
    assert lines["resumed eval"] == [[512, 8.5], [1280, 7.5]]
    assert lines["real train"] == [[1024.0 * r["step"], r["loss"]] for r in runs[0].rows]
    assert made["loss"].axes[0].get_yscale() == "log"
    mfu = {line.get_label(): line.get_xydata().tolist() for line in made["mfu"].axes[0].lines}
    assert mfu == {"resumed": [[3, 37.5], [4, 50.0], [5, 62.5], [6, 75.0]]}  # percent; real: none
    lr = {line.get_label(): line.get_ydata().tolist() for line in made["lr"].axes[0].lines}
    assert lr["real"] == [r["lr"] for r in runs[0].rows]


def _check_png(path: Path) -> None:
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(path)
    assert image.ndim == 3 and image.shape[0] >= 400 and image.shape[1] >= 700
    assert image[..., :3].std() > 0.05  # not blank


def test_cli_writes_pngs(real_run, resumed_run, tmp_path, capsys):
    out = tmp_path / "compare"
    assert plot.main([str(real_run), str(resumed_run), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert printed == [str(out / f"{stem}.png") for stem in STEMS]
    for stem in STEMS:
        _check_png(out / f"{stem}.png")


def test_cli_default_dir_and_no_mfu_on_cpu(real_run):
    proc = subprocess.run([sys.executable, str(TOOL), str(real_run)], check=False,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "skipped mfu.png: no run logged mfu (null on devices without a known peak" in proc.stdout
    written = sorted(p.name for p in (real_run / "plots").iterdir())
    assert written == sorted(f"{stem}.png" for stem in STEMS if stem != "mfu")
    _check_png(real_run / "plots" / "loss.png")


def test_bad_input_is_one_line_and_exit_2(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    (tmp_path / "noise").mkdir()
    (tmp_path / "noise" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\nnot json\n{}\n')
    (tmp_path / "blank").mkdir()
    (tmp_path / "blank" / "metrics.jsonl").write_text("")
    for name, config in (("bare", None), ("badyaml", "train: [1, 2\n"), ("listyaml", "- 1\n"),
                         ("word", "train: {batch_size: 8, seq_len: 32}\n")):
        (tmp_path / name).mkdir()  # bare: no config.yaml, no throughput logged
        (tmp_path / name / "metrics.jsonl").write_text(
            '{"step": 1, "loss": %s}\n' % ('"high"' if name == "word" else "2.0"))
        if config:
            (tmp_path / name / "config.yaml").write_text(config)
    cases = {tmp_path / "missing": "is not a directory", tmp_path / "empty": "has no metrics.jsonl",
             tmp_path / "noise": "metrics.jsonl:2: not a JSON row",
             tmp_path / "blank": "no rows yet", tmp_path / "bare": "the tokens seen are unknown",
             tmp_path / "badyaml": "config.yaml: not a YAML mapping of sections",
             tmp_path / "listyaml": "config.yaml: not a YAML mapping of sections",
             tmp_path / "word": "metrics.jsonl:1: loss 'high' is not a number",
             tmp_path / "noloss": "metrics.jsonl:1: a row without 'loss'",
             tmp_path / "noeval": "eval.jsonl:2: a row without 'eval_loss'"}
    for name in ("noloss", "noeval"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            '{"step": 1, "lr": 0.1}\n' if name == "noloss" else '{"step": 1, "loss": 2.0}\n')
    (tmp_path / "noeval" / "config.yaml").write_text("train: {batch_size: 8, seq_len: 32}\n")
    (tmp_path / "noeval" / "eval.jsonl").write_text('{"step": 1, "eval_loss": 2.5}\n{"step": 2}\n')
    for path, message in cases.items():
        assert plot.main([str(path)]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and message in err, err
        assert err.startswith("plot.py: error: "), err


def test_a_run_that_has_not_logged_yet_is_skipped_among_several(real_run, tmp_path, capsys):
    """Comparing runs, one just started (an empty metrics.jsonl) is a note, not the end; all of
    them empty is one line, exit 2."""
    for name in ("new", "newer"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("")
    out = tmp_path / "out"
    assert plot.main([str(real_run), str(tmp_path / "new"), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.splitlines()
    assert printed[0] == f"skipped new: {tmp_path / 'new' / 'metrics.jsonl'}: no rows yet (the run " \
                         "has not logged a step)"
    assert (out / "loss.png").is_file()
    assert_refused(plot.main([str(tmp_path / "new"), str(tmp_path / "newer")]),
                   capsys.readouterr().err, "plot.py: error:", "2 runs", "logged a step")


def test_a_short_series_is_marked_point_by_point(tmp_path):
    """One logged step: a line of one point draws nothing, so each point gets a marker (and a
    long series none)."""
    row = {"step": 1, "loss": 5.0, "lr": 0.1, "tokens_per_sec": 100.0, "grad_norm": 1.0,
           "step_time": 1.0, "mfu": 0.5}
    for name, steps in (("one", [1]), ("long", range(1, 61))):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text(
            "".join(json.dumps({**row, "step": s}) + "\n" for s in steps))
    made, _ = plot.figures([plot.load_run(tmp_path / "one", "one"),
                            plot.load_run(tmp_path / "long", "long")])
    for stem in STEMS:
        marks = {line.get_label().split()[0]: (line.get_marker(), line.get_markersize())
                 for line in made[stem].axes[0].lines}
        assert marks["one"] == ("o", 4) and marks["long"][0] == "None", (stem, marks)


@pytest.mark.parametrize("out, message", [
    ("afile", "--out {t}/afile is a file; give a directory"),
    ("afile/plots", "cannot make --out {t}/afile/plots: Not a directory"),
    ("/sys/jaxtron-plots", "cannot make --out /sys/jaxtron-plots: "),  # even root may not
])
def test_an_unusable_out_is_one_line_and_nothing_is_written(tmp_path, capsys, out, message):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "lr": 0.1}\n')
    (tmp_path / "run" / "config.yaml").write_text("train: {batch_size: 8, seq_len: 32}\n")
    (tmp_path / "afile").write_text("keep")
    out = out if out.startswith("/") else str(tmp_path / out)
    assert plot.main([str(tmp_path / "run"), "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert err.startswith(f"plot.py: error: {message.format(t=tmp_path)}"), err
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["afile", "config.yaml",
                                                          "metrics.jsonl", "run"]


def test_a_skipped_plot_gives_its_own_reason(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0, "lr": 0.1, '
                                            '"tokens_per_sec": 9.0, "step_time": 1.0}\n')
    _, notes = plot.figures([plot.load_run(tmp_path, "run")])
    assert notes == ["skipped mfu.png: no run logged mfu (null on devices without a known peak, "
                     "e.g. CPUs)", "skipped grad_norm.png: no run logged grad_norm"]
