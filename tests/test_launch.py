"""The real entry point: a 3-step run on `tiny`, the dry run, and every bad input -> one line, exit 2."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from helpers import ROOT, assert_refused, run_launch

import launch
from jaxtron import config
from jaxtron.commands import train as train_command
from jaxtron.config import DataConfig, DatasetEntry, TrainConfig
from jaxtron.data import prepared
from jaxtron.plan import costs


def test_three_step_run_writes_metrics_config_and_events(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_launch("train.steps=3", "train.log_every=1", "train.seq_len=128", f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert tuple(row) == costs.KEYS
        assert row["mfu"] is None  # CPU: no peak in the table, so no guess
        assert row["tokens_per_sec"] > 0 and row["step_time"] > 0 and row["tflops_per_device"] > 0
        assert row["tokens"] == row["step"] * 16 * 128  # tiny's batch_size x seq_len
    assert rows[0]["lr"] == 0.0 and rows[1]["lr"] > 0  # linear warmup from 0
    assert 8.0 < rows[0]["loss"] < 10.0  # ~ln(8192) = 9.01 at initialisation
    saved = yaml.safe_load((run_dir / "config.yaml").read_text())
    assert saved["train"]["steps"] == 3 and saved["train"]["seq_len"] == 128
    assert list((run_dir / "tensorboard").glob("events.out.tfevents.*"))
    assert "parameters: 7,342,336" in proc.stdout
    # After "compiled", what comes and when (the first logged step was a long silence); before
    # the first evaluation, that it compiles; at the end, the commands that use the run.
    said = [line.split(" ", 1)[1] for line in proc.stdout.splitlines() if line[:2].isdigit()]
    compiled = next(i for i, line in enumerate(said) if line.startswith("compiled the train"))
    assert said[compiled + 1] == (
        "training steps 1..3: the loss every step (train.log_every), the held-out loss every 50 "
        "steps (train.eval_every; the first evaluation compiles its step), a checkpoint every 50 "
        "steps")
    assert said.index("evaluating at step 3 on 4 held-out batches (compiling the eval step "
                      "first)") == said.index(next(x for x in said if x.startswith("eval "))) - 1
    assert said[-3].startswith("done: step 3") and said[-2].startswith("goodput ")
    assert said[-1] == (f"next: jaxtron generate {run_dir} --prompt TEXT (continue a prompt); "
                        f"jaxtron convert-hf export {run_dir} OUT_DIR (a Hugging Face model); "
                        f"jaxtron plot {run_dir} (the loss curves)")
    # each command as printed runs (as a process: in-process, a command names this one after it)
    for command in said[-1].removeprefix("next: ").split("; "):
        args = command.split(" (")[0].split()[1:]
        args = [{"TEXT": "def", "OUT_DIR": str(tmp_path / "hf")}.get(a, a) for a in args]
        extra = ["--max-new-tokens", "2"] if args[0] == "generate" else []
        extra += ["--out", str(tmp_path / "plots")] if args[0] == "plot" else []
        done = subprocess.run([sys.executable, "-m", "jaxtron.commands", *args, *extra],
                              cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (command, done.stderr[-2000:])
    assert (tmp_path / "hf" / "config.json").is_file()


def test_dry_run_plans_llama3_70b_without_allocating(capsys):
    rc = launch.main(["--config", "configs/llama3_70b.yaml", "--dry-run", "--devices", "64",
                      "mesh.tensor=8"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "parameters: 70,553,706,496" in out
    assert "mesh: data=1, stage=1, fsdp=8, tensor=8 (64 devices)" in out
    # fp32 weights split 64 ways, except the (2 * 80 + 1) RMSNorm scales of 8192, kept whole.
    norms = (2 * 80 + 1) * 8192
    expected = (70_553_706_496 - norms) * 4 // 64 + norms * 4
    assert f"parameter bytes per device: {expected:,} bytes" in out
    # AdamW mu and nu, plus two int32 step counters (Adam's and the schedule's)
    assert f"optimizer bytes per device: {2 * expected + 8:,} bytes" in out
    # The estimated peak, every term printed, summing to the total (jaxtron/plan/memory.py).
    total = int(out.split("memory per device, estimated: ")[1].split(" bytes")[0].replace(",", ""))
    terms = out.split("memory per device, estimated: ")[1].split("verdict:")[0].splitlines()[1:]
    sizes = [int(line.split(": ")[1].split(" bytes")[0].replace(",", ""))
             for line in terms if line.startswith("  ")]
    assert sum(sizes) == total and len(sizes) >= 9
    assert f"  params: {expected:,} bytes" in out and f"  grads: {expected:,} bytes" in out


# Bad input, and the names its one line must hold: the key or flag, and what to use instead.
BAD_INPUTS = [
    (["train.stpes=5"], ["train.stpes", "train.steps"]),
    (["train.lr=0.1"], ["train.lr", "optim.lr"]),  # across sections
    (["xla.collective_matmul=true"], ["xla.collective_matmul", "model.collective_matmul"]),
    (["train.steps=abc"], ["train.steps", "integer", "abc"]),
    (["train.steps=3.5"], ["train.steps", "integer", "3.5"]),
    (["optim.lr=inf"], ["optim.lr=inf", ">= 0"]),
    (["model.sliding_window=-1"], ["model.sliding_window=-1"]),
    (["run.compile_cache=/proc/jaxtron-cache"], ["run.compile_cache=/proc/jaxtron-cache"]),
    (["xla.flags=--foo"], ["xla.flags=[--foo]"]),
    (["=3"], ["'=3'", "section.key=value"]),
    (["run.dir=runs/a\nb"], ["run.dir='runs/a\\nb'", "control character"]),  # not "runs/a b"
    (["run.compile_cache=/tmp/c\tx"], ["run.compile_cache='/tmp/c\\tx'", "control character"]),
    (["--config", "tinyy"], ["tinyy", "a preset's name is one of", "tiny_moe"]),
    (["--gpus-per-host", "4", "train.steps=1"], ["--gpus-per-host", "--compile-for"]),
    (["--gpu", "h100", "train.steps=1", "train.seq_len=64", "train.eval_every=0"],
     ["--gpu h100", "--dry-run"]),
    (["--gpu", "h200", "--compile-for", "h100", "--devices", "8"], ["--gpu h200", "--compile-for"]),
    (["optim.lr=-1"], ["optim.lr=-1.0", ">= 0"]),
    (["optim.warmup_steps=-3"], ["optim.warmup_steps=-3", ">= 0"]),
    (["checkpoint.every=-1"], ["checkpoint.every=-1", ">= 0"]),
    (["optim.b2=1.5"], ["optim.b2=1.5", "[0, 1)"]),
    (["model.norm_eps=0"], ["model.norm_eps=0.0", "> 0"]),
    (["checkpoint.keep=0"], ["checkpoint.keep=0", ">= 1"]),
    (["--dry-run", "--devices", "0"], ["--devices 0", "at least 1"]),
    (["mesh.fsdp=3"], ["3 devices", "8 are available"]),
    (["mesh.tensor=8", "mesh.fsdp=1"], ["model.num_heads=4", "mesh.tensor=8"]),
    (["train.batch_size=12"], ["data*fsdp*expert=8", "train.batch_size=8 or 16"]),
    (["train.batch_size=12", "train.microbatches=5"],  # each value named works with the mesh
     ["train.batch_size=12", "train.microbatches=5", "train.batch_size=40"]),
    (["train.batch_size=16", "train.microbatches=3", "mesh.fsdp=2", "mesh.data=4"],
     ["train.batch_size=16", "train.microbatches=3", "train.batch_size=24",
      "train.microbatches=2"]),  # it said 15 or 18, which the next check refused
    (["train.batch_size=8", "train.microbatches=2"],
     ["train.microbatches=2", "data*fsdp*expert=8", "train.batch_size=16", "train.microbatches=1"]),
    (["mesh.stage=2", "mesh.fsdp=4", "train.batch_size=4"],
     ["data*fsdp*stage=8", "train.batch_size=8"]),
    (["--config", "configs/nope.yaml"], ["configs/nope.yaml", "not found"]),
    (["model.dtype=fp8"], ["model.dtype=fp8"]),
    (["mesh.data=-1", "mesh.fsdp=-1"], ["-1"]),
    (["--bogus"], ["--bogus"]),
    # heads, kv heads, seq and batch all divide tensor=2 (fsdp=4): only the weight width is off
    (["mesh.tensor=2", "model.mlp_dim=769"], ["769", "tensor", "model.mlp_dim=770"]),
    (["mesh.tensor=2", "model.vocab_size=8191"],  # it said "the model width"
     ["8191", "tensor", "model.vocab_size=8192"]),
    (["mesh.tensor=2", "train.seq_len=255"], ["train.seq_len=255", "mesh.tensor=2"]),
    (["--devices", "8"], ["--devices", "--dry-run"]),
    (["model.remat=everything"], ["model.remat=everything", "save_dots"]),
    (["model.attention=flash"], ["model.attention=flash", "cudnn"]),
    (["--dry-run", "model.remat=everything"], ["model.remat=everything"]),
    (["--dry-run", "model.attention=cudnn"], ["model.attention=cudnn", "model.dtype=bfloat16"]),
    (["model.attention=cudnn", "model.dtype=bfloat16"],
     ["model.attention=cudnn", "cpu", "model.attention=auto"]),
]


def _main(args: list[str]) -> int:
    """launch.main's status, also where argparse exits with SystemExit."""
    try:
        return launch.main(args)
    except SystemExit as e:
        return e.code


