"""tools/bench.py: a readable table by default, one JSON line with --json, the JSON appended to
--out; the numbers in both are the same measurement."""

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))
import bench
import bench_data
import pytest

SMALL = ["--steps", "1", "--warmup", "0", "train.seq_len=64", "train.batch_size=8",
         "model.num_layers=2", "mesh.fsdp=8"]


@pytest.fixture(autouse=True)
def _memory_share_kept_to_the_test(monkeypatch):
    """bench.main's xla_flags.apply() sets XLA_PYTHON_CLIENT_MEM_FRACTION where it is unset; set
    and unset here through monkeypatch, it is unset again after the test, for the next ones."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")


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


@pytest.mark.parametrize("args, message", [
    (["--steps", "0"], "--steps 0 must be at least 1"),
    (["--warmup", "-1"], "--warmup -1 must be at least 0"),  # was: --steps 10 must be ... too
])
def test_bad_counts_are_refused_before_compiling(capsys, args, message):
    with pytest.raises(SystemExit) as exit:
        bench.main(args)
    assert exit.value.code == 2 and capsys.readouterr() == (
        "", f"bench.py: error: {message} (see python tools/bench.py --help)\n")


def test_the_default_preset_is_found_from_any_directory(tmp_path, monkeypatch, capsys):
    """Run outside the repository, bench.py said `config file not found: configs/tiny.yaml`."""
    from jaxtron.config import ConfigError

    def measured(cfg, *_):
        raise ConfigError(f"read, d_model {cfg.model.d_model}")  # stop before compiling

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(bench, "bench", measured)
    assert bench.main(["--steps", "1"]) == 2
    assert capsys.readouterr() == ("", "bench.py: error: read, d_model 256\n")


@pytest.mark.parametrize("name, message", [
    ("out", "--out {t}/out is a directory; name a file"),
    ("nowhere/bench.jsonl", "--out {t}/nowhere/bench.jsonl: directory {t}/nowhere does not exist"),
])
def test_an_unusable_out_is_refused_before_measuring(tmp_path, capsys, monkeypatch, name, message):
    (tmp_path / "out").mkdir()
    monkeypatch.setattr(bench, "bench", lambda *args: pytest.fail("measured before checking --out"))
    assert bench.main([*SMALL, "--out", str(tmp_path / name)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1, err
    assert err.startswith(f"bench.py: error: {message}".format(t=tmp_path)), err
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("workers", ["x", "-1", "", "0,,2"])
def test_bench_data_refuses_bad_worker_counts_in_one_line(capsys, workers):
    with pytest.raises(SystemExit) as exit:
        bench_data.main(["--workers", workers])
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err == (
        f"bench_data.py: error: argument --workers: '{workers}' is not a list of counts of 0 or "
        "more, such as 0,2,4 (see python tools/bench_data.py --help)\n")


@pytest.mark.parametrize("args, message", [(["--warmup", "-1", "--batches", "5"],
                                            "--warmup -1 must be at least 0"),
                                           (["--batches", "0"], "--batches 0 must be at least 1")])
def test_bench_data_names_the_count_that_is_out_of_range(capsys, args, message):
    """It said "--batches 5 must be at least 1 and --warmup -1 at least 0", blaming both."""
    with pytest.raises(SystemExit) as exit:
        bench_data.main(args)
    err = capsys.readouterr().err
    assert exit.value.code == 2 and err == (f"bench_data.py: error: {message} (see python "
                                            "tools/bench_data.py --help)\n")


def test_bench_data_says_one_batch_and_that_it_is_too_few(capsys):
    """Too few timed batches still run (a quick look), with one line saying how many to ask for;
    from bench_data.MIN_BATCHES on, no warning."""
    small = ["--workers", "0", "--warmup", "0", "train.batch_size=8", "train.seq_len=32"]
    assert bench_data.main([*small, "--batches", "1"]) == 0
    out, err = capsys.readouterr()
    assert "0 warm-up + 1 timed batch\n" in out and out.count("workers=0: ") == 1
    assert err == ("bench_data.py: warning: --batches 1 is too few timed batches for a steady "
                   "rate; ask for --batches 50 or more\n")
    assert bench_data.main([*small, "--batches", "50"]) == 0
    assert capsys.readouterr().err == ""


def test_a_state_larger_than_this_machine_is_refused_before_allocating(capsys, monkeypatch):
    from jaxtron import memory

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 2**20)
    assert bench.main(SMALL) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "GiB is available" in err, err
