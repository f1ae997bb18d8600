"""Input-pipeline throughput: the tokens/s that `make_batches` delivers to one host, after warm-up.

    jaxtron bench-data                                  # the tiny preset, workers 0 and 2
    jaxtron bench-data --config llama3_1b data.source=arrayrecord \\
        'data.mixture=[{path: data/web, weight: 0.7}, {path: data/code, weight: 0.3}]' \\
        --batches 300 --workers 0,2,4

Config files and `section.key=value` overrides work as in jaxtron train; `--workers` replaces
`data.workers`. `--shares 1,2,4,8` also times a host of 2, 4, 8 processes: one that builds 1/2,
1/4, 1/8 of the rows (its own; every host still plans the whole batch), simulated here by choosing
its rows. Setup (tokenizer, corpus cache, starting workers) and the first `--warmup` batches
are not timed. "tokens" counts every position delivered (batch x seq_len), "real" the non-padding
ones. This measures the loader alone: compare it with the tokens/s the train step consumes.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import platform
import sys
import time

import numpy as np

from jaxtron import cli, lifecycle
from jaxtron import config as config_lib
from jaxtron import data as data_lib
from jaxtron.config import ConfigError
from jaxtron.config.presets import PRESETS
from jaxtron.data.rows import Rows
from jaxtron.lifecycle import one_line_errors

# Fewer timed batches give a rate that is mostly noise and, with workers, mostly the batches
# already waiting in their buffers (4 per worker, data.py): warned about, still measured.
MIN_BATCHES = 50


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = cli.Parser(command="tools/bench_data.py", description=__doc__.split("\n")[0])
    parser.add_argument("--config", action="append", default=[], help="YAML preset (repeatable)")
    parser.add_argument("--batches", type=int, default=200, help="timed batches per setting")
    parser.add_argument("--warmup", type=int, default=20, help="untimed batches first")
    parser.add_argument("--workers", default=[0, 2], type=worker_counts,
                        help="comma-separated data.workers values (default 0,2)")
    parser.add_argument("--shares", default=[1], type=share_counts,
                        help="comma-separated N: time a process that builds 1/N of the rows "
                             "(default 1)")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    args = parser.parse_intermixed_args(argv)
    try:
        cli.check_counts(args, batches=1, warmup=0)
    except ConfigError as e:
        parser.error(str(e))
    return args


def worker_counts(text: str) -> list[int]:
    """'0,2,4' -> [0, 2, 4]; anything else is a usage error naming the form."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = [-1]
    if min(counts) < 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of counts of 0 or more, such "
                                         "as 0,2,4")
    return counts


def share_counts(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; anything else is a usage error naming the form."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        counts = [0]
    if min(counts) < 1:
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of counts of 1 or more, such "
                                         "as 1,2,4,8")
    return counts


def bench(cfg: config_lib.Config, workers: int, batches: int, warmup: int,
          share: int = 1) -> dict:
    """Pull warmup + batches from make_batches for a process building the first 1/share of the
    rows; time the last `batches`. Tokens count the global batch that each step trains on."""
    data = dataclasses.replace(cfg.data, workers=workers)
    size = cfg.train.batch_size
    rows = None if share == 1 else Rows(np.arange(size // share), size)
    start = time.perf_counter()
    it = data_lib.make_batches(data, cfg.train, cfg.model.vocab_size, rows)
    for _ in range(warmup):
        next(it)
    ready = time.perf_counter()
    real = 0
    for _ in range(batches):
        real += int((next(it)["segment_ids"] != 0).sum())
    elapsed = time.perf_counter() - ready
    it.close()
    built = batches * (size // share) * cfg.train.seq_len
    return {"workers": workers, "setup_s": ready - start, "elapsed_s": elapsed,
            "tokens_per_s": built * share / elapsed, "real_per_s": real * share / elapsed,
            "padding": 1 - real / built, "ms_per_batch": 1e3 * elapsed / batches}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return one_line_errors(lambda: report(args))


def report(args: argparse.Namespace) -> None:
    """Print the machine, the setting and one line per worker count."""
    cfg = config_lib.load(args.config or [PRESETS / "tiny.yaml"], args.overrides)
    data_lib.check_dataset(cfg.data, cfg.model.vocab_size)
    if args.batches < MIN_BATCHES:  # a quick look is allowed, as timeit and hyperfine allow it
        print(f"{lifecycle.script_name()}: warning: --batches {args.batches} is too few timed "
              f"batches for a steady rate; ask for --batches {MIN_BATCHES} or more",
              file=sys.stderr)
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"Python {platform.python_version()}")
    print(f"data.source={cfg.data.source}, global batch {cfg.train.batch_size} x seq_len "
          f"{cfg.train.seq_len}, {args.warmup} warm-up + {args.batches} timed "
          f"batch{'es' if args.batches != 1 else ''}")
    if bad := [n for n in args.shares if cfg.train.batch_size % n]:
        raise ConfigError(f"--shares {bad[0]} does not divide train.batch_size="
                          f"{cfg.train.batch_size}; give divisors of it")
    for workers in args.workers:
        for share in args.shares:
            r = bench(cfg, workers, args.batches, args.warmup, share)
            rows = ("" if args.shares == [1] else
                    f", rows {cfg.train.batch_size // share} of {cfg.train.batch_size}")
            print(f"workers={workers}{rows}: {r['tokens_per_s']:,.0f} tokens/s per host "
                  f"({r['real_per_s']:,.0f} real, padding {r['padding']:.1%}); "
                  f"{r['ms_per_batch']:.2f} ms a batch, {r['elapsed_s']:.2f} s timed, "
                  f"{r['setup_s']:.2f} s setup + warm-up", flush=True)