def _fake_checkpoint(run_dir: Path, step: int, config_yaml: str) -> Path:
    """What the start-up checks read of a checkpoint (its metadata), without arrays."""
    path = run_dir / "checkpoints" / str(step)
    (path / "state").mkdir(parents=True)
    (path / "state" / "_METADATA").write_text("{}")
    (path / "meta").mkdir()
    (path / "meta" / "metadata").write_text(json.dumps({"step": step, "config": config_yaml}))
    return path


@pytest.mark.parametrize("args,names", BAD_INPUTS, ids=[" ".join(a) for a, _ in BAD_INPUTS])
def test_bad_input_is_one_line_and_status_2(tmp_path, capsys, args, names):
    rc = _main([*args, f"run.dir={tmp_path / 'run'}"])  # not ./runs/tiny, whatever it holds
    out, err = capsys.readouterr()
    assert_refused(rc, err, *names)
    assert out == ""  # nothing before the error: no flags line, no warning saying it twice
    assert not (tmp_path / "run").exists()


# Overrides that keep the run small: restore is checked after the data loads, before compiling.
SMALL_RUN = ["train.steps=1", "train.seq_len=64", "train.eval_every=0", "run.tensorboard=false",
             "run.progress=lines"]


def _not_a_checkpoint(tmp_path: Path, kind: str) -> Path:
    """A path that looks nothing like `.../checkpoints/<step>`, or is a step with no state."""
    paths = {"empty_dir": tmp_path / "empty", "empty_step_dir": tmp_path / "checkpoints" / "7",
             "file": tmp_path / "notes.txt", "missing": tmp_path / "nope" / "checkpoints" / "7"}
    path = paths[kind]
    if kind.endswith("dir"):
        path.mkdir(parents=True)
    elif kind == "file":
        path.write_text("not a checkpoint")
    return path


@pytest.mark.parametrize("kind", ["empty_dir", "empty_step_dir", "file", "missing"])
def test_restore_from_a_non_checkpoint_is_one_line_and_status_2(tmp_path, capsys, kind):
    path = _not_a_checkpoint(tmp_path, kind)
    rc = _main([*SMALL_RUN, f"checkpoint.restore={path}", f"run.dir={tmp_path / 'run'}"])
    message = f"checkpoint.restore={path} is not a checkpoint (.../checkpoints/<step>)"
    assert_refused(rc, capsys.readouterr().err, message)


def test_a_hugging_face_model_as_a_checkpoint_says_to_import_it(tmp_path, capsys):
    """checkpoint.restore (and inspect_ckpt) on a Hugging Face directory said only "not a
    checkpoint"; now the line names tools/convert_hf.py import."""
    hf_dir = tmp_path / "Llama 3"
    hf_dir.mkdir()
    (hf_dir / "config.json").write_text('{"model_type": "llama"}')
    (hf_dir / "model.safetensors").write_bytes(b"")
    hint = (f"is a Hugging Face model, not a jaxtron checkpoint; import it first ("
            f"jaxtron convert-hf import '{hf_dir}' OUT), then restore OUT with "
            "checkpoint.weights_only=true")
    for weights_only in ("false", "true"):
        rc = _main([*SMALL_RUN, f"checkpoint.restore={hf_dir}", f"run.dir={tmp_path / 'run'}",
                    f"checkpoint.weights_only={weights_only}"])
        assert_refused(rc, capsys.readouterr().err, f"checkpoint.restore={hf_dir} {hint}")
    assert not (tmp_path / "run").exists()
    inspect = subprocess.run([sys.executable, str(ROOT / "tools" / "inspect_ckpt.py"), str(hf_dir)],
                             capture_output=True, text=True, timeout=120)
    assert (inspect.returncode, inspect.stderr) == (2, f"inspect_ckpt.py: error: {hf_dir} {hint}\n")


def test_restore_from_a_non_checkpoint_in_a_real_process_is_one_line(tmp_path):
    """The real stderr too: C++ or absl (orbax) logs would land there, unseen by capsys."""
    path = _not_a_checkpoint(tmp_path, "empty_step_dir")
    proc = run_launch(*SMALL_RUN, f"checkpoint.restore={path}", f"run.dir={tmp_path / 'run'}")
    message = f"checkpoint.restore={path} is not a checkpoint (.../checkpoints/<step>)"
    assert_refused(proc.returncode, proc.stderr, message)


def test_bad_input_in_a_real_process_exits_2_without_traceback():
    proc = run_launch("mesh.tensor=3")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("launch.py: error: mesh")


