"""The output directory of jaxtron prepare-data: checked before any work, the settings it was
made with (.parts/run.json), the completion records of its units (.parts/NNNNN.json) checked
against the units, and leftover shards removed."""

from __future__ import annotations

import itertools
import json
import tempfile
from pathlib import Path
from typing import Any

from jaxtron.config import ConfigError
from jaxtron.data.corpus import write_atomic
from jaxtron.data.prepared import SHARD_NAME
from jaxtron.data.tokenizer import FILE_NAMES

PARTS = ".parts"  # completion records and run.json of an unfinished (or finished) preparation
MANIFEST = "manifest.json"  # written last: a directory with PARTS and without it is unfinished
FIELD_SUFFIXES = (".jsonl", ".json", ".parquet")  # the inputs --text-field applies to
RUN_KEYS = ("format", "val_rule", "tokenizer_sha256", "dtype", "val_fraction", "text_field",
            "part_tokens")


def writable_dir(path: Path, what: str) -> Path:
    """`path` as a directory the tool can make or write into, checked before any work; nothing
    is created (a ConfigError naming `what` otherwise)."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{what} {path} is a file; name a directory")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ConfigError(f"{what} {path}: {existing} is a file, not a directory")
    try:
        tempfile.TemporaryFile(dir=existing).close()
    except OSError as e:
        raise ConfigError(f"cannot write {what} {path}: {existing}: {e.strerror}") from None
    return path


def _ours(name: str) -> bool:
    """A name this tool writes into --out: shards, the manifest, PARTS, tokenizer files, and
    write_atomic's temporary `.<name>.<random>.tmp` of any of them."""
    if SHARD_NAME.match(name):  # its own temporaries included
        return True
    if name.startswith(".") and name.endswith(".tmp"):
        name = name[1:].rsplit(".", 2)[0]
    return name in (MANIFEST, PARTS, *FILE_NAMES)


def check_ours(out: Path) -> None:
    """Refuse an --out holding files this tool did not write (its shards would land among
    them, and its clean-up could remove them); checked before any work."""
    foreign = sorted(p.name for p in out.iterdir() if not _ours(p.name)) if out.is_dir() else []
    if foreign:
        more = f" and {len(foreign) - 1:,} more" if len(foreign) > 1 else ""
        raise ConfigError(f"--out {out} already holds {foreign[0]}{more}, which "
                          "jaxtron prepare-data did not write; name a new or empty directory")


def unfinished(path: Path) -> bool:
    """A prepare_data output that was stopped before its manifest.json (Ctrl-C, SIGTERM, a crash):
    rerunning the same command finishes it."""
    return (path / PARTS).is_dir() and not (path / MANIFEST).is_file()


def read_json(path: Path) -> dict | None:
    """A JSON file's content, or None if it is missing or unreadable."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def write_if_changed(path: Path, payload: bytes) -> None:
    """Write atomically unless the file holds exactly `payload` (so a rerun changes nothing)."""
    if not (path.is_file() and path.read_bytes() == payload):
        write_atomic(path, payload)


def uses_text_field(inputs: list[list]) -> bool:
    """Whether --text-field applies to any of run.json's INPUTs ([path, rel, bytes]): JSON or
    Parquet; run.json records None for it otherwise."""
    return any(Path(f[0]).suffix.lower() in FIELD_SUFFIXES for f in inputs)


def check_run(out: Path, run: dict) -> None:
    """Refuse to mix outputs of other INPUTs, of different settings (those of RUN_KEYS that `run`
    has: all but the tokenizer's before it is loaded or trained; text_field only where an input
    is JSON or Parquet) or of another way to get the tokenizer in one directory. The INPUTs are
    compared first: with other files, a setting that applies to them is no clue. Checked before
    any work; nothing is written."""
    previous = read_json(out / PARTS / "run.json")
    if not (previous and any((out / PARTS).glob("[0-9]*.json"))):
        return
    if "inputs" in previous:
        _check_inputs(out, previous["inputs"], run["inputs"])
    fields = uses_text_field(run["inputs"])
    for key in RUN_KEYS:
        if key in run and previous.get(key) != run[key] and (key != "text_field" or fields):
            raise ConfigError(f"--out {out} holds data made with {key}={previous.get(key)}, "
                              f"not {run[key]}: rerun with the same arguments or a new --out")
    if run["trained_with"] and previous.get("trained_with") != run["trained_with"]:
        then = previous.get("trained_with") or {}
        raise ConfigError(f"--out {out} holds data tokenized with "
                          + (f"--train-tokenizer {then['vocab_size']} --sample-bytes "
                             f"{then['sample_bytes']}" if then else "a --tokenizer") +
                          f", not --train-tokenizer {run['trained_with']['vocab_size']} "
                          f"--sample-bytes {run['trained_with']['sample_bytes']}: rerun with the "
                          "same arguments or a new --out")


def _check_inputs(out: Path, then: list[list], now: list[list]) -> None:
    """Refuse other INPUT files (or sizes) than the earlier run's, naming the first that differs."""
    for k, (old, new) in enumerate(itertools.zip_longest(then, now)):
        if old != new:
            raise ConfigError(f"--out {out} holds {_label(old)} where the INPUTs now give "
                              f"{_label(new)} (file {k + 1}; {len(then):,} file"
                              f"{'s' * (len(then) != 1)} then, {len(now):,} now): rerun with "
                              "the same INPUTs or a new --out")


def record_run(out: Path, run: dict) -> None:
    """Keep the settings and INPUTs a rerun is checked against (.parts/run.json)."""
    write_if_changed(out / PARTS / "run.json", json.dumps(run, indent=1).encode())


def load_records(out: Path, units: list[Any]) -> dict[int, dict]:
    """Earlier runs' completion records whose shards are all present, checked against the units."""
    records = {}
    for path in sorted((out / PARTS).glob("[0-9]*.json")):
        index, record = int(path.stem), read_json(path)
        if record is None or not all((out / name).is_file() for split in record["splits"].values()
                                     for name in split["shards"]):
            path.unlink()  # shards gone: redo the unit
            continue
        check_record(out, record, units[index] if index < len(units) else None)
        records[index] = record
    return records


def check_record(out: Path, record: dict, unit: Any) -> None:
    """Refuse a completion record of other files, or other file sizes, than its unit (a
    prepare_data.Unit, or None past the last unit) has now."""
    then = [(f["path"], f["rel"], f["bytes"]) for f in record["files"]]
    now = [(str(s.path), s.rel, n) for s, n in zip(unit.sources, unit.sizes)] if unit else []
    for old, new in itertools.zip_longest(then, now):
        if old != new:
            raise ConfigError(f"--out {out} holds {_label(old)} where the INPUTs now give "
                              f"{_label(new)}: rerun with the same INPUTs or a new --out")


def _label(file: tuple[str, str, int] | list | None) -> str:
    """An input file as an error message names it."""
    return f"{file[0]} ({file[2]:,} bytes)" if file else "no file"


def remove_unlisted(out: Path, records: dict[int, dict]) -> None:
    """Delete shards of ours, complete or not, that no completion record lists: leftovers."""
    listed = {name for r in records.values() for split in r["splits"].values()
              for name in split["shards"]}
    for path in out.iterdir():
        if SHARD_NAME.match(path.name) and path.name not in listed:
            path.unlink()
