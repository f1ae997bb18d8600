"""tools/bench.py: a readable table by default, one JSON line with --json, the JSON appended to
--out; the numbers in both are the same measurement."""

import dataclasses
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
import pytest
from helpers import assert_refused

from jaxtron.bench import benchmark
from jaxtron.commands import bench, bench_data

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
    assert table["step time (median)"] == f"{saved['step_time']:.3f} s"
    assert table["tokens/s"] == f"{saved['tokens_per_sec']:,.0f}"
    assert table["attention"] == "xla" and saved["attention_kernels"] == {}
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
    monkeypatch.setattr(benchmark, "measure", measured)
    assert bench.main(["--steps", "1"]) == 2
    assert capsys.readouterr() == ("", "bench.py: error: read, d_model 256\n")


@pytest.mark.parametrize("name, message", [
    ("out", "--out {t}/out is a directory; name a file"),
    ("nowhere/bench.jsonl", "--out {t}/nowhere/bench.jsonl: directory {t}/nowhere does not exist"),
])
def test_an_unusable_out_is_refused_before_measuring(tmp_path, capsys, monkeypatch, name, message):
    (tmp_path / "out").mkdir()
    monkeypatch.setattr(benchmark, "measure", lambda *args: pytest.fail("measured before checking --out"))
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
    assert_refused(exit.value.code, err, "bench_data.py: error:", f"--workers: '{workers}'",
                   "0,2,4", "tools/bench_data.py --help")


@pytest.mark.parametrize("args, message", [(["--warmup", "-1", "--batches", "5"],
                                            "--warmup -1 must be at least 0"),
                                           (["--batches", "0"], "--batches 0 must be at least 1")])
def test_bench_data_names_the_count_that_is_out_of_range(capsys, args, message):
    """It said "--batches 5 must be at least 1 and --warmup -1 at least 0", blaming both."""
    with pytest.raises(SystemExit) as exit:
        bench_data.main(args)
    err = capsys.readouterr().err
    assert_refused(exit.value.code, err, message, "tools/bench_data.py --help")


def test_bench_data_says_one_batch_and_that_it_is_too_few(capsys):
    """Too few timed batches still run (a quick look), with one line saying how many to ask for;
    from bench_data.MIN_BATCHES on, no warning."""
    small = ["--workers", "0", "--warmup", "0", "train.batch_size=8", "train.seq_len=32"]
    assert bench_data.main([*small, "--batches", "1"]) == 0
    out, err = capsys.readouterr()
    assert "0 warm-up + 1 timed batch\n" in out and out.count("workers=0: ") == 1
    assert err.startswith("bench_data.py: warning: --batches 1 ") and err.count("\n") == 1, err
    assert "--batches 50" in err, err
    assert bench_data.main([*small, "--batches", "50"]) == 0
    assert capsys.readouterr().err == ""


def test_a_state_larger_than_this_machine_is_refused_before_allocating(capsys, monkeypatch):
    from jaxtron.plan import memory

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 2**20)
    assert bench.main(SMALL) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and "GiB is available" in err, err


# --- suites: rows in processes of their own, failures as rows, the GPU suite's sizing ---


QUICK = benchmark.Suite("the local CPU devices", steps=2, warmup=1, rows=(
    benchmark.Row("tiny 2 layers", "tiny.yaml",
                  ("train.batch_size=8", "train.seq_len=64", "model.num_layers=2"), 0.2),
    benchmark.Row("three heads", "tiny.yaml", ("model.num_heads=3",), 0.2),  # 256 % 3: refused
    benchmark.Row("tiny 1 layer", "tiny.yaml",
                  ("train.batch_size=8", "train.seq_len=32", "model.num_layers=1"), 0.2),
))


def test_smoke_suite_prints_one_json_line_per_row_with_the_numbers(capsys):
    assert bench.main(["--suite", "smoke", "--json"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.strip().splitlines()]
    assert [row["config"] for row in rows] == [r.name for r in benchmark.SUITES["smoke"].rows]
    for row in rows:
        assert set(benchmark.KEYS) <= set(row) and "error" not in row, row
        assert row["tokens_per_sec"] == pytest.approx(
            row["batch"] * row["seq_len"] / row["step_time"])
        assert row["tflops_per_device"] > 0 and row["mfu"] is None  # CPU: no known peak
        assert row["step_time_min"] <= row["step_time"] <= row["step_time_max"]
        assert row["step_time_spread"] == pytest.approx(
            (row["step_time_max"] - row["step_time_min"]) / row["step_time"])
        assert row["peak_memory_bytes"] is None  # CPUs keep no allocator statistics
        assert row["attention"] == "xla" and row["compile_s"] > 0
        assert (row["steps"], row["warmup"]) == (3, 1)
    assert rows[0]["checks"] == dict.fromkeys(("attention", "xla_flags", "mem_fraction"),
                                              "not checked: cpu devices, no GPU")
    assert "checks" not in rows[1]


def test_gpu_suite_lists_its_rows_within_eight_minutes(capsys):
    """The rows in the order of what they prove, for a GPU window that may end early: a dense
    Llama row first (scripts/gpu_session.sh's first call runs it with MaxText), then the 8B
    and its FP8 variant."""
    assert bench.main(["--suite", "gpu", "--list"]) == 0
    lines = capsys.readouterr().out.strip().splitlines()
    rows = benchmark.SUITES["gpu"].rows
    assert len(lines) == len(rows) + 1 and len(rows) >= 4
    assert [line.split("  ")[0] for line in lines[:-1]] == [f"{i}. {row.name}".strip()
                                                           for i, row in enumerate(rows, 1)]
    total = float(re.search(r"([\d.]+) min", lines[-1]).group(1))
    assert total == sum(row.minutes for row in rows) <= 8
    assert [row.name for row in rows[:3]] == ["llama3_1b seq 4096", "llama3_8b 16 layers seq 8192",
                                              "llama3_8b 14 layers seq 8192 fp8"]
    wanted = {("gpt2_124m.yaml", 1024), ("llama3_1b.yaml", 4096), ("llama3_1b.yaml", 8192),
              ("llama3_8b.yaml", 8192)}
    assert {(row.config, int(dict(o.split("=") for o in row.overrides)["train.seq_len"]))
            for row in rows} == wanted


def test_a_failed_row_is_a_row_and_the_suite_goes_on(monkeypatch, capsys):
    monkeypatch.setitem(benchmark.SUITES, "smoke", QUICK)
    assert bench.main(["--suite", "smoke"]) == 1  # a row failed: status 1, every row printed
    lines = capsys.readouterr().out.splitlines()
    table = [line for line in lines if line.startswith("| ")]
    assert len(table) == 2 + len(QUICK.rows) and table[1].startswith("| --- |")  # head, rule
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in table[2:]]
    assert cells[0][0] == "tiny 2 layers" and cells[0][1] == "8 x 64" and cells[0][7] == "xla"
    assert cells[1][0] == "three heads" and cells[1][2].startswith(
        "FAILED: jaxtron bench: error: model.num_heads=3"), cells[1]
    assert cells[2][0] == "tiny 1 layer" and float(cells[2][2].replace(",", "")) > 0
    assert any(line.startswith("each row: 1 warm-up + 2 timed steps") for line in lines)


