"""Train-step benchmark: step time, tokens/s, TFLOP/s per device, MFU and memory of a config, or
of a fixed suite of rows, with a peer framework measured on the same shapes in the same run.

    jaxtron bench --config llama3_1b train.batch_size=8 train.seq_len=4096
    jaxtron bench --suite gpu --list          # the rows and their expected minutes
    jaxtron bench --suite gpu --peer          # every row, then MaxText on the same shapes
    jaxtron bench --suite smoke --json        # the same harness on CPU, in seconds

The step is the real one (`train.compile_step`, the config's mesh and flags) on random tokens
(full-length documents), so the data pipeline is out of the measurement (jaxtron/bench/benchmark.py
says what each number is). One config prints a table (or, with --json, one JSON line); a suite
prints a markdown table (or one JSON line per row), each row measured in a process of its own, so
one row's peak memory or failure (out of memory, a kernel that will not run) is its own: a row
that fails says why and the suite goes on. --out appends the JSON lines to a file.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys

from jaxtron import cli, lifecycle


def parse_args(argv: list[str]) -> argparse.Namespace:
    from jaxtron.bench.benchmark import SUITES

    parser = cli.Parser(command="tools/bench.py", description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", default=[], help="YAML preset(s)")
    parser.add_argument("--suite", choices=sorted(SUITES),
                        help="run a fixed set of rows instead of one config (gpu: sized for one "
                             "80 GB H100; smoke: the same harness on CPU in seconds)")
    parser.add_argument("--list", action="store_true",
                        help="with --suite: name its rows with their expected minutes, run none")
    parser.add_argument("--rows", type=_positions, metavar="N,N",
                        help="with --suite: only these rows, numbered as --list numbers them")
    parser.add_argument("--peer", action="store_true",
                        help="with --suite: after each row, MaxText's train step on the same "
                             "shapes and tokens per step, and the ratio")
    parser.add_argument("--checks", action="store_true",
                        help="before measuring, the GPU-only checks (cuDNN attention on a packed "
                             "batch, the XLA flag preset, the memory fraction); a suite's first "
                             "row makes them")
    parser.add_argument("--steps", type=int, help="timed steps (default 10; a suite's own)")
    parser.add_argument("--warmup", type=int,
                        help="untimed steps after compiling (default 2; a suite's own)")
    parser.add_argument("--out", help="append the JSON result(s) to this file")
    parser.add_argument("--json", action="store_true", help="print JSON lines, not a table")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_intermixed_args(argv)
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps {args.steps} must be at least 1")
    if args.warmup is not None and args.warmup < 0:
        parser.error(f"--warmup {args.warmup} must be at least 0")
    if args.suite and (args.config or args.overrides):
        parser.error("--suite runs its own configs; give --config and overrides without it")
    for flag in ("list", "peer", "rows"):
        if getattr(args, flag) and not args.suite:
            parser.error(f"--{flag} needs --suite (e.g. --suite gpu --{flag}"
                         f"{' 1,2' if flag == 'rows' else ''})")
    if args.rows and max(args.rows) > len(SUITES[args.suite].rows):
        parser.error(f"--rows {max(args.rows)}: suite {args.suite} has "
                     f"{len(SUITES[args.suite].rows)} rows (see --suite {args.suite} --list)")
    return args


def _positions(text: str) -> list[int]:
    """--rows 1,3 -> [1, 3]: positions from 1, each once."""
    try:
        rows = [int(part) for part in text.split(",")]
    except ValueError:
        rows = []
    if not rows or min(rows) < 1 or len(set(rows)) != len(rows):
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of row numbers from 1, such as "
                                         "1,3")
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return lifecycle.one_line_errors(lambda: run_suite(args) if args.suite else report(args))


TABLE = (  # (label, key, format) of one config's table
    ("device", "device", "{}"), ("devices", "devices", "{}"), ("mesh", "mesh", "{}"),
    ("parameters", "params", "{:,}"), ("batch x seq_len", None, None),
    ("microbatches", "microbatches", "{}"), ("remat", "remat", "{}"),
    ("attention", "attention", "{}"), ("pipeline bubble", "bubble", "{:.1%}"),
    ("step time (median)", "step_time", "{:.3f} s"),
    ("step time (spread)", "step_time_spread", "{:.1%}"),
    ("tokens/s", "tokens_per_sec", "{:,.0f}"),
    ("TFLOP/s per device", "tflops_per_device", "{:.1f}"), ("MFU", "mfu", "{:.1%}"),
    ("compile", "compile_s", "{:.1f} s"), ("loss", "loss", "{:.4f}"),
    ("arguments per device", "argument_bytes", "{:.2f} GiB"),
    ("temporaries per device", "temp_bytes", "{:.2f} GiB"),
    ("peak in use (device)", "peak_memory_bytes", "{:.2f} GiB"),
)


def table(result: dict) -> str:
    """One result as aligned `label  value` lines (n/a where a value is unknown)."""
    lines = []
    for label, key, fmt in TABLE:
        if key is None:
            value = f"{result['batch']} x {result['seq_len']}"
        elif key == "mesh":
            value = " ".join(f"{axis}={size}" for axis, size in result["mesh"].items())
        elif result.get(key) is None:
            value = "n/a"
        else:
            value = fmt.format(result[key] / 2**30 if key.endswith("bytes") else result[key])
        lines.append(f"{label:<24} {value}")
    for name, verdict in result.get("checks", {}).items():
        lines.append(f"{'check ' + name:<24} {verdict}")
    return "\n".join(lines)


def report(args: argparse.Namespace) -> None:
    """Measure one config, print it as a table (or one JSON line), and append it to --out."""
    from jaxtron.bench import benchmark
    from jaxtron.config import load, presets
    from jaxtron.program import xla_flags

    if args.out:
        cli.writable_file(args.out, "--out")  # before the compile, not after the measurement
    cfg = load(args.config or [presets.PRESETS / "tiny.yaml"], args.overrides)  # from any directory
    xla_flags.apply(cfg.xla)  # before anything starts a backend
    steps = 10 if args.steps is None else args.steps
    warmup = 2 if args.warmup is None else args.warmup
    result = {"config": " ".join(args.config) or "tiny.yaml",
              **benchmark.measure(cfg, steps, warmup, args.checks), "overrides": args.overrides}
    line = json.dumps(result)
    print(line if args.json else table(result), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


def run_suite(args: argparse.Namespace) -> int:
    """Each row of the suite in a process of its own (this one starts no jax backend: it would
    hold the GPU's memory), then its peer; rows print as they finish. Status 1 if a row failed."""
    from jaxtron.bench import benchmark

    suite = benchmark.SUITES[args.suite]
    if args.rows:
        suite = dataclasses.replace(suite, rows=tuple(suite.rows[i - 1] for i in args.rows))
    if args.list:
        for i, row in enumerate(suite.rows, 1):
            print(f"{args.rows[i - 1] if args.rows else i}. {row.name:<32} {row.minutes:4.1f} min"
                  f"  {row.config} {' '.join(row.overrides)}")
        print(f"total {sum(r.minutes for r in suite.rows):4.1f} min on {suite.device} (expected, "
              f"start-up and compiles included; --peer about doubles it)")
        return 0
    if args.out:
        cli.writable_file(args.out, "--out")
    steps = suite.steps if args.steps is None else args.steps
    warmup = suite.warmup if args.warmup is None else args.warmup
    suite = dataclasses.replace(suite, steps=steps, warmup=warmup)
    if suite.one_gpu:  # the rows' processes and their peers: this environment, on one GPU
        os.environ.setdefault("CUDA_VISIBLE_DEVICES", "0")
    if not args.json:
        print("\n".join(benchmark.markdown([], args.peer)), flush=True)
    rows = []
    for i, row in enumerate(suite.rows):
        result = measure_row(row, steps, warmup, checks=i == 0)
        if args.peer and not result.get("error"):
            result.update(peer_row(row, result, steps, warmup))
        rows.append(result)
        line = json.dumps(result)
        print(line if args.json else benchmark.markdown_row(result, args.peer), flush=True)
        if args.out:
            with open(args.out, "a") as f:
                f.write(line + "\n")
    if not args.json:
        command = " ".join(["jaxtron bench --suite", args.suite, *(
            [f"--rows {','.join(map(str, args.rows))}"] if args.rows else []), *(
            ["--peer"] if args.peer else []), *([f"--steps {args.steps}"] if args.steps else []),
            *([f"--warmup {args.warmup}"] if args.warmup is not None else [])])
        print("\n" + "\n".join(benchmark.summary(rows, suite, command)), flush=True)
    return 1 if any(row.get("error") for row in rows) else 0


def row_timeout(row) -> float:
    """Seconds a row's process may take: a hung one does not eat a lent GPU's time."""
    return 180 + 3 * 60 * row.minutes


def measure_row(row, steps: int, warmup: int, checks: bool) -> dict:
    """One row measured by this tool in a fresh process; its JSON, or the row's failure."""
    from jaxtron.bench import benchmark
    from jaxtron.config import presets

    command = [sys.executable, "-m", "jaxtron.commands", "bench", "--json", "--steps", str(steps),
               "--warmup", str(warmup), "--config", str(presets.PRESETS / row.config),
               *row.overrides, *(["--checks"] if checks else [])]
    timeout_s = row_timeout(row)
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        error = benchmark.failure(row, None, "", timeout_s)
    else:
        lines = proc.stdout.strip().splitlines()
        if proc.returncode == 0 and lines:
            return {**json.loads(lines[-1]), "config": row.name,
                    "overrides": list(row.overrides)}
        error = benchmark.failure(row, proc.returncode, proc.stderr)
    return {**dict.fromkeys(benchmark.KEYS), "config": row.name, "error": error,
            "overrides": list(row.overrides)}


def peer_row(row, result: dict, steps: int, warmup: int) -> dict:
    """The peer's measurement of `row` (same model, batch, sequence and devices) and the ratio of
    jaxtron's tokens/s to the peer's; a peer that cannot run says why."""
    from jaxtron.bench import peers
    from jaxtron.config import load, presets

    cfg = load([presets.PRESETS / row.config], list(row.overrides))
    timeout_s = row_timeout(row)
    try:
        found = peers.run_maxtext(cfg, result["devices"], steps, warmup, timeout_s)
    except peers.PeerError as e:
        return {"peer": {"error": str(e)}, "peer_ratio": None}
    if found.get("num_params") not in (None, result["params"]):  # no ratio of unlike models
        return {"peer": {**found, "error": f"its model has {found['num_params']:,} parameters, "
                                          f"jaxtron's {result['params']:,}: not compared"},
                "peer_ratio": None}
    return {"peer": found, "peer_ratio": result["tokens_per_sec"] / found["tokens_per_sec"]}

