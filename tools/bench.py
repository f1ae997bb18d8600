"""Train-step benchmark: step time, tokens/s, TFLOP/s per device, MFU and memory of a config.

    python tools/bench.py --config configs/llama3_1b.yaml train.batch_size=8 train.seq_len=4096
    python tools/bench.py --config configs/gpu_base.yaml --steps 20 model.remat=save_dots

The step is the real one (`train.compile_step`, the config's mesh and flags) on random tokens
(full-length documents), so the data pipeline is out of the measurement. Prints a table (or, with
--json, one JSON line) and appends the JSON line to --out when given. MFU counts model FLOPs only (jaxtron/metrics.py), so it
compares fairly across remat policies; on devices with no known peak it is null.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

if __name__ == "__main__":  # first: a Python without jaxtron gets one line naming the fix
    import _environment  # noqa: F401

from jaxtron import cli


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = cli.Parser(command="tools/bench.py", description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", default=[], help="YAML preset(s)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=2,
                        help="untimed steps after compiling (default 2)")
    parser.add_argument("--out", help="append the JSON result to this file")
    parser.add_argument("--json", action="store_true", help="print one JSON line, not a table")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_intermixed_args(argv)
    if args.steps < 1:
        parser.error(f"--steps {args.steps} must be at least 1")
    if args.warmup < 0:
        parser.error(f"--warmup {args.warmup} must be at least 0")
    return args


def random_batch(cfg, mesh):
    """One global batch of random tokens, one document per row, sharded like real input."""
    import jax
    import numpy as np

    from jaxtron import parallel
    from jaxtron.step import BATCH_KEYS

    b, t = cfg.train.batch_size, cfg.train.seq_len
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (b, t + 1), np.int32)
    local = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
             "segment_ids": np.ones((b, t), np.int32),
             "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))}
    sharding = jax.sharding.NamedSharding(mesh, parallel.batch_spec())
    return {k: jax.device_put(local[k], sharding) for k in BATCH_KEYS}


def bench(cfg, steps: int, warmup: int) -> dict:
    import jax

    from jaxtron import attention, memory, metrics, parallel, xla_flags
    from jaxtron.optim import make_optimizer
    from jaxtron.state import init_state, make_plan
    from jaxtron.step import compile_step

    devices = xla_flags.start_backend()  # one that cannot start here: one line, not a trace
    cfg = attention.configure(cfg, devices[0].platform)  # as train() runs it
    tx = make_optimizer(cfg.optim, cfg.train.steps)
    plan = make_plan(cfg, tx, len(devices))
    memory.check_host(plan, devices, cfg)  # one line, not the out-of-memory killer
    mesh = parallel.make_mesh(cfg.mesh, devices)
    with jax.set_mesh(mesh):
        state = init_state(cfg, plan, tx, mesh)
        batch = random_batch(cfg, mesh)
        start = time.perf_counter()
        step = compile_step(cfg, plan, tx, mesh).lower(state, batch).compile()
        compile_s = time.perf_counter() - start
        memory = step.memory_analysis()
        times = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            state, out = step(state, batch)
            loss = float(out["loss"])  # waits for the step
            if i >= warmup:
                times.append(time.perf_counter() - start)
    step_time = statistics.median(times)
    fetched = {"loss": loss, "lr": 0.0, "grad_norm": 0.0}
    cost = metrics.StepCost.of(cfg, devices)
    row = metrics.make_row(steps, fetched, step_time, cost, (warmup + steps) * cost.tokens)
    stats = devices[0].memory_stats() or {}
    return {
        "device": devices[0].device_kind, "devices": len(devices), "mesh": plan.mesh_sizes,
        "params": plan.num_params, "batch": cfg.train.batch_size, "seq_len": cfg.train.seq_len,
        "microbatches": cfg.train.microbatches, "remat": cfg.model.remat,
        "bubble": plan.pipe.bubble if plan.pipe else 0.0,
        "step_time_s": step_time, "step_time_min_s": min(times),
        "tokens_per_s": row["tokens_per_sec"], "tflops_per_device": row["tflops_per_device"],
        "mfu": row["mfu"], "compile_s": compile_s, "loss": loss,
        "argument_gib": memory.argument_size_in_bytes / 2**30,
        "temp_gib": memory.temp_size_in_bytes / 2**30,
        "peak_gib": stats.get("peak_bytes_in_use", 0) / 2**30 or None,
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return cli.one_line_errors(lambda: report(args))


ROWS = (  # (label, key, format) of the table
    ("device", "device", "{}"), ("devices", "devices", "{}"), ("mesh", "mesh", "{}"),
    ("parameters", "params", "{:,}"), ("batch x seq_len", None, None),
    ("microbatches", "microbatches", "{}"), ("remat", "remat", "{}"),
    ("pipeline bubble", "bubble", "{:.1%}"), ("step time (median)", "step_time_s", "{:.3f} s"),
    ("step time (fastest)", "step_time_min_s", "{:.3f} s"),
    ("tokens/s", "tokens_per_s", "{:,.0f}"), ("TFLOP/s per device", "tflops_per_device", "{:.1f}"),
    ("MFU", "mfu", "{:.1%}"), ("compile", "compile_s", "{:.1f} s"), ("loss", "loss", "{:.4f}"),
    ("arguments per device", "argument_gib", "{:.2f} GiB"),
    ("temporaries per device", "temp_gib", "{:.2f} GiB"),
    ("peak in use (device)", "peak_gib", "{:.2f} GiB"),
)


def table(result: dict) -> str:
    """The result as aligned `label  value` lines (n/a where a value is unknown)."""
    lines = []
    for label, key, fmt in ROWS:
        if key is None:
            value = f"{result['batch']} x {result['seq_len']}"
        elif key == "mesh":
            value = " ".join(f"{axis}={size}" for axis, size in result["mesh"].items())
        else:
            value = "n/a" if result.get(key) is None else fmt.format(result[key])
        lines.append(f"{label:<24} {value}")
    return "\n".join(lines)


def report(args: argparse.Namespace) -> None:
    """Measure, print the result as a table (or one JSON line), and append it to --out."""
    from jaxtron import presets, xla_flags
    from jaxtron.config import load

    if args.out:
        cli.writable_file(args.out, "--out")  # before the compile, not after the measurement
    cfg = load(args.config or [presets.PRESETS / "tiny.yaml"], args.overrides)  # from any directory
    xla_flags.apply(cfg.xla)  # before anything starts a backend
    result = {**bench(cfg, args.steps, args.warmup), "overrides": args.overrides}
    line = json.dumps(result)
    print(line if args.json else table(result), flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write(line + "\n")


if __name__ == "__main__":
    sys.exit(main())
