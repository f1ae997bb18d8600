"""tools/bench.py: a readable table by default, one JSON line with --json, the JSON appended to
--out; the numbers in both are the same measurement."""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import bench

SMALL = ["--steps", "1", "--warmup", "0", "train.seq_len=64", "train.batch_size=8",
         "model.num_layers=2", "mesh.fsdp=8"]


def test_table_by_default_and_json_on_request(tmp_path, capsys):
    out = tmp_path / "bench.jsonl"
    assert bench.main([*SMALL, "--out", str(out)]) == 0
    text = capsys.readouterr().out.strip().splitlines()
    table = dict(re.split(r"\s{2,}", line, maxsplit=1) for line in text)
    assert table["mesh"] == "data=1 stage=1 fsdp=8 tensor=1"
    assert table["batch x seq_len"] == "8 x 64" and table["MFU"] == "n/a"  # CPU: no known peak
    saved = json.loads(out.read_text())
    assert table["step time (median)"] == f"{saved['step_time_s']:.3f} s"
    assert table["tokens/s"] == f"{saved['tokens_per_s']:,.0f}"
    assert bench.main([*SMALL, "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["mesh"] == {"data": 1, "stage": 1, "fsdp": 8, "tensor": 1} and row["devices"] == 8


def test_bad_counts_are_refused_before_compiling(capsys):
    for args in (["--steps", "0"], ["--warmup", "-1"]):
        try:
            bench.main(args)
        except SystemExit as e:
            assert e.code == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert "must be at least 1 and --warmup" in err[-1], err
