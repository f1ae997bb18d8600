"""A dataset shard found damaged mid-run: one line naming the dataset, shard and record, exit
status 2, and the checkpoints saved before it kept (docs/faults.md has every fault's row).

A shard can pass the start's checks (its footer and record count read back) and still hold a
chunk whose checksum fails: a disk or a copy that damaged the middle of the file. The reader
finds it only when the training stream reaches one of its records, possibly days into a run.
"""

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from array_record.python.array_record_module import ArrayRecordReader

ROOT = Path(__file__).resolve().parent.parent
STDLIB = Path(sysconfig.get_paths()["stdlib"])


def _unreadable(shard: Path) -> list[int]:
    """The records of `shard` whose chunk does not read back."""
    reader, bad = ArrayRecordReader(str(shard)), []
    for index in range(reader.num_records()):
        try:
            reader.read([index])
        except RuntimeError:
            bad.append(index)
    return bad


@pytest.fixture(scope="module")
def damaged(tmp_path_factory) -> tuple[Path, list[int]]:
    """A prepared dataset (20 documents, 129k tokens, one shard) with bytes in the middle of its
    shard overwritten: the footer reads, a record's chunk does not."""
    out = tmp_path_factory.mktemp("faults") / "ds"
    subprocess.run([sys.executable, str(ROOT / "tools" / "prepare_data.py"),
                    str(STDLIB / "email" / "*.py"), "--out", str(out), "--train-tokenizer", "1000"],
                   check=True, capture_output=True, timeout=300)
    (shard,) = out.glob("train-*.arrayrecord")
    with shard.open("r+b") as f:
        f.seek(shard.stat().st_size * 2 // 5)
        f.write(b"\xff" * 3000)
    bad = _unreadable(shard)
    assert bad and len(bad) < 5, bad  # one or two records, not the whole file
    return out, bad


def test_a_damaged_record_found_mid_run_is_one_line_and_keeps_the_checkpoints(tmp_path, damaged):
    out, bad = damaged
    run_dir = tmp_path / "run"
    # 16 x 256 tokens a step: the stream reads all 129k tokens within 40 steps.
    done = subprocess.run(
        [sys.executable, str(ROOT / "launch.py"), "data.source=arrayrecord",
         f"data.mixture=[{{path: {out}}}]", "model.vocab_size=1024", "model.num_layers=1",
         "model.d_model=64", "model.num_heads=2", "model.num_kv_heads=1", "model.mlp_dim=128",
         "train.eval_every=0", "train.steps=200", "train.log_every=1", "checkpoint.every=2",
         "run.tensorboard=false", "run.progress=lines", f"run.dir={run_dir}"],
        cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu", "XLA_FLAGS": ""}, capture_output=True,
        text=True, timeout=600)
    assert done.returncode == 2, done.stdout[-2000:] + done.stderr[-2000:]
    errors = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and len(errors) == 1, done.stderr[-3000:]
    assert errors[0].startswith(f"launch.py: error: data.mixture path {out}: shard "
                                "train-00000-00000.arrayrecord record "), errors[0]
    assert int(errors[0].split(" record ")[1].split()[0]) in bad
    assert "(Corrupted Riegeli/records file: " in errors[0] and "prepare it again" in errors[0]
    logged = [line for line in done.stdout.splitlines() if " | loss " in line]
    assert len(logged) >= 2  # found mid-run, not at the start
    saved = sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    assert saved and saved[-1] >= 2 and saved[-1] % 2 == 0  # the run's checkpoints are kept