@pytest.mark.slow
def test_default_run_learns_well_below_unigram_entropy(tmp_path):
    """The default run as the README gives it (`jaxtron train`; here launch.py, which runs the same;
    ~7 min on 2 cores): 200 steps on the stdlib."""
    from jaxtron import config
    from jaxtron.data import corpus, tokenizer

    run_dir = tmp_path / "run"
    proc = run_launch(f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    cfg = config.load([ROOT / "configs" / "tiny.yaml"])
    sp = tokenizer.load_tokenizer(cfg.data, cfg.model.vocab_size)
    entropy = corpus.unigram_entropy(corpus.load_corpus(cfg.data, sp), sp.eos_id())  # 6.19 nats
    final = np.mean([row["loss"] for row in rows[-3:]])  # last 30 steps: single steps are noisy
    assert rows[-1]["step"] == 200
    assert final < entropy - 1.5, (final, entropy)  # measured: 4.38 vs 6.19


def test_train_on_a_dataset_made_by_prepare_data(tmp_path, capsys, monkeypatch):
    """The production path end to end: raw files -> tools/prepare_data.py -> launch.py. The
    datasets are checked once per start, dry or not (they were checked four times: the input,
    its tokenizer, the training and the evaluation batches, each on its own)."""
    import sysconfig

    import jaxtron.data

    checks = []

    def counted(*args):
        checks.append(args)
        return check(*args)

    check = prepared.check_dataset
    monkeypatch.setattr(prepared, "check_dataset", counted)
    monkeypatch.setattr(jaxtron.data.pipeline, "check_dataset", counted)

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    out = tmp_path / "ds"
    prep = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "prepare_data.py"), str(stdlib / "json" / "*.py"),
         str(stdlib / "email" / "*.py"), "--out", str(out), "--train-tokenizer", "1000",
         "--val-fraction", "0.2"], capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stderr[-2000:]
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["splits"]["val"]["documents"] > 0  # 4 of these 25 files under the sha256 rule
    run_dir = tmp_path / "run"
    rc = launch.main(["data.source=arrayrecord", f"data.mixture=[{{path: {out}}}]",
                      "model.vocab_size=1024", "train.steps=2", "train.log_every=1",
                      "train.eval_every=2", "train.seq_len=64", f"run.dir={run_dir}",
                      "run.tensorboard=false", "run.progress=lines"])
    assert rc == 0
    assert len(checks) == 1
    evals = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [2]
    assert abs(evals[0]["eval_perplexity"] - np.exp(evals[0]["eval_loss"])) < 1e-6 * evals[0]["eval_perplexity"]
    # A model too small for the dataset's tokenizer stops before compiling, in one line.
    capsys.readouterr()
    assert launch.main(["data.source=arrayrecord", f"data.mixture=[{{path: {out}}}]",
                        "model.vocab_size=512", f"run.dir={run_dir}2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "vocab" in err[0]
    # The dry run says how many times the run reads each dataset over (it said nothing; then
    # the datasets' average, 2.0 times here for a copy read 3.0 times and one read 1.0 time).
    have = manifest["splits"]["train"]["tokens"]
    shutil.copytree(out, tmp_path / "copy")
    steps = -(-2 * have // 512)  # batch 8 x 64: twice the dataset, rounded up to a step
    read = steps * 512
    args = ["--dry-run", "data.source=arrayrecord", "model.vocab_size=1024", f"train.steps={steps}",
            "train.batch_size=8", "train.seq_len=64", f"run.dir={run_dir}3"]
    checks.clear()
    assert launch.main([*args, f"data.mixture=[{{path: {out}}}]"]) == 0
    assert len(checks) == 1
    assert (f"data: 1 prepared dataset checked; the run reads {read:,} tokens, so it reads {out} "
            f"{read / have:,.1f} times over ({have:,} tokens, weight 1)\n") in capsys.readouterr().out
    assert launch.main([*args, f"data.mixture=[{{path: {out}, weight: 3}}, "
                               f"{{path: {tmp_path / 'copy'}, weight: 1}}]"]) == 0
    assert (f"data: 2 prepared datasets checked; the run reads {read:,} tokens, so it reads {out} "
            f"{0.75 * read / have:,.1f} times over ({have:,} tokens, weight 3)\n"
            ) in capsys.readouterr().out  # the copy, read half as many times as it holds: not said
    # A weight of 1e-9 beside 1: the dataset vanished from that line without a word.
    assert launch.main([*args, f"data.mixture=[{{path: {out}, weight: 1}}, "
                               f"{{path: {tmp_path / 'copy'}, weight: 1e-9}}]"]) == 0
    warned = (f"warning: the run reads less than one document of {tmp_path / 'copy'} (weight "
              "1e-09); raise its weight, or drop it from data.mixture")
    assert warned in capsys.readouterr().out.splitlines()
    # The run itself says so too (only the dry run did), in a run of a document or so.
    long_enough = -(-have // manifest["splits"]["train"]["documents"] // 512) + 1  # a document
    assert launch.main([*args[1:-1], f"train.steps={long_enough}", "train.eval_every=0",
                        "run.progress=lines", "checkpoint.every=0",
                        f"run.dir={run_dir}4", f"data.mixture=[{{path: {out}, weight: 1}}, "
                        f"{{path: {tmp_path / 'copy'}, weight: 1e-9}}]"]) == 0
    printed = capsys.readouterr().out
    assert any(line.endswith(warned) for line in printed.splitlines()), printed
    # Every dataset short of a document: a weight cannot help, a longer run can.
    data = DataConfig(source="arrayrecord", mixture=[DatasetEntry(str(out))])
    assert prepared.unread(data, TrainConfig(steps=1, batch_size=1, seq_len=1)) == (
        f"the run reads less than one document of {out} (weight 1); raise train.steps or "
        "train.batch_size")


@pytest.mark.parametrize("kind", ["file", "under_a_file"])
def test_a_run_dir_that_cannot_be_one_is_one_line(tmp_path, capsys, kind):
    """run.dir naming a file, or a path under one: one line and status 2, before compiling."""
    (tmp_path / "notes.txt").write_text("keep me")
    path = tmp_path / "notes.txt" if kind == "file" else tmp_path / "notes.txt" / "run"
    rc = _main([*SMALL_RUN, f"run.dir={path}"])
    message = "is a file; set run.dir" if kind == "file" else "cannot be written (Not a directory)"
    assert_refused(rc, capsys.readouterr().err, f"run.dir={path} {message}")
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_overrides_may_come_after_options(capsys):
    """`launch.py train.steps=5 --dry-run mesh.fsdp=1`: both overrides apply."""
    args = launch.parse_args(["train.steps=5", "--dry-run", "mesh.fsdp=1", "--devices", "1",
                              "train.seq_len=64"])
    assert args.dry_run and args.devices == 1
    assert args.overrides == ["train.steps=5", "mesh.fsdp=1", "train.seq_len=64"]
    assert _main(["train.steps=5", "--dry-run", "mesh.fsdp=1", "--devices", "1"]) == 0
    assert "steps: 5" in capsys.readouterr().out


def test_a_changed_model_on_a_run_dir_is_one_line_and_moves_nothing(tmp_path, capsys):
    """Resuming a run with other model sizes, or starting from a checkpoint of another model:
    one line naming the fields that differ, status 2; the checkpoints stay where they are. The
    dry run says the same."""
    run_dir = tmp_path / "run"
    assert run_launch(*SMALL_RUN, f"run.dir={run_dir}").returncode == 0
    proc = run_launch(*SMALL_RUN, "train.steps=2", "model.num_layers=2", f"run.dir={run_dir}")
    assert_refused(proc.returncode, proc.stderr,
                   f"{run_dir} holds checkpoints of another model (model.num_layers=4 -> 2); start "
                   "a new run.dir, or drop the override to resume with the checkpoints' "
                   "model.num_layers=4")
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1"]
    assert not (run_dir / "damaged_checkpoints").exists()
    assert "num_layers: 4" in (run_dir / "config.yaml").read_text()  # the refused run wrote nothing
    assert len(json.loads((run_dir / "goodput.json").read_text())) == 1
    proc = run_launch(*SMALL_RUN, f"checkpoint.restore={run_dir}", "checkpoint.weights_only=true",
                   "model.vocab_size=9000", f"run.dir={tmp_path / 'other'}")
    assert_refused(proc.returncode, proc.stderr,
                              f"checkpoint.restore={run_dir} holds another model "
                              "(model.vocab_size=8192 -> 9000)")
    assert not (tmp_path / "other").exists()
    for args, message in [
        (["model.num_layers=2", f"run.dir={run_dir}"],
         f"{run_dir} holds checkpoints of another model (model.num_layers=4 -> 2)"),
        ([f"checkpoint.restore={run_dir}", "checkpoint.weights_only=true", "model.vocab_size=9000",
          f"run.dir={tmp_path / 'other'}"],
         f"checkpoint.restore={run_dir} holds another model (model.vocab_size=8192 -> 9000)")]:
        rc = _main(["--dry-run", *args])
        out, err = capsys.readouterr()
        assert_refused(rc, err, message)
        assert out == ""
    assert not (tmp_path / "other").exists()


# A one-layer tiny_moe run that writes everything a run writes (its TensorBoard events too).
MOE_RUN = ["--config", "configs/tiny_moe.yaml", "model.num_layers=1", "train.steps=1",
           "train.batch_size=8", "train.seq_len=32", "train.eval_every=0", "run.progress=lines"]


def _snapshot(run_dir: Path) -> dict[str, bytes]:
    """Every file under run_dir with its bytes (the lock file's: whose pid holds it)."""
    return {str(p.relative_to(run_dir)): p.read_bytes() for p in sorted(run_dir.rglob("*"))
            if p.is_file()}


# Changed on resume: (override, the field as the checkpoints hold it). Arrays of other shapes
# (these were "unreadable" checkpoints, with advice to move good ones aside), and the same arrays
# computing another function (experts_per_token was taken silently: top-1 from there on).
CHANGED_ON_RESUME = [("model.moe.num_experts=4", "model.moe.num_experts=8"),
                     ("model.moe.mlp_dim=512", "model.moe.mlp_dim=0"),
                     ("model.qk_norm=true", "model.qk_norm=false"),
                     ("model.moe.experts_per_token=1", "model.moe.experts_per_token=2"),
                     ("model.moe.norm_topk_prob=false", "model.moe.norm_topk_prob=true"),
                     ("model.rope_theta=500000", "model.rope_theta=10000.0")]


def test_a_resume_that_changes_the_model_is_refused_before_writing(tmp_path, capsys):
    """Each change of CHANGED_ON_RESUME: one line naming the field, the checkpoints' value and
    this start's, and the fix; status 2; run.dir's files and their bytes as they were (no
    config.yaml, goodput record or TensorBoard file); the dry run says the same line. An
    implementation choice, or a training knob, resumes."""
    run_dir = tmp_path / "run"
    proc = run_launch(*MOE_RUN, f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    before = _snapshot(run_dir)
    assert "config.yaml" in before and "goodput.json" in before
    assert any(name.startswith("tensorboard/events") for name in before)
    for override, saved in CHANGED_ON_RESUME:
        new = override.split("=")[1]
        new = str(float(new)) if "rope" in override else new
        line = (f"{run_dir} holds checkpoints of another model ({saved} -> {new}); start a new "
                f"run.dir, or drop the override to resume with the checkpoints' {saved}")
        for dry in ([], ["--dry-run"]):
            rc = _main([*MOE_RUN, "train.steps=2", *dry, override, f"run.dir={run_dir}"])
            out, err = capsys.readouterr()
            assert_refused(rc, err, line)
            assert out == ""
            assert _snapshot(run_dir) == before, override
    proc = run_launch(*MOE_RUN, "train.steps=2", "model.moe.experts_per_token=1", f"run.dir={run_dir}")
    assert_refused(proc.returncode, proc.stderr, "model.moe.experts_per_token=2 -> 1")
    assert _snapshot(run_dir) == before
    for override in ("model.moe.kernel=xla", "model.moe.capacity_factor=1.5", "model.moe.aux_coef=0.1",
                     "model.remat=full", "model.moe.mlp_dim=384"):  # 384 = mlp_dim: the same width
        assert _main([*MOE_RUN, "train.steps=2", "--dry-run", override,
                      f"run.dir={run_dir}"]) == 0, override
        assert f"start: resumes from {run_dir}/checkpoints/1" in capsys.readouterr().out


def test_a_start_refused_after_the_lock_leaves_run_dir_as_it_was(tmp_path):
    """The one refusal that comes with reading the arrays (no checkpoint reads back) leaves
    run.dir's files as they were: config.yaml, goodput.json, metrics.jsonl and TensorBoard's
    events; the lock file names the last start that held it."""
    run_dir = tmp_path / "run"
    proc = run_launch(*MOE_RUN, f"run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (run_dir / "metrics.jsonl").unlink()  # a run.dir without it: the refused start adds none
    for f in (run_dir / "checkpoints" / "1" / "state").rglob("d/*"):
        f.write_bytes(f.read_bytes()[:10])
    before = _snapshot(run_dir)
    proc = run_launch(*MOE_RUN, "train.steps=2", "train.log_every=1", f"run.dir={run_dir}")
    assert_refused(proc.returncode, proc.stderr, f"the one checkpoint in {run_dir}/checkpoints "
                   "is unreadable")
    after = _snapshot(run_dir)
    assert after.pop(".jaxtron-run.lock") != before.pop(".jaxtron-run.lock")
    assert after == before


def test_a_run_dir_removed_while_compiling_is_one_line(tmp_path, capsys, monkeypatch):
    """run.dir deleted while the step compiles: one line naming it, status 4 (nothing could be
    saved), no traceback; run.dir is not made again."""
    from jaxtron.train import loop

    run_dir = tmp_path / "run"
    compile_step = loop._compile

    def removed_meanwhile(*args, **kwargs):
        compiled = compile_step(*args, **kwargs)
        shutil.rmtree(run_dir)
        return compiled

    monkeypatch.setattr(loop, "_compile", removed_meanwhile)
    rc = _main([*SMALL_RUN, f"run.dir={run_dir}"])
    assert_refused(rc, capsys.readouterr().err, f"run.dir {run_dir} was removed while the run "
                   "went on", code=4)
    assert not run_dir.exists()


def test_a_damaged_only_checkpoint_is_named_in_two_lines_not_buried(tmp_path, capsys):
    """Every array file of the one checkpoint truncated: the warning names TensorStore's cause
    (not a pybind repr of its spec), the error is stderr's one line, and the abandoned reads'
    exceptions (hundreds of asyncio lines at exit) are not printed. The dry run says where a
    run would start."""
    run_dir = tmp_path / "run"
    assert run_launch(*SMALL_RUN, "checkpoint.every=1", f"run.dir={run_dir}").returncode == 0
    assert _main(["--dry-run", *SMALL_RUN, "train.steps=3", f"run.dir={run_dir}"]) == 0
    assert (f"start: resumes from {run_dir}/checkpoints/1 (step 1 of 3: 2 steps to go)"
            in capsys.readouterr().out)
    for f in (run_dir / "checkpoints" / "1" / "state").rglob("d/*"):
        f.write_bytes(f.read_bytes()[:10])
    proc = run_launch(*SMALL_RUN, "train.steps=2", f"run.dir={run_dir}")
    assert_refused(proc.returncode, proc.stderr, "the one checkpoint in "
                              f"{run_dir}/checkpoints is unreadable; move it aside")
    warning = next(line for line in proc.stdout.splitlines() if "is unreadable" in line)
    assert "Error reading" in warning and "pybind" not in warning and len(warning) < 400, warning
    assert len(proc.stdout.splitlines()) < 15, proc.stdout
    for weights_only in ("false", "true"):  # the same checkpoint named by checkpoint.restore
        proc = run_launch(*SMALL_RUN, "train.steps=3", f"checkpoint.restore={run_dir}",
                       f"run.dir={tmp_path / 'new'}", f"checkpoint.weights_only={weights_only}")
        assert_refused(proc.returncode, proc.stderr, f"launch.py: error: checkpoint."
                                  f"restore={run_dir}: {run_dir}/checkpoints/1 is unreadable (")
        assert "Error reading" in proc.stderr and "pybind" not in proc.stderr
        assert not (tmp_path / "new").exists()  # the refused start left no half-made run.dir


@pytest.mark.parametrize("overrides,verdict", [
    (["mesh.data=64", "mesh.fsdp=1", "mesh.tensor=1"],
     "verdict: DOES NOT FIT: {total:.1f} GiB per device, "
     "{usable:.1f} GiB usable on one H100"),
    (["mesh.tensor=8", "model.num_layers=40"], "verdict: fits: {total:.1f} of {usable:.1f} GiB "
                                               "usable on one H100"),
])
def test_dry_run_gives_a_verdict_against_the_gpu(capsys, overrides, verdict):
    """The estimate printed above it against an H100's 80 GB times the share jax may use."""
    from jaxtron import config
    from jaxtron.program import aot

    args = ["--config", "configs/llama3_70b.yaml", "--dry-run", "--devices", "64", "--gpu",
            "h100", *overrides]
    rc = launch.main(args)
    out = capsys.readouterr().out
    total = int(out.split("memory per device, estimated: ")[1].split(" bytes")[0].replace(",", ""))
    cfg = config.load(["configs/llama3_70b.yaml"], overrides)
    usable = aot.capacity_bytes("h100") * aot.usable_fraction(cfg)
    assert rc == 0 and verdict.format(total=total / 2**30, usable=usable / 2**30) in out, out
    assert out.index("verdict:") < out.index("resolved config:")  # the summary comes first


@pytest.mark.parametrize("config,overrides,advice", [
    ("llama3_8b", ["mesh.fsdp=8", "model.remat=full", "train.microbatches=1"], "mostly activations (lm_head_and_loss 41.1 GiB and "
     "saved_activations 32.0 GiB): raise train.microbatches (now 1), or shard more"),
    ("llama3_70b", ["mesh.data=64", "mesh.fsdp=1", "mesh.tensor=1"], "mostly state (opt_state 525.7 GiB and params "
     "262.8 GiB): shard more (mesh.fsdp, mesh.tensor, mesh.stage)"),
])
def test_a_layout_that_does_not_fit_is_told_what_shrinks_its_largest_terms(capsys, config,
                                                                           overrides, advice):
    """8B on 8 GPUs with fsdp=8 already: 'shard more (mesh.fsdp...)' could not help; more
    microbatches can (tools/plan.py finds train.microbatches=2 at 65 GiB)."""
    devices = "8" if config == "llama3_8b" else "64"
    assert launch.main(["--config", f"configs/{config}.yaml", "--dry-run", "--devices", devices,
                        "--gpu", "h100", *overrides]) == 0
    verdict = next(line for line in capsys.readouterr().out.splitlines() if "verdict" in line)
    assert verdict.startswith("verdict: DOES NOT FIT: ") and advice in verdict, verdict
    if config == "llama3_8b":  # and the advice holds
        assert launch.main(["--config", f"configs/{config}.yaml", "--dry-run", "--devices", "8",
                            "--gpu", "h100", *overrides, "train.microbatches=8"]) == 0
        assert "verdict: fits" in capsys.readouterr().out


def test_on_cpu_the_verdict_is_against_this_machines_memory(capsys, monkeypatch):
    """The CPU devices share the host's memory: a 1B model said 'no limit known' and would have
    been killed by the out-of-memory killer without a word. The need is the estimate as a CPU
    program uses it (x1.4, measured) plus the process; near the limit there is no verdict."""
    from jaxtron.plan import memory
    from jaxtron.train import doctor

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 20 * 2**30)
    monkeypatch.setattr(memory, "process_bytes", lambda: 2**29)
    # room for the 1B's 13.8 GiB checkpoint whatever this machine's disk has: else the dry run
    # refuses the run.dir first, as a run here would (test_doctor covers that refusal)
    plenty = shutil.disk_usage(".")._replace(free=2**50)
    monkeypatch.setattr(doctor.shutil, "disk_usage", lambda path: plenty)
    assert launch.main(["--config", "configs/llama3_1b.yaml", "--dry-run", "--devices", "8"]) == 0
    out = capsys.readouterr().out
    total = int(out.split("memory per device, estimated: ")[1].split(" bytes")[0].replace(",", ""))
    need = (1.4 * 8 * total + 2**29 + 0.45 * 2**30) / 2**30
    assert (f"verdict: DOES NOT FIT: {need:.1f} GiB for 8 CPU devices (the estimate x1.4 as a CPU "
            "program uses it, and the process), 20.5 GiB available on this machine; mostly ") in out
    assert "run a smaller preset here (--config tiny)" in out
    args = ["--dry-run", "--devices", "8", "mesh.fsdp=8", "train.seq_len=512"]
    assert launch.main(args) == 0
    out = capsys.readouterr().out
    total = int(out.split("memory per device, estimated: ")[1].split(" bytes")[0].replace(",", ""))
    need = 1.4 * 8 * total + 2**29 + 0.45 * 2**30
    assert "verdict: fits: " in out and need < 0.75 * 20.5 * 2**30
    monkeypatch.setattr(memory, "available_host_bytes", lambda: int(need / 0.9) - 2**29)
    assert launch.main(args) == 0
    out = capsys.readouterr().out
    assert ("verdict: too close to call: " in out
            and "run a few steps (train.steps=3) and watch its memory, or leave room: " in out
            and "raise train.microbatches (now 1)" in out), out
    assert launch.main(["--dry-run", "--devices", "16", "mesh.fsdp=16"]) == 0  # not this machine
    assert "verdict: no device memory limit known here (cpu)" in capsys.readouterr().out


@pytest.mark.parametrize("overrides,message", [
    (["data.source=web"], "data.source=web is not one of stdlib, arrayrecord"),
    (["data.source=arrayrecord", "data.mixture=[{path: /nowhere, weight: 1}]"], "/nowhere"),
    (["data.source=arrayrecord", "data.mixture=[{path: /nowhere, weight: 0}]"], "weight=0"),
    (["model.vocab_size=100"], ("cannot train a tokenizer with model.vocab_size=100: too few "
                                "pieces for the sample's characters and the 256 byte pieces; use "
                                "model.vocab_size=354 or more")),
])
def test_dry_run_checks_the_data(capsys, tmp_path, overrides, message):
    """The dry run stops on the data mistakes the real run would stop on."""
    rc = _main(["--dry-run", f"run.dir={tmp_path / 'run'}", *overrides])
    assert_refused(rc, capsys.readouterr().err, message)


def test_progress_bar_counts_this_attempt_and_shows_the_step(tmp_path, capsys):
    """A resumed run's bar starts at its first step (rate and time left are this attempt's),
    moves every step, and shows loss, lr, grad norm, step time and throughput; lines carry the
    time."""
    from jaxtron.plan.costs import KEYS
    from jaxtron.train.metrics import MetricsWriter

    log = MetricsWriter(tmp_path, 1000, "bar", tensorboard=False)
    log.begin(600)
    assert (log.bar.n, log.bar.total) == (600, 1000) and log.bar.format_dict["rate"] is None
    log.tick(601)
    log.tick(602)
    assert log.bar.n == 602
    row = dict(zip(KEYS, (610, 2.5, 3e-4, 0.75, 12345.0, 1.8, None, None, 610 * 2048)))
    log.write(row)
    assert log.bar.n == 610
    assert log.bar.postfix == ("loss 2.5000 | lr 3.00e-04 | grad_norm 0.750 | 1800 ms/step | "
                               "12,345 tok/s")
    log.info("checkpoint 610")
    log.close()
    assert re.search(r"^\d\d:\d\d:\d\d checkpoint 610$", capsys.readouterr().out, re.MULTILINE)


def test_a_signal_during_start_up_is_status_75(monkeypatch, capsys, tmp_path):
    """SIGINT/SIGTERM before the loop takes them over (a checkpoint, then 75) also ends in 75
    and one line, so a batch system requeues the job instead of counting a crash. (`run` is
    jaxtron train's: patched on the shim, it trained in this process, into ./runs/tiny.)"""
    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_command, "run", interrupted)
    assert _main(["train.steps=1", f"run.dir={tmp_path / 'run'}"]) == launch.EXIT_PREEMPTED
    assert not (tmp_path / "run").exists()
    assert capsys.readouterr().err == ("stopped by a signal before training started (nothing to "
                                       "save); run the same command to start\n")


@pytest.mark.parametrize("kind", ["mixture", "tokenizer"])
def test_a_refused_start_writes_nothing(tmp_path, capsys, kind):
    """A data set-up the run cannot read stops in one line before run.dir, or any line on
    stdout (the xla flags line included), is written."""
    bad = {"mixture": ["data.source=arrayrecord", f"data.mixture=[{{path: {tmp_path / 'ds'}}}]"],
           "tokenizer": [f"data.tokenizer={tmp_path / 'nope.model'}"]}[kind]
    run_dir = tmp_path / "run"
    rc = _main([*SMALL_RUN, *bad, f"run.dir={run_dir}"])
    out, err = capsys.readouterr()
    message = {"mixture": f"data.mixture path {tmp_path / 'ds'}: cannot read",
               "tokenizer": f"data.tokenizer={tmp_path / 'nope.model'}: no such file"}[kind]
    assert_refused(rc, err, message)
    assert not run_dir.exists() and out == ""


@pytest.mark.parametrize("dry", [True, False], ids=["dry_run", "run"])
def test_a_compile_cache_that_is_a_file_is_one_line(tmp_path, capsys, dry):
    (tmp_path / "cache").write_text("keep me")
    for path, words in [(tmp_path / "cache", "is a file"),
                        (tmp_path / "cache" / "jax", f"is under a file, {tmp_path / 'cache'}")]:
        rc = _main([*(["--dry-run"] if dry else SMALL_RUN), f"run.compile_cache={path}",
                    f"run.dir={tmp_path / 'run'}"])
        out, err = capsys.readouterr()
        assert_refused(rc, err, f"run.compile_cache={path} {words}; set it to a directory")
        assert out == "" and not (tmp_path / "run").exists()
    assert (tmp_path / "cache").read_text() == "keep me"


@pytest.mark.parametrize("kind", ["file", "under_a_file", "restore"])
def test_dry_run_checks_run_dir_and_restore_as_a_run_would(tmp_path, capsys, kind):
    """The dry run refuses what the run would refuse, with the same line, and writes nothing."""
    (tmp_path / "notes.txt").write_text("keep me")
    run_dir = {"file": tmp_path / "notes.txt", "under_a_file": tmp_path / "notes.txt" / "run",
               "restore": tmp_path / "run"}[kind]
    restore = [f"checkpoint.restore={tmp_path / 'nope'}"] if kind == "restore" else []
    message = {"file": f"run.dir={run_dir} is a file; set run.dir",
               "under_a_file": f"run.dir={run_dir} cannot be written (Not a directory)",
               "restore": f"checkpoint.restore={tmp_path / 'nope'} is not a checkpoint"}[kind]
    for dry in (["--dry-run"], SMALL_RUN):
        rc = _main([*dry, f"run.dir={run_dir}", *restore])
        out, err = capsys.readouterr()
        assert_refused(rc, err, message)
        assert out == ""
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]
    assert (tmp_path / "notes.txt").read_text() == "keep me"


def test_dry_run_warns_of_warmup_longer_than_the_run_and_counts_in_words(capsys, tmp_path):
    assert _main(["--dry-run", "--devices", "1", "mesh.fsdp=1", "train.steps=10",
                  "optim.warmup_steps=50", f"run.dir={tmp_path}/run"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "xla flags: none" or out[0].startswith("xla flags: --")
    assert out[1] == ("warning: optim.warmup_steps=50 is more than train.steps=10: the run ends "
                      "during warm-up, before the learning rate reaches optim.lr=0.003; lower "
                      "optim.warmup_steps (or raise train.steps)")
    assert out[2] == "mesh: data=1, stage=1, fsdp=1, tensor=1 (1 device)"
    assert _main(["--dry-run", "train.steps=50", "optim.warmup_steps=50",
                  f"run.dir={tmp_path}/run"]) == 0
    assert "warning:" not in capsys.readouterr().out  # warm-up ends on the last step: meant


def test_help_gives_the_defaults(capsys):
    with pytest.raises(SystemExit):
        launch.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "--config PRESET a preset's name (llama3_8b; listed below) or a YAML file's path " \
           "(repeatable; later ones override earlier ones; default: tiny)" in text
    assert ("presets (--config NAME, shipped with jaxtron): deepseek_v3, gemma3_27b, gemma3_4b, "
            "gpt2_124m, gpt_oss_120b, gpt_oss_20b, gpu_base, llama2_7b, ") in text
    assert "(default: the local device's, if it reports one)" in text
    assert "GPUs per host (default 8)" in text


def test_compile_for_prints_nothing_before_a_layout_error():
    """--compile-for checks the layout before its flags line and the long compile."""
    proc = run_launch("--compile-for", "h100", "--devices", "8", "train.batch_size=12")
    assert_refused(proc.returncode, proc.stderr,
                              "train.batch_size=12 / train.microbatches=1 = 12 sequences per "
                              "microbatch is not divisible by data*fsdp*expert=8")
    assert proc.stdout == ""


@pytest.mark.parametrize("dry", [["--dry-run"], []])
def test_an_empty_run_dir_is_refused_not_the_working_directory(tmp_path, monkeypatch, capsys, dry):
    monkeypatch.chdir(tmp_path)
    rc = _main([*dry, "train.steps=1", "run.dir="])
    out, err = capsys.readouterr()
    assert_refused(rc, err, "run.dir is empty; name a directory")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("inside", ["checkpoints", "checkpoints/99", "checkpoints/new/run"])
def test_a_run_dir_inside_another_runs_checkpoints_is_refused(tmp_path, capsys, inside):
    """run.dir=runs/a/checkpoints/99 trained there; runs/a's next start took 99 for a damaged
    checkpoint and moved the whole run into damaged_checkpoints/ (its rotation would delete one
    named like a step it no longer keeps)."""
    other = tmp_path / "a"
    (other / "checkpoints").mkdir(parents=True)
    (other / "config.yaml").write_text("train: {steps: 20}\n")
    for dry in ([], ["--dry-run"]):
        rc = _main([*dry, *SMALL_RUN, f"run.dir={other / inside}"])
        assert_refused(rc, capsys.readouterr().err, (
            f"run.dir={other / inside} is inside the checkpoints directory {other / 'checkpoints'}, "
            "whose old checkpoints a run deletes (or moves aside) with what is in them; set run.dir "
            "to a directory outside it\n"))
    assert sorted(p.relative_to(other).as_posix() for p in other.rglob("*")) == [
        "checkpoints", "config.yaml"]


def test_a_run_dir_holding_other_files_is_not_written_into(tmp_path, capsys, monkeypatch):
    """`run.dir=.` in a source tree (or a dataset directory) would have mixed config.yaml,
    checkpoints/ and metrics.jsonl into the user's files; a directory of a run, an empty one and a
    new one are fine."""
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "data").mkdir()
    monkeypatch.chdir(tmp_path)
    for dry in ([], ["--dry-run"]):
        rc = _main([*dry, *SMALL_RUN, "run.dir=."])
        assert_refused(rc, capsys.readouterr().err, "run.dir=. holds other files (data, "
                                  "notes.txt) and no run; set run.dir to a new or empty directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["data", "notes.txt"]
    (tmp_path / "empty").mkdir()
    assert _main(["--dry-run", *SMALL_RUN, "run.dir=empty"]) == 0
    rc = _main(["--dry-run", *SMALL_RUN, f"run.dir={tmp_path / ('x' * 300)}"])
    assert_refused(rc, capsys.readouterr().err, "cannot be used (File name too long)")


def test_a_cache_that_cannot_be_written_is_one_line(tmp_path):
    """The tokenizer trained on first use goes into the cache; a read-only or missing place was
    an OSError traceback after the training."""
    env = {**os.environ, "JAXTRON_CACHE": "/proc/jaxtron-cache"}
    proc = subprocess.run([sys.executable, str(ROOT / "launch.py"), *SMALL_RUN,
                           f"run.dir={tmp_path / 'run'}"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)
    assert_refused(proc.returncode, proc.stderr, "into the cache /proc/jaxtron-cache (")
    assert "set data.cache_dir (or JAXTRON_CACHE) to a writable directory" in proc.stderr
    assert not (tmp_path / "run").exists()


def test_raising_train_steps_on_resume_warns_of_the_learning_rate_jump(tmp_path, capsys):
    """A finished run continued with a larger train.steps: a new cosine over the longer run puts
    the rate back near its peak (3.17e-4 -> 2.98e-3 in one report); the dry run and the run say
    so, with the setting that keeps the checkpoint's decay."""
    from jaxtron import config
    from jaxtron.step import optim

    run_dir = tmp_path / "run"
    short = [*SMALL_RUN, "train.steps=4", "optim.warmup_steps=1", f"run.dir={run_dir}"]
    assert run_launch(*short).returncode == 0
    assert _main(["--dry-run", *short, "train.steps=40"]) == 0
    warning = ("warning: the learning rate at step 4 jumps from 0.0003 (the checkpoint's "
               "schedule) to 0.00296 (train.steps=4 -> 40); to keep the checkpoint's schedule, "
               "set optim.decay_steps=4")
    assert warning in capsys.readouterr().out.splitlines()
    assert _main(["--dry-run", *short, "train.steps=40", "optim.decay_steps=4"]) == 0
    assert "learning rate" not in capsys.readouterr().out
    assert _main(["--dry-run", *short, f"checkpoint.restore={run_dir}"]) == 0  # ignored: say so
    assert (f"note: checkpoint.restore={run_dir} is not used: run.dir has checkpoints of its own"
            in capsys.readouterr().out)
    tiny = [launch.DEFAULT_CONFIG]
    saved, now = config.load(tiny, short[:-1]), config.load(tiny, [*short[:-1], "train.steps=40"])
    assert optim.schedule_jump(saved, saved, 4) is None
    assert optim.schedule_jump(saved, now, 4) == warning.removeprefix("warning: ")
    # Warm-up changed too: the line named only decay_steps, which then does not keep it.
    both = config.load(tiny, [*short[:-1], "train.steps=40", "optim.warmup_steps=3"])
    assert optim.schedule_jump(saved, both, 4).endswith(
        "(train.steps=4 -> 40, optim.warmup_steps=1 -> 3); to keep the checkpoint's schedule, set "
        "optim.warmup_steps=1 optim.decay_steps=4")


def test_what_a_failed_save_left_is_removed_without_a_word(tmp_path):
    """A save that failed leaves `<step>.orbax-checkpoint-tmp`; Orbax removes it at the next
    save of that step and logged an absl WARNING about it on stderr, even in a run that ends 0."""
    run_dir = tmp_path / "run"
    assert run_launch(*SMALL_RUN, "checkpoint.every=1", f"run.dir={run_dir}").returncode == 0
    (run_dir / "checkpoints" / "2.orbax-checkpoint-tmp").mkdir()
    proc = run_launch(*SMALL_RUN, "train.steps=2", f"run.dir={run_dir}")
    assert proc.returncode == 0 and proc.stderr == "", proc.stderr
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["1", "2"]


def test_a_checkpoint_of_an_older_config_schema_still_resumes(tmp_path, capsys):
    """A checkpoint whose saved config has a key this version dropped: its config is read without
    that key (the run's own config decides), not refused as an unknown key of a temporary file."""
    from jaxtron import config as config_lib

    run_dir = tmp_path / "run"
    saved = config_lib.to_yaml(config_lib.load([launch.DEFAULT_CONFIG], [f"run.dir={run_dir}"]))
    saved = saved.replace("xla:\n", "xla:\n  collective_matmul: true\n", 1)
    _fake_checkpoint(run_dir, 3, saved)
    assert launch.main(["--dry-run", f"run.dir={run_dir}"]) == 0, capsys.readouterr().err
    assert f"start: resumes from {run_dir}/checkpoints/3 (step 3 of" in capsys.readouterr().out


def test_a_finished_run_is_nothing_to_do_and_writes_nothing(tmp_path, capsys, monkeypatch):
    """Started again at or past train.steps: one line and status 0 before anything is written
    (on storage made read-only once the run finished, it was refused as unwritable), still
    after checking that run.dir holds this model."""
    from jaxtron import config as config_lib

    run_dir = tmp_path / "run"
    saved = config_lib.to_yaml(config_lib.load([launch.DEFAULT_CONFIG], [f"run.dir={run_dir}"]))
    _fake_checkpoint(run_dir, 3, saved)
    before = sorted(p.relative_to(run_dir) for p in run_dir.rglob("*"))
    assert launch.main([f"run.dir={run_dir}", "train.steps=3"]) == 0
    assert capsys.readouterr().out == (f"nothing to do: {run_dir} is trained to step 3 "
                                       "(train.steps=3); raise train.steps to train on, or set "
                                       "run.dir to a new directory\n")
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before
    assert launch.main([f"run.dir={run_dir}", "train.steps=3", "model.num_layers=2"]) == 2
    assert "holds checkpoints of another model" in capsys.readouterr().err
    from jaxtron import cli

    def read_only(path, key="run.dir"):
        raise config_lib.ConfigError(f"{key}={path} cannot be written (Read-only file system)")

    monkeypatch.setattr(cli, "check_run_dir", read_only)  # the storage, read-only by now
    for dry in ([], ["--dry-run"]):  # the dry run says what the run does
        assert launch.main([*dry, f"run.dir={run_dir}", "train.steps=3"]) == 0
        out = capsys.readouterr().out
        assert (f"start: nothing to do: {run_dir} is trained to step 3" in out if dry
                else out.startswith("nothing to do: "))
    assert sorted(p.relative_to(run_dir) for p in run_dir.rglob("*")) == before


def test_the_dry_run_refuses_a_run_dir_in_use_and_warns_of_an_inexact_resume(tmp_path, capsys):
    """What a run says at start, the dry run says: a run.dir locked by a run in progress is
    refused (the dry run said 'from scratch'), and a changed data layout is named (it printed
    nothing)."""
    from jaxtron import config as config_lib
    from jaxtron import data
    from jaxtron.checkpoint import RunDirLock

    run_dir = tmp_path / "run"
    lock = RunDirLock(run_dir)
    try:
        assert_refused(launch.main(["--dry-run", f"run.dir={run_dir}"]), capsys.readouterr().err,
                       f"run.dir {run_dir}", f"pid {os.getpid()} on host {socket.gethostname()}")
    finally:
        lock.release()
    saved = config_lib.load([launch.DEFAULT_CONFIG], [f"run.dir={run_dir}"])
    step = _fake_checkpoint(run_dir, 3, config_lib.to_yaml(saved))
    (step / "data").mkdir()
    position = {"grain": {}, "start": 0, "consumed": 35, **data.layout_of(saved.data, saved.train)}
    (step / "data" / "process_0-of-1.json").write_text(json.dumps(position))
    assert launch.main(["--dry-run", f"run.dir={run_dir}"]) == 0
    assert "warning: data:" not in capsys.readouterr().out
    assert launch.main(["--dry-run", f"run.dir={run_dir}", "train.seq_len=128"]) == 0
    assert ("warning: data: train.seq_len 256 -> 128 since the checkpoint: the input cannot "
            "resume exactly") in capsys.readouterr().out


def test_an_unfinished_prepared_dataset_says_to_rerun_prepare_data(tmp_path, capsys):
    """prepare_data stopped midway keeps its finished parts (.parts/) and has no manifest yet:
    named as unfinished, not as a manifest that cannot be read."""
    (tmp_path / "ds" / ".parts").mkdir(parents=True)
    rc = _main(["--dry-run", f"run.dir={tmp_path / 'run'}", "data.source=arrayrecord",
                f"data.mixture=[{{path: {tmp_path / 'ds'}, weight: 1}}]"])
    assert_refused(rc, capsys.readouterr().err,
                              f"data.mixture path {tmp_path / 'ds'} is an unfinished "
                              "jaxtron prepare-data output (no manifest.json yet); rerun the "
                              "same command to finish it")


def test_a_whole_state_restore_at_or_past_train_steps_is_refused(tmp_path, capsys):
    """It started, said 'nothing to do' and exited 0, leaving a run.dir with nothing trained."""
    from jaxtron import config as config_lib

    source = tmp_path / "source"
    saved = config_lib.to_yaml(config_lib.load([launch.DEFAULT_CONFIG], [f"run.dir={source}"]))
    step = _fake_checkpoint(source, 3, saved)
    run_dir = tmp_path / "run"
    for dry in ([], ["--dry-run"]):
        rc = _main([*dry, f"run.dir={run_dir}", f"checkpoint.restore={source}", "train.steps=3"])
        assert_refused(rc, capsys.readouterr().err, (
            f"checkpoint.restore={source} is at step 3, not before train.steps=3; raise "
            "train.steps, or fine-tune from its weights with checkpoint.weights_only=true "
            f"({step})"))
        assert not run_dir.exists()
    assert _main(["--dry-run", f"run.dir={run_dir}", f"checkpoint.restore={source}",
                  "train.steps=3", "checkpoint.weights_only=true"]) == 0
    capsys.readouterr()


def test_an_import_restored_as_a_whole_state_is_refused_by_the_dry_run_too(tmp_path, capsys):
    """checkpoint.restore=<an import> without checkpoint.weights_only=true: the dry run said
    'start: from ..., its whole state', exit 0; the run refused it after loading the data."""
    from jaxtron.checkpoint import weights

    step = tmp_path / "imp" / "checkpoints" / "0"
    (step / "state").mkdir(parents=True)
    (step / "state" / "_METADATA").write_text("{}")
    (step / "meta").mkdir()
    (step / "meta" / "metadata").write_text(json.dumps({
        "step": 0, "layout": weights.LAYERED,
        "config": config.to_yaml(config.load(["configs/tiny.yaml"], []))}))
    for dry in (["--dry-run"], []):
        assert_refused(launch.main([*dry, f"run.dir={tmp_path / 'run'}", "train.steps=2",
                                    f"checkpoint.restore={tmp_path / 'imp'}"]),
                       capsys.readouterr().err, f"checkpoint.restore={tmp_path / 'imp'}",
                       "checkpoint.weights_only=true")
    assert not (tmp_path / "run").exists()
