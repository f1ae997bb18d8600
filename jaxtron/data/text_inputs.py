"""The inputs of jaxtron prepare-data: which files INPUTs name, and the documents in each.

A `.jsonl`/`.json` file holds one JSON document per line, or is one JSON array of them; a
`.parquet` file holds one per row (the text under a key/column); any other file is one plain-text
document. Any of them but Parquet may be compressed (`.gz`, `.bz2`, `.xz`: x.jsonl.gz is JSON
Lines); `.zst` and archives are named as unread, to decompress first. jaxtron's own datasets
(a directory with its manifest.json, `.arrayrecord` shards) met in
a walk are skipped with a note. Readers never raise on bad input:
they yield it as an item with a reason, located by line (1-based) or Parquet row (0-based).
Imports `jaxtron.config` from the installed package (`pip install -e .`).
"""

from __future__ import annotations

import bz2
import functools
import glob
import gzip
import json
import lzma
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from jaxtron.config import ConfigError
from jaxtron.data.prepared import MANIFEST_FORMAT
from jaxtron.lifecycle import script_name

# (index of the document in its file, where to report it, text, why it is bad, bytes read)
Item = tuple[int, dict, str | None, str | None, int]
JSON_ARRAY_MAX_BYTES = 512 << 20  # a JSON array is parsed whole: ~3x its size in memory
SHARD_SUFFIX = ".arrayrecord"  # tokenized data (a prepared dataset's shards), never text
FIELD_CHECK_RECORDS = 100  # records of the first JSON/Parquet input that --text-field is checked on
OPENERS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}  # compressed inputs
UNSUPPORTED = (".zst", ".zstd", ".lz4", ".zip", ".7z")  # named as such, not read as text


@dataclass(frozen=True)
class Source:
    """One input file."""

    path: Path  # absolute
    rel: str  # relative to the directory or glob it was found under: the val split's hash key


def find_sources(patterns: list[str], out: Path) -> list[Source]:
    """Files named by INPUTs in argument order (directories and globs sorted), deduplicated."""
    sources, seen = [], set()
    for pattern in patterns:
        found = [s for s in _expand(pattern, out) if not (s.path in seen or seen.add(s.path))]
        if not found:
            raise ConfigError(f"INPUT {pattern}: {_why_none(Path(pattern).expanduser(), out)}")
        sources += found
    return sources


def _why_none(path: Path, out: Path) -> str:
    """Why an INPUT names no file."""
    if absolute(path) == out:
        return "this is the --out directory; name the raw text to tokenize"
    if _is_dataset(path):
        return "a dataset prepared by jaxtron (its manifest.json), not text; name the raw text"
    if path.is_dir():
        return "the directory holds no files (names starting with '.' are skipped)"
    return "no such file or directory, or no file matches"


def _expand(pattern: str, out: Path) -> list[Source]:
    """The files one INPUT names, each with its path relative to the root it was given as."""
    parts = Path(pattern).expanduser().parts
    magic = [i for i, part in enumerate(parts) if glob.has_magic(part)]
    matches = sorted(glob.glob(str(Path(*parts)), recursive=True)) if magic else [str(Path(*parts))]
    found, ours = [], 0
    for match in map(Path, matches):
        if not (match.exists() or match.is_symlink()) or absolute(match) == out:
            continue
        if magic and match.is_file() and (match.name.endswith(SHARD_SUFFIX)
                                          or _is_dataset(match.parent)):
            ours += 1
            continue
        root = Path(*parts[: magic[0]]) if magic else match if match.is_dir() else match.parent
        found += [Source(absolute(f), Path(os.path.relpath(f, root)).as_posix())
                  for f in (_walk(match, out) if match.is_dir() else [match])]
    if ours:
        _note(f"skipped {ours} file{'s' * (ours > 1)} of {pattern} that jaxtron prepared "
              "(datasets and their shards, not text)")
    return found


def absolute(path: Path) -> Path:
    """An absolute, normalized path (symlinks kept)."""
    return Path(os.path.abspath(path))


