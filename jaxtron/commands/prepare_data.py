"""Raw text -> tokenized ArrayRecord shards in the format of docs/data_format.md.

INPUT is a file, a directory (recursed; hidden names and jaxtron's own datasets skipped) or a glob:
`.jsonl`/`.json` hold one JSON document per line (or one JSON array of them), `.parquet` one per
row (--text-field names the key/column), any other file is one plain-text document; text and
JSON may be compressed (.gz, .bz2, .xz) (jaxtron/data/text_inputs.py finds and reads them). The
unit of work is a run of consecutive files worth about --part-tokens tokens (estimated from their
bytes), or one larger file alone; units are tokenized in worker processes, each into its own shards,
a new part every --part-tokens tokens of a split. Safe to interrupt: shards get their names when
complete, a unit's completion record (.parts/NNNNN.json) is written atomically after all its shards,
and a rerun redoes only units without one, then rewrites manifest.json from the records. Ctrl-C or
SIGTERM ends with one line saying what --out keeps, exit status 130. A rerun must name the same
INPUTs and settings (checked before any work). Bad input is reported by file and line (0-based row
for Parquet and JSON arrays; the first 10 lines, then a count by reason), skipped and counted;
--strict exits 2 on it. A --text-field that none of the first records has is one error line naming
the fields they have.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import multiprocessing as mp
import os
import queue
import shutil
import signal
import sys
import time
from collections import Counter
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from tqdm import tqdm

from jaxtron import cli, lifecycle
from jaxtron.config import ConfigError
from jaxtron.data.dataset_dir import (
    PARTS,
    check_ours,
    check_run,
    load_records,
    read_json,
    record_run,
    remove_unlisted,
    uses_text_field,
    writable_dir,
    write_if_changed,
)
from jaxtron.data.prepared import (
    MANIFEST_FORMAT,
    VAL_RULE,
    build_manifest,
)
from jaxtron.data.text_inputs import (
    Source,
    absolute,
    describe,
    file_size,
    find_sources,
    missing_field,
    sample_lines,
)
from jaxtron.data.tokenizer import FILE_NAMES, SP_FILE, Tokenizer, from_path, train_tokenizer
from jaxtron.data.units import (
    MAX_REPORTED,
    Settings,
    StrictStop,
    Unit,
    divide_units,
    init_worker,
    process_unit,
)
from jaxtron.lifecycle import EXIT_STOPPED, one_line_errors

# SIGINT/SIGTERM are recorded, and raise one KeyboardInterrupt only while the work runs
# (`_working`): not once manifest.json is written, nor during the interpreter's exit, where a raise
# is a traceback from a destructor or no line at all. One that came while this module imported was
# recorded by the command's start (jaxtron.commands.run) and stops it before any work.
_signalled: list[int] = []
_working: list[bool] = []


def _on_signal(signum: int, frame: Any) -> None:
    if _working and lifecycle.deferred(signum, frame):
        return
    _signalled.append(signum)
    if _working:
        _working.clear()  # one KeyboardInterrupt: a second Ctrl-C cannot cut the clean-up short
        raise KeyboardInterrupt


MAX_PRINTED = 10  # bad-input lines printed, in all; the closing line counts the rest by reason


class Stopped(Exception):
    """SIGINT or SIGTERM stopped the run; the message says what --out keeps."""


class WorkerLost(Exception):
    """A worker process died; the message says which unit, and what --out keeps (exit 1)."""


WATCH_S = 1.0  # with no message for this long, look whether a worker died


def obtain_tokenizer(args: argparse.Namespace, sources: list[Source], out: Path) -> Tokenizer:
    """The --tokenizer (either kind), or a SentencePiece model trained on a sample (reused from an
    earlier run)."""
    if args.tokenizer:
        try:
            return from_path(args.tokenizer)
        except ConfigError as e:  # its line starts with the path
            raise ConfigError(f"--tokenizer {e}") from None
    previous, cached = read_json(out / PARTS / "run.json") or {}, out / SP_FILE
    if (previous.get("trained_with") == args.trained_with and cached.is_file()
            and hashlib.sha256(cached.read_bytes()).hexdigest() == previous["tokenizer_sha256"]):
        return from_path(cached)
    lines = sample_lines(sources, args.text_field, args.sample_bytes)
    if not lines:
        raise ConfigError("--train-tokenizer: the inputs hold no text to train on")
    print(f"training a {args.train_tokenizer}-piece tokenizer on {counted(len(lines), 'line')}",
          file=sys.stderr)
    try:
        model = train_tokenizer(lines, args.train_tokenizer, "--train-tokenizer {}",
                                "more text (the inputs, --sample-bytes)")
    except ConfigError as e:  # its line starts "cannot train a tokenizer with --train-tokenizer"
        raise ConfigError(str(e).split(" with ", 1)[-1]) from None
    return Tokenizer({SP_FILE: model}, "--train-tokenizer")


def write_tokenizer(out: Path, tok: Tokenizer) -> None:
    """Copy the tokenizer's files into `out`, removing another kind's left there by an earlier run
    (a directory given as data.tokenizer would pick tokenizer.json over the manifest's file)."""
    for name in FILE_NAMES:
        if name in tok.files:
            write_if_changed(out / name, tok.files[name])
        else:
            (out / name).unlink(missing_ok=True)


def run_units(todo: list[Unit], settings: Settings, workers: int, bar: tqdm) -> dict[int, dict]:
    """Tokenize units in a process pool, streaming progress and bad-input lines to stderr. A
    worker that dies (the out-of-memory killer, kill -9) is an error, not a wait for its unit."""
    if not todo:
        return {}
    context = mp.get_context("spawn")  # never fork a parent that may hold threads
    messages, stop, strict_stop = context.Queue(), context.Event(), None
    threads = max(1, workers // len(todo))  # fewer units than workers: encode with more threads
    started, documents, tokens, done, printed = time.monotonic(), 0, 0, 0, 0
    # Ctrl-C is the parent's: the workers start with SIGINT blocked (the mask survives their
    # exec), so one while a worker imports (jax: a second) is no traceback there. Here a stop
    # while the workers start is only recorded (raised inside a worker's launch, it left that
    # worker reading nothing: an EOFError traceback), and raised once the pool's end is in place.
    # The pool ends by `stop`, which every unit reads at its next document, and a wait: killing
    # workers mid-task (multiprocessing.Pool.terminate) could hang the parent.
    with contextlib.ExitStack() as stack:
        pool = ProcessPoolExecutor(min(workers, len(todo)), context, init_worker,
                                   (settings, messages, stop, threads))
        stack.callback(end_pool, pool, stop)
        working = _working.copy()
        _working.clear()
        try:
            with lifecycle.signals_held(signal.SIGINT):  # the workers start at submit
                results = {unit.index: pool.submit(process_unit, unit)
                           for unit in sorted(todo, key=lambda unit: -unit.size)}  # biggest first
        finally:
            _working.extend(working)
        if _signalled and _working:
            _working.clear()
            raise KeyboardInterrupt
        while done < len(results):
            try:
                kind, *payload = messages.get(timeout=WATCH_S)
            except queue.Empty:
                check_workers(results, todo)
                continue
            if _signalled and not strict_stop:  # its KeyboardInterrupt was lost in a destructor
                raise KeyboardInterrupt
            done += kind == "done"
            if kind == "bad" and settings.strict:  # every unit stops at its next document
                strict_stop = strict_stop or StrictStop(payload[0])
                stop.set()
            elif kind == "bad" and printed <= MAX_PRINTED:  # a wrong --text-field is one line
                printed += 1
                bar.write(f"bad input: {payload[0]}" if printed <= MAX_PRINTED else
                          "bad input: more is not shown; the closing line counts it by reason, "
                          f"manifest.json lists up to {MAX_REPORTED} per file", file=sys.stderr)
            if kind == "progress":
                documents, tokens = documents + payload[0], tokens + payload[1]
                rate = tokens / max(time.monotonic() - started, 1e-9)
                bar.set_postfix_str(f"{documents:,} docs, {tokens:,} tokens, {rate:,.0f} tok/s",
                                    refresh=False)
                bar.update(payload[2])
        if strict_stop is not None:
            raise strict_stop
        return {i: result.result() for i, result in results.items()}


def end_pool(pool: ProcessPoolExecutor, stop: Any) -> None:
    """Every unit still running ends at its next document, those not started never start; wait
    for the workers to exit."""
    stop.set()
    pool.shutdown(wait=True, cancel_futures=True)


def check_workers(results: dict[int, Future], todo: list[Unit]) -> None:
    """Raise WorkerLost if a worker process died: its unit's "done" would never come."""
    for index, result in results.items():
        if result.done() and isinstance(result.exception(), BrokenProcessPool):
            unit = next(unit for unit in todo if unit.index == index)
            more = f" and {counted(len(unit.sources) - 1, 'more file')}" if unit.sources[1:] else ""
            raise WorkerLost(f"a worker process died (killed, or out of memory?) with unit {index} "
                             f"({unit.sources[0].path}{more}) not tokenized; fewer --workers use "
                             "less memory")


def summary(manifest: dict, records: list[dict], new_tokens: int, seconds: float) -> str:
    """The closing lines: totals per split, this run's token rate, bad input by reason."""
    splits = "; ".join(f"{name} {counted(s['documents'], 'document')}, "
                       f"{counted(s['tokens'], 'token')}, {counted(len(s['shards']), 'shard')}"
                       for name, s in manifest["splits"].items())
    text = (f"{counted(len(manifest['sources']), 'file')} in {counted(len(records), 'unit')} -> "
            f"{splits}\nthis run tokenized {counted(new_tokens, 'token')} in {seconds:.1f} s "
            f"({new_tokens / max(seconds, 1e-9):,.0f} tokens/s)")
    reasons = sum((Counter(record["bad_reasons"]) for record in records), Counter())
    counts = ", ".join(f"{reason}: {n}" for reason, n in reasons.most_common())
    return text + (f"\nbad input skipped: {reasons.total()} ({counts})" if reasons else "")


def counted(n: int, noun: str) -> str:
    """3 -> '3 files', 1 -> '1 file'."""
    return f"{n:,} {noun}{'' if n == 1 else 's'}"


def prepare(args: argparse.Namespace) -> int:
    """The whole tool; an output directory this run created is removed again when it fails, so a
    failed first run leaves nothing that looks like a dataset (a resumed one keeps its parts).
    Stopped by a signal, it keeps the units it finished, for a rerun to go on from."""
    out = writable_dir(absolute(Path(args.out).expanduser()), "--out")
    fresh = not out.exists() or not any(out.iterdir())
    try:
        return _prepare(args, out)
    except BaseException as e:
        _working.clear()  # a second Ctrl-C: no half-done clean-up
        if isinstance(e, KeyboardInterrupt):
            raise Stopped(left_behind(out, fresh)) from None
        if isinstance(e, WorkerLost):
            raise WorkerLost(f"{e}; {left_behind(out, fresh)}") from None
        if fresh and out.is_dir():
            shutil.rmtree(out, ignore_errors=True)
        raise


def left_behind(out: Path, fresh: bool) -> str:
    """What a stopped run leaves in `out`: nothing before its first finished unit (a directory it
    made is removed), else the finished units, which a rerun goes on from."""
    finished = len(list((out / PARTS).glob("[0-9]*.json"))) if out.is_dir() else 0
    if fresh and not finished:
        shutil.rmtree(out, ignore_errors=True)
        return "nothing was written"
    if fresh and (out / "manifest.json").is_file():
        return f"the dataset in --out {out} was complete (manifest.json written)"
    return (f"--out {out} keeps {counted(finished, 'finished unit')} but no new manifest.json; "
            "rerun the same command to finish")


def _prepare(args: argparse.Namespace, out: Path) -> int:
    """Inputs -> checks of --out -> tokenizer -> units -> shards per unit -> manifest."""
    check_ours(out)
    sources = find_sources(args.inputs, out)
    sizes = [file_size(s.path) for s in sources]
    inputs = [[str(s.path), s.rel, n] for s, n in zip(sources, sizes)]
    run = {"format": MANIFEST_FORMAT, "val_rule": VAL_RULE, "val_fraction": args.val_fraction,
           "text_field": args.text_field if uses_text_field(inputs) else None,
           "part_tokens": args.part_tokens, "trained_with": args.trained_with, "inputs": inputs}
    check_run(out, run)  # before a tokenizer is trained (minutes): all but its own settings
    if wrong_field := missing_field(sources, args.text_field):
        raise ConfigError(wrong_field)
    units = divide_units(sources, sizes, args.part_tokens)
    records = load_records(out, units)
    tok = obtain_tokenizer(args, sources, out)
    run |= {"tokenizer_sha256": tok.sha256,
            "dtype": "uint16" if tok.get_piece_size() <= 1 << 16 else "int32"}
    check_run(out, run)
    record_run(out, run)
    write_tokenizer(out, tok)
    bad = [entry for record in records.values() for entry in record["bad_examples"]]
    if args.strict and bad:  # from an earlier run without --strict
        raise StrictStop(describe(bad[0]))
    remove_unlisted(out, records)
    todo = [unit for unit in units if unit.index not in records]
    settings = Settings(out, args.text_field, args.val_fraction, run["dtype"], args.part_tokens,
                        args.strict, tok.file)
    total, started = sum(unit.size for unit in units), time.monotonic()
    with tqdm(total=total, initial=total - sum(unit.size for unit in todo), unit="B",
              unit_scale=True, unit_divisor=1024, desc="tokenizing", file=sys.stderr,
              mininterval=0.5, dynamic_ncols=True, disable=None) as bar:  # no bar in logs
        records.update(run_units(todo, settings, args.workers, bar))
    seconds, ordered = time.monotonic() - started, [records[unit.index] for unit in units]
    manifest = build_manifest(ordered, tok, run)
    if not manifest["splits"]["train"]["documents"]:
        raise ConfigError(f"no documents to train on: {summary(manifest, ordered, 0, 0)}"
                          .replace("\n", "; ") + "; fix the inputs (or --text-field) and rerun")
    write_if_changed(out / "manifest.json", (json.dumps(manifest, indent=2) + "\n").encode())
    _working.clear()  # the dataset is complete: a signal from here on is recorded, not raised
    new_tokens = sum(f["tokens"] for unit in todo for f in records[unit.index]["files"])
    print(summary(manifest, ordered, new_tokens, seconds), file=sys.stderr)
    if not manifest["splits"]["val"]["documents"]:
        print(f"{lifecycle.script_name()}: warning: {empty_val(manifest, args.val_fraction)}",
              file=sys.stderr)
    return 0


def empty_val(manifest: dict, val_fraction: float) -> str:
    """Why an empty val split matters (data.py refuses it for eval) and what to change."""
    documents = manifest["splits"]["train"]["documents"]
    # Each document is val by its hash, with chance --val-fraction: 3/N holds out about 3 of N
    # and leaves val empty about 1 time in 20.
    fraction = min(0.5, max(float(f"{3 / documents:.1g}"), 2 * val_fraction))
    fix = ("add documents" if documents < 2 else  # a larger fraction than given, else only more
           "prepare again into a new --out with more documents" if fraction <= val_fraction else
           f"prepare again into a new --out with --val-fraction {fraction:g} (about "
           f"{max(1, round(fraction * documents))} held out), or with more documents")
    return (f"the val split is empty ({counted(documents, 'document')}, --val-fraction "
            f"{val_fraction:g}), so jaxtron train refuses this dataset while train.eval_every > 0; "
            f"{fix}; or train with train.eval_every=0")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The command line (see the module docstring)."""
    p = cli.Parser(command="tools/prepare_data.py", description=__doc__,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("inputs", nargs="+", metavar="INPUT", help="files, directories or globs")
    p.add_argument("--out", required=True, help="dataset directory to write (or resume)")
    tok = p.add_mutually_exclusive_group(required=True)
    tok.add_argument("--tokenizer", help="SentencePiece .model, Hugging Face tokenizer.json, or a "
                     "directory holding one, to tokenize with")
    tok.add_argument("--train-tokenizer", type=int, metavar="VOCAB",
                     help="train a SentencePiece model of VOCAB pieces on a sample of the inputs")
    p.add_argument("--sample-bytes", type=int, default=50_000_000,
                   help="bytes of text to train on, an equal share per file (%(default)s)")
    p.add_argument("--text-field", default="text", help="JSON key / Parquet column (%(default)s)")
    p.add_argument("--val-fraction", type=float, default=0.01,
                   help="share of documents in val (%(default)s)")
    p.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                   help="worker processes (%(default)s: the CPU count)")
    p.add_argument("--part-tokens", type=int, default=50_000_000,
                   help="tokens per shard; files are grouped into units of about this many "
                   "(%(default)s)")
    p.add_argument("--strict", action="store_true", help="exit 2 on the first bad input")
    args = p.parse_args(argv)
    for name in ("workers", "part_tokens", "sample_bytes", "train_tokenizer"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if not 0.0 <= args.val_fraction <= 1.0:
        p.error("--val-fraction must be between 0 and 1")
    args.trained_with = None if args.tokenizer else {"vocab_size": args.train_tokenizer,
                                                     "sample_bytes": args.sample_bytes}
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the tool; exit status 0, 1 (a worker process died), 2 (bad input: usage, or a bad
    document under --strict) or 130 (stopped by SIGINT or SIGTERM before the dataset was
    complete; the line says what --out keeps)."""
    args = parse_args(argv)
    stopped_early = lifecycle.take_over_signals()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    for sig, handler in handlers.items():  # a batch system's SIGTERM: as Ctrl-C
        if handler is not signal.SIG_IGN:
            signal.signal(sig, _on_signal)
    try:
        _working.append(True)
        if stopped_early or _signalled:  # one came while the modules imported
            _working.clear()
            raise KeyboardInterrupt
        return one_line_errors(lambda: prepare(args), {WorkerLost: 1})
    except (Stopped, KeyboardInterrupt) as e:
        print(f"{lifecycle.script_name()}: stopped by a signal; {str(e) or 'nothing was written'}",
              file=sys.stderr)
        return EXIT_STOPPED
    finally:
        _working.clear()
        for sig, handler in handlers.items():
            # Run as a command, signals are ignored from here on: the interpreter's exit sets a
            # Python handler back to the default, so one landing there would kill it, no line.
            signal.signal(sig, signal.SIG_IGN if lifecycle.as_command() else handler)
