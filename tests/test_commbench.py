"""tools/commbench.py: nccl-tests' bus-bandwidth factors, each collective's result on 8 CPU devices
(so the benchmark times the real op), the command line's table, JSON and PNG, and bad input."""

import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import matplotlib.image
import numpy as np
import pytest

from jaxtron.config import MeshConfig
from jaxtron.parallel import MESH_AXES, make_mesh

TOOL = Path(__file__).resolve().parents[1] / "tools" / "commbench.py"
ROW = re.compile(r"^(\w+)\s+(\w+)\s+(\d+)\s+(\d+)\s+([\d.]+ [KMG]?i?B)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$")


from helpers import assert_refused

from jaxtron.commands import commbench as cb


# nccl-tests doc/PERFORMANCE.md: allreduce 2(n-1)/n, allgather and reducescatter (n-1)/n, sendrecv 1
@pytest.mark.parametrize("n, expected", [
    (4, {"all_reduce": 1.5, "all_gather": 0.75, "reduce_scatter": 0.75, "permute": 1.0}),
    (8, {"all_reduce": 1.75, "all_gather": 0.875, "reduce_scatter": 0.875, "permute": 1.0}),
])
def test_bus_factor_is_nccl_tests_definition(n, expected):
    assert {op: cb.bus_factor(op, n) for op in cb.OPS} == expected


def test_sizes_parse():
    assert cb.parse_sizes("1KiB..8KiB") == [1024, 2048, 4096, 8192]
    assert cb.parse_sizes("1MiB..1GiB")[-1] == 2**30 and len(cb.parse_sizes("1MiB..1GiB")) == 11
    assert cb.parse_sizes("512,4K,2MB,1M") == [512, 4096, 2_000_000, 2**20]
    assert cb.parse_sizes("3KiB..13KiB") == [3072, 6144, 12288]  # doubling, stops at the bound
    assert cb.human(1536) == "1.5 KiB" and cb.human(2**30) == "1 GiB" and cb.human(100) == "100 B"


def test_sizes_round_like_nccl_tests():
    # all-gather: each device sends size/n; sizes shrink to whole elements, n of them for AG/RS
    assert cb.local_count("all_gather", 4096, 4, 4) == (256, 4096)
    assert cb.local_count("reduce_scatter", 4100, 8, 4) == (1024, 4096)
    assert cb.local_count("all_reduce", 4102, 8, 2) == (2051, 4102)
    assert cb.local_count("permute", 4096, 8, 2) == (2048, 4096)