def _walk(folder: Path, out: Path) -> list[Path]:
    """Every file under `folder`, sorted, skipping hidden names, the output directory and
    jaxtron's own datasets and shards (each skipped directory, and the shards, in a note)."""
    files, shards = [], 0
    for parent, dirs, names in os.walk(folder):
        if _is_dataset(Path(parent)):
            dirs[:] = []
            if parent != str(folder):  # one named itself has no files: _why_none says why
                _note(f"skipped {parent}: a dataset prepared by jaxtron (its manifest.json)")
            continue
        dirs[:] = sorted(d for d in dirs if d[0] != "." and absolute(Path(parent, d)) != out)
        shards += sum(name.endswith(SHARD_SUFFIX) for name in names)
        files += [Path(parent, name) for name in sorted(names)
                  if name[0] != "." and not name.endswith(SHARD_SUFFIX)]
    if shards:
        _note(f"skipped {shards} {SHARD_SUFFIX} file{'s' * (shards > 1)} under {folder} "
              "(tokenized data, not text)")
    return files


@functools.cache
def _is_dataset(folder: Path) -> bool:
    """Whether `folder` holds a dataset jaxtron prepare-data wrote (its manifest names it)."""
    try:
        manifest = json.loads((folder / "manifest.json").read_bytes())
        return isinstance(manifest, dict) and manifest.get("format") == MANIFEST_FORMAT
    except (OSError, ValueError):
        return False


def _note(text: str) -> None:
    """One line on stderr about input left out."""
    print(f"{script_name()}: note: {text}", file=sys.stderr)


def file_size(path: Path) -> int:
    """A file's size in bytes; 0 for what is not a readable regular file (a broken link)."""
    try:
        return path.stat().st_size if path.is_file() else 0
    except OSError:
        return 0


def kind(path: Path) -> str:
    """The format a file's name gives, under a compression suffix: '.jsonl' for x.jsonl.gz."""
    suffixes = [s.lower() for s in path.suffixes[-2:]]
    if suffixes and suffixes[-1] in OPENERS:
        suffixes.pop()
    return suffixes[-1] if suffixes else ""


def _open(path: Path):
    """A binary file object of `path`'s contents, decompressed as its suffix says."""
    opener = OPENERS.get(path.suffix.lower())
    if opener is None and path.suffix.lower() in UNSUPPORTED:
        raise OSError(f"{path.suffix} files are not read here; decompress or unpack it first")
    return opener(path, "rb") if opener else open(path, "rb")


def read_documents(path: Path, text_field: str) -> Iterator[Item]:
    """The documents of one file, bad ones with a reason; an unreadable file is one bad item."""
    if path.exists() and not path.is_file():  # reading a named pipe would wait for a writer
        yield -1, {}, None, "not a regular file (a pipe or a device)", 0
        return
    suffix = kind(path)
    reader = (_parquet_docs if suffix == ".parquet"
              else _jsonl_docs if suffix in (".jsonl", ".json") else _text_docs)
    try:
        yield from (reader(path, text_field) if path.suffix.lower() not in OPENERS
                    else _counted_whole(reader(path, text_field), file_size(path)))
    except (OSError, EOFError, lzma.LZMAError) as e:  # EOFError: a truncated .gz/.bz2
        reason = getattr(e, "strerror", None) or str(e).splitlines()[0]
        yield -1, {}, None, f"unreadable file ({reason})", 0


def _counted_whole(items: Iterator[Item], size: int) -> Iterator[Item]:
    """A compressed file's items, its bytes (what progress is counted in: the file's size)
    counted at its last item, not the decompressed bytes of each."""
    last = None
    for item in items:
        if last is not None:
            yield *last[:4], 0
        last = item
    if last is not None:
        yield *last[:4], size


def _text_docs(path: Path, text_field: str) -> Iterator[Item]:
    """A plain-text file as one document; invalid UTF-8 is reported at its first bad line."""
    with _open(path) as f:
        data = f.read()
    try:
        yield 0, {}, data.decode("utf-8"), None, len(data)
    except UnicodeDecodeError as e:
        yield 0, {"line": data.count(b"\n", 0, e.start) + 1}, None, "invalid UTF-8", len(data)