def test_a_row_that_hangs_is_stopped_and_said(monkeypatch, capsys):
    monkeypatch.setitem(benchmark.SUITES, "smoke", dataclasses.replace(QUICK, rows=QUICK.rows[:1]))
    monkeypatch.setattr(bench, "row_timeout", lambda row: 0.5)
    assert bench.main(["--suite", "smoke", "--json"]) == 1
    row = json.loads(capsys.readouterr().out)
    assert row["error"] == "timed out after 0 s" and row["tokens_per_sec"] is None
    assert set(benchmark.KEYS) <= set(row)


@pytest.mark.parametrize("stderr, said", [
    ("Traceback...\njaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory "
     "while trying to allocate 1.00GiB.\n", "out of memory: jaxlib.xla_extension.XlaRuntimeError: "
     "RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1.00GiB."),
    ("bench.py: error: model.attention=cudnn runs on NVIDIA GPUs only\n",
     "bench.py: error: model.attention=cudnn runs on NVIDIA GPUs only"),
    ("", "exit status -9"),
    ("Traceback (most recent call last):\n  File \"x.py\", line 1\nomegaconf.errors.ReadonlyConfigError"
     ": Cannot set value of read-only config node\n    full_key: model.vocab_size\n"
     "    object_type=ModelConfig\n", "omegaconf.errors.ReadonlyConfigError: Cannot set value of "
     "read-only config node"),
])
def test_a_failure_is_said_in_one_line(stderr, said):
    row = benchmark.SUITES["smoke"].rows[0]
    assert benchmark.failure(row, -9 if not stderr else 1, stderr) == said


@pytest.mark.parametrize("args, message", [
    (["--list"], "--list needs --suite (e.g. --suite gpu --list)"),
    (["--peer"], "--peer needs --suite (e.g. --suite gpu --peer)"),
    (["--rows", "1"], "--rows needs --suite (e.g. --suite gpu --rows 1,2)"),
    (["--suite", "gpu", "--rows", "2,6"], "--rows 6: suite gpu has 5 rows (see --suite gpu --list)"),
    (["--suite", "gpu", "--rows", "0"], "argument --rows: '0' is not a list of row numbers from 1, "
                                        "such as 1,3"),
    (["--suite", "gpu", "--rows", "1,1"], "argument --rows: '1,1' is not a list of row numbers "
                                          "from 1, such as 1,3"),
    (["--suite", "gpu", "train.steps=3"], "--suite runs its own configs; give --config and "
                                          "overrides without it"),
])
def test_suite_options_are_checked_in_one_line(capsys, args, message):
    with pytest.raises(SystemExit) as exit:
        bench.main(args)
    assert_refused(exit.value.code, capsys.readouterr().err, message, "tools/bench.py --help")


def test_rows_picks_rows_by_their_number(capsys):
    assert bench.main(["--suite", "gpu", "--list", "--rows", "4,2"]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = benchmark.SUITES["gpu"].rows
    assert [line.split("  ")[0] for line in lines[:2]] == [f"4. {rows[3].name}",
                                                            f"2. {rows[1].name}"]
    assert lines[2].startswith(f"total {rows[3].minutes + rows[1].minutes:4.1f} min")


def test_every_gpu_row_fits_one_h100_as_compiled():
    """Each row of the GPU suite, compiled for one H100 80GB here, fits in what jax may allocate
    (xla.mem_fraction 0.9 of 79.14 GiB: 71.23 GiB). Measured peaks (GiB): gpt2_124m 54.2,
    llama3_1b seq 4096 36.2, seq 8192 30.3, llama3_8b 16 layers 67.6, 14 layers in FP8 69.0."""
    from jaxtron.config import load, presets
    from jaxtron.program import aot

    usable = aot.capacity_bytes("h100") * 0.9
    for row in benchmark.SUITES["gpu"].rows:
        cfg = load([presets.PRESETS / row.config], list(row.overrides))
        compiled, plan, _ = aot.compile_step_for(cfg, "h100", 1)
        stats = compiled.memory_analysis()
        peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes
                - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
        assert peak <= usable, (row.name, peak / 2**30)
        assert "fmha" in compiled.as_text(), row.name  # cuDNN fused attention in each