def _expected(op: str, x, shape: tuple[int, ...], k: int) -> np.ndarray:
    """What `op` over mesh dimension k gives every device, from the global input in numpy."""
    n, c = shape[k], x.size // math.prod(shape)
    x = x.reshape(*shape, c)
    if op == "all_reduce":
        out = np.broadcast_to(x.sum(k, keepdims=True), x.shape)
    elif op == "all_gather":  # every member: the members' parts concatenated in axis order
        whole = np.moveaxis(x, k, -2).reshape(*np.delete(shape, k), n * c)
        out = np.broadcast_to(np.expand_dims(whole, k), (*shape, n * c))
    elif op == "reduce_scatter":  # member i: the i-th 1/n of the sum
        out = np.moveaxis(x.sum(k).reshape(*np.delete(shape, k), n, c // n), -2, k)
    else:  # permute: member i receives member i-1's part (a ring shift by one)
        out = np.roll(x, 1, axis=k)
    return np.asarray(out).reshape(-1)


@pytest.mark.parametrize("mesh_sizes, axis", [
    ({"data": 2, "fsdp": 4}, "data"), ({"data": 2, "fsdp": 4}, "fsdp"),
    ({"stage": 4, "tensor": 2, "fsdp": 1}, "stage"), ({"stage": 4, "tensor": 2, "fsdp": 1}, "tensor"),
    ({"fsdp": 8}, "fsdp"),
])
@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter", "permute"])
def test_collective_computes_the_real_op(op, mesh_sizes, axis):
    mesh = make_mesh(MeshConfig(**mesh_sizes), jax.devices())
    n = mesh.shape[axis]
    per_device, nbytes = cb.local_count(op, 16 * n * 4, n, 4)
    x = cb.input_array(mesh, per_device, "float32")
    np.testing.assert_array_equal(np.asarray(x), np.arange(8 * per_device, dtype=np.float32))
    out = np.asarray(cb.collective(op, mesh, axis)(x))
    shape = tuple(mesh.shape[a] for a in MESH_AXES)
    np.testing.assert_array_equal(out, _expected(op, np.asarray(x), shape, MESH_AXES.index(axis)))
    # nccl-tests' size: the gathered buffer, the buffer before scattering, the reduced one
    per_device_bytes = out.size // 8 * 4 if op != "reduce_scatter" else per_device * 4
    assert nbytes == per_device_bytes == 16 * n * 4


def test_cli_writes_table_json_and_png(tmp_path):
    json_path, png_path = tmp_path / "cb.json", tmp_path / "cb.png"
    proc = subprocess.run(
        [sys.executable, str(TOOL), "mesh.fsdp=4", "mesh.data=2", "--sizes", "1KiB..4KiB",
         "--warmup", "1", "--iters", "2", "--json", str(json_path), "--plot", str(png_path)],
        check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "skipped (size 1): stage, tensor" in proc.stdout
    table = [ROW.match(line).groups() for line in proc.stdout.splitlines() if ROW.match(line)]
    expected = {(op, axis, size) for op in cb.OPS for axis in ("data", "fsdp")
                for size in ("1 KiB", "2 KiB", "4 KiB")}
    assert {(op, axis, size) for op, axis, _, _, size, *_ in table} == expected
    assert len(table) == len(expected)

    report = json.loads(json_path.read_text())
    assert report["devices"] == 8 and report["mesh"] == {"data": 2, "stage": 1, "fsdp": 4, "tensor": 1}
    rows = report["rows"]
    assert [(r["op"], r["axis"], cb.human(r["bytes"])) for r in rows] == [t[:2] + t[4:5] for t in table]
    for r, line in zip(rows, table):
        assert r["n"] == {"data": 2, "fsdp": 4}[r["axis"]] == int(line[2]) and r["hosts"] == 1
        assert r["algbw_gbps"] == pytest.approx(r["bytes"] / (r["time_us"] * 1e-6) / 1e9)
        assert r["busbw_gbps"] == pytest.approx(r["algbw_gbps"] * cb.bus_factor(r["op"], r["n"]))
        assert float(line[5]) == pytest.approx(r["time_us"], abs=0.051)
        assert float(line[7]) == pytest.approx(r["busbw_gbps"], abs=0.0051)

    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png_path)
    assert image.ndim == 3 and image.shape[2] in (3, 4)
    assert image.shape[0] >= 400 and image.shape[1] >= 1000  # two subplots side by side
    assert image[..., :3].std() > 0.05  # not blank


@pytest.mark.parametrize("args, message", [
    (["--axes", "fsdp,pipe"], "--axes: unknown 'pipe'"),
    (["--sizes", "4XB"], "'4XB' is not a size"),
    (["--sizes", "8KiB..1KiB"], "from a positive size upwards"),
    (["--ops", "broadcast"], "--ops: unknown 'broadcast'"),
    (["mesh.data=3"], "does not divide the 8 devices"),
    (["mesh.fsdp=2", "mesh.data=2"], "has 4 devices but 8 are available"),
    (["mesh.fsdp=8", "--axes", "data"], "nothing to measure"),
    (["mesh.fsdp=8", "--sizes", "2", "--ops", "all_gather"], "less than one 4-byte element"),
    (["mesh.fsdp=8", "--sizes", "8GiB"], "8 GiB is 2^31 or more 4-byte elements per device; use "
     "sizes below 8 GiB"),
    (["mesh.fsdp=8", "--sizes", "4GiB", "--dtype", "bfloat16"], "use sizes below 4 GiB"),
])
def test_bad_input_is_one_line_and_exit_2(capsys, args, message):
    assert cb.main([*args, "--iters", "1", "--warmup", "0"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("commbench.py: error: "), err
    assert message in err


@pytest.mark.parametrize("args, message", [(["--iters", "0"], "--iters 0 must be at least 1"),
                                           (["--warmup", "-2"], "--warmup -2 must be at least 0")])
def test_a_count_out_of_range_is_named(capsys, args, message):
    assert_refused(cb.main(["mesh.fsdp=8", *args]), capsys.readouterr().err, "commbench.py: error:",
                   message)


@pytest.mark.parametrize("flag, name, message", [
    ("--json", "out", "--json {t}/out is a directory; name a file"),
    ("--json", "nowhere/cb.json", "--json {t}/nowhere/cb.json: directory {t}/nowhere does not exist"),
    ("--plot", "cb.txt", "--plot {t}/cb.txt: name a file ending in .png, .pdf or .svg"),
    ("--plot", "/sys/cb.png", "cannot write --plot /sys/cb.png: "),  # even root may not
])
def test_an_unusable_output_is_refused_before_the_backend_starts(tmp_path, capsys, flag, name,
                                                                 message):
    (tmp_path / "out").mkdir()
    path = name if name.startswith("/") else str(tmp_path / name)
    assert cb.main(["mesh.fsdp=8", "--sizes", "1KiB", flag, path]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"commbench.py: error: {message.format(t=tmp_path)}"), err
    assert err.count("\n") == 1 and [p.name for p in tmp_path.iterdir()] == ["out"]


def test_a_size_too_small_for_one_op_is_refused_before_any_is_timed(capsys, monkeypatch):
    timed = []
    monkeypatch.setattr(cb, "seconds_per_call", lambda *args: timed.append(args) or 1.0)
    assert cb.main(["mesh.fsdp=8", "--sizes", "1KiB,2", "--iters", "1", "--warmup", "0"]) == 2
    out, err = capsys.readouterr()
    assert "1 iteration after 0 warm-up" in out and timed == []
    assert err.startswith("commbench.py: error: --sizes: 2 B is less than one 4-byte element"), err


def test_many_iterations_on_cpu_devices_do_not_deadlock():
    """300 calls launched back to back on 8 CPU devices: XLA's CPU collectives waited for a
    device's thread that never came, and XLA aborted the process 60 s later (status -6, a stack).
    CPU devices run one call at a time."""
    proc = subprocess.run([sys.executable, str(TOOL), "mesh.fsdp=8", "--ops", "all_reduce",
                           "--sizes", "1KiB..4KiB", "--iters", "300"],
                          check=False, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert len([line for line in proc.stdout.splitlines() if ROW.match(line)]) == 3


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_while_timing_is_one_line_and_keeps_the_rows_measured(sig):
    """Ctrl-C or SIGTERM while the calls are timed: one line and 130, within seconds; the rows
    measured before it are on stdout (the table was printed only at the end: all lost)."""
    proc = subprocess.Popen([sys.executable, str(TOOL), "mesh.fsdp=8", "--ops", "all_reduce",
                             "--sizes", "1KiB..1MiB", "--iters", "3000"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        for line in proc.stdout:  # 1 KiB's row is out, 2 KiB's timing has begun
            if ROW.match(line):
                break
        time.sleep(0.2)
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)
    assert (proc.returncode, err) == (130, "commbench.py: stopped by a signal\n")
    assert line.split()[:6] == ["all_reduce", "fsdp", "8", "1", "1", "KiB"]
    assert "1 MiB" not in out  # stopped before the end


def test_a_size_the_devices_cannot_hold_is_one_line(capsys, monkeypatch):
    """A --sizes too big for device memory ended in XLA's RESOURCE_EXHAUSTED traceback."""
    def out_of_memory(*args, **kwargs):
        raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: Out of memory allocating 4294967296 "
                                         "bytes.\nmore detail")

    monkeypatch.setattr(cb, "seconds_per_call", out_of_memory)
    assert_refused(cb.main(["mesh.fsdp=8", "--ops", "all_reduce", "--sizes", "4KiB"]),
                   capsys.readouterr().err, "--sizes 4 KiB", "all_reduce", "fsdp",
                   "RESOURCE_EXHAUSTED: Out of memory allocating 4294967296 bytes.",
                   "smaller --sizes")