def _jsonl_docs(path: Path, text_field: str) -> Iterator[Item]:
    """One document per line of a JSON Lines file (the string under `text_field`), or per
    element of a file holding one JSON array."""
    with _open(path) as f:
        start = f.read(1 << 16).lstrip(b"\xef\xbb\xbf \t\r\n")  # a UTF-8 BOM too
        f.seek(0)
        if start.startswith(b"["):
            yield from _json_array_docs(f.read, path, text_field)
            return
        if (value := _one_object(f, start, path)) is not None:  # pretty-printed: one document
            yield 0, {"row": 0}, *_as_text(value.get(text_field), text_field), file_size(path)
            return
        for i, raw in enumerate(f):
            yield i, {"line": i + 1}, *_json_text(raw, text_field), len(raw)


def _one_object(f, start: bytes, path: Path) -> dict | None:
    """The JSON object a file holds over several lines (pretty-printed), its first line no JSON
    by itself; None for JSON Lines (then read from the start again)."""
    first = start.split(b"\n", 1)[0]
    if not start.startswith(b"{") or _json_text(first, "")[1] != "not JSON" \
            or path.stat().st_size > JSON_ARRAY_MAX_BYTES:
        return None
    try:
        value = json.loads(f.read().decode("utf-8-sig"))
    except ValueError:  # JSON Lines with a bad first line: reported line by line
        value = None
    f.seek(0)
    return value if isinstance(value, dict) else None


def _json_array_docs(read, path: Path, text_field: str) -> Iterator[Item]:
    """The elements of a file holding one JSON array, each a document ({"row": 0-based})."""
    size = path.stat().st_size
    if size > JSON_ARRAY_MAX_BYTES:
        yield -1, {}, None, (f"one JSON array of {size >> 20} MiB, more than the "
                             f"{JSON_ARRAY_MAX_BYTES >> 20} MiB read whole; convert it to JSON "
                             f"Lines: jq -c '.[]' {path.name} > {path.stem}.jsonl"), size
        return
    try:
        values = json.loads(read().decode("utf-8-sig"))
    except UnicodeDecodeError:  # a ValueError too: catch it first
        yield -1, {}, None, "invalid UTF-8", size
        return
    except json.JSONDecodeError as e:
        yield -1, {"line": e.lineno}, None, f"not JSON ({e.msg}; a JSON array is read whole)", size
        return
    for i, value in enumerate(values):
        nbytes = size * (i + 1) // len(values) - size * i // len(values)
        field = value.get(text_field) if isinstance(value, dict) else None
        yield i, {"row": i}, *_as_text(field, text_field), nbytes


def _json_text(raw: bytes, text_field: str) -> tuple[str | None, str | None]:
    """The text of one JSON line, or None and the reason there is none."""
    if not raw.strip():
        return None, "blank line"
    try:
        value = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError:  # a ValueError too: catch it first
        return None, "invalid UTF-8"
    except ValueError:
        return None, "not JSON"
    return _as_text(value.get(text_field) if isinstance(value, dict) else None, text_field)


def _parquet_docs(path: Path, text_field: str) -> Iterator[Item]:
    """One document per row of a Parquet file's `text_field` column (string or UTF-8 binary)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table, size = pq.ParquetFile(path), path.stat().st_size
        if table.schema_arrow.get_field_index(text_field) < 0:
            yield -1, {}, None, f"no column '{text_field}'", size
            return
        rows, row = max(table.metadata.num_rows, 1), 0
        for batch in table.iter_batches(batch_size=1024, columns=[text_field]):
            for value in batch.column(0).to_pylist():
                nbytes = size * (row + 1) // rows - size * row // rows
                yield row, {"row": row}, *_as_text(value, text_field), nbytes
                row += 1
    except pa.ArrowException as e:
        raise OSError(str(e).splitlines()[0]) from None


def _as_text(value: object, text_field: str) -> tuple[str | None, str | None]:
    """A field's value as text, or None and the reason it is not."""
    if value is None:
        return None, f"no field '{text_field}'"
    if not isinstance(value, (str, bytes)):
        return None, f"'{text_field}' not text"
    try:
        if isinstance(value, bytes):
            return value.decode("utf-8"), None
        value.encode("utf-8")  # JSON escapes can spell lone surrogates, which UTF-8 cannot hold
        return value, None
    except UnicodeError:
        return None, "invalid UTF-8"


def missing_field(sources: list[Source], text_field: str) -> str | None:
    """Why --text-field looks wrong before any work: the first JSON or Parquet input's first
    records (FIELD_CHECK_RECORDS) are objects none of which has it. The reason names the fields
    they do have; None where some has it, or the first such file holds no object."""
    for source in sources:
        suffix = kind(source.path)
        if suffix not in (".jsonl", ".json", ".parquet") or not source.path.is_file():
            continue
        try:
            fields = (_parquet_columns(source.path) if suffix == ".parquet"
                      else _first_objects(source.path))
        except (OSError, ValueError, EOFError, lzma.LZMAError):
            continue  # unreadable: reported as bad input of that file
        if not fields:
            continue
        having = [f[text_field] for f in fields if text_field in f]
        if having and not any(map(_is_text, having)):  # a column of numbers, say
            shown = having[0] if suffix == ".parquet" else type(having[0]).__name__
            return (f"--text-field {text_field}: '{text_field}' holds {shown}, not text, in the "
                    f"first records of {source.path}; name the field that holds the documents")
        if having:
            return None
        first = ", ".join(list(fields[0])[:12]) or "none"
        if suffix == ".parquet":
            return (f"--text-field {text_field}: {source.path} has no column '{text_field}'; "
                    f"its columns: {first}")
        return (f"--text-field {text_field}: no record has field '{text_field}' (the first "
                f"{len(fields)} of {source.path}); the first record's fields: {first}")
    return None


def _parquet_columns(path: Path) -> list[dict]:
    """A Parquet file's columns and their types, as the fields of one record."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        schema = pq.ParquetFile(path).schema_arrow
    except pa.ArrowException as e:
        raise ValueError(str(e)) from None
    return [{name: schema.field(name).type for name in schema.names}]


def _is_text(value: object) -> bool:
    """A JSON value, or a Parquet column's type, that holds text (or, null, may)."""
    import pyarrow as pa

    if isinstance(value, pa.DataType):
        return (pa.types.is_string(value) or pa.types.is_large_string(value)
                or pa.types.is_binary(value) or pa.types.is_large_binary(value))
    return value is None or isinstance(value, str)


def _first_objects(path: Path) -> list[dict]:
    """The JSON objects among the first records of a JSON Lines file or a JSON array (read from
    its first MiB: a big array is not parsed whole here)."""
    with _open(path) as f:
        head = f.read(1 << 20).decode("utf-8", errors="replace").lstrip("\ufeff \t\r\n")
    values, decoder = [], json.JSONDecoder()
    if head.startswith("["):
        at = 1
        while len(values) < FIELD_CHECK_RECORDS:
            while at < len(head) and head[at] in " \t\r\n,":
                at += 1
            try:
                value, at = decoder.raw_decode(head, at)
            except ValueError:  # the end of the array, or of what was read
                break
            values.append(value)
    else:
        for line in head.splitlines()[:FIELD_CHECK_RECORDS]:
            try:
                values.append(json.loads(line))
            except ValueError:  # a bad line (reported later), or the last, cut short
                continue
    return [v for v in values if isinstance(v, dict)]


def bad_entry(source: Source, where: dict, reason: str) -> dict:
    """A bad-input record: {"file", then "line" or "row" when known, "reason"}."""
    return {"file": str(source.path), **where, "reason": reason}


def describe(entry: dict) -> str:
    """`file:line: reason`, `file: row N: reason` or `file: reason`."""
    line, row = entry.get("line"), entry.get("row")
    where = f":{line}" if line else f": row {row}" if row is not None else ""
    return f"{entry['file']}{where}: {entry['reason']}"


def sample_lines(sources: list[Source], text_field: str, sample_bytes: int) -> list[str]:
    """Non-empty lines of the files' first documents: an equal share of sample_bytes per file."""
    lines, left = [], sample_bytes
    for i, source in enumerate(sources):
        share = remaining = left // (len(sources) - i)
        for _, _, text, reason, _ in read_documents(source.path, text_field):
            if remaining <= 0:
                break
            if reason is None and text:
                text = text[:remaining]
                remaining -= len(text.encode("utf-8"))
                lines += [line for line in text.split("\n") if line]
        left -= share - max(remaining, 0)
    return lines
