"""Prepared datasets on disk (docs/data_format.md), in both directions: the writer's pieces (the
val rule, a split's shards, the manifest) that jaxtron prepare-data drives, and the reader's
(manifests, the checks made before compiling, a split's documents as a Grain map dataset).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import grain
import numpy as np
from array_record.python.array_record_module import ArrayRecordWriter

from jaxtron.config import SOURCES, ConfigError, DataConfig, DatasetEntry, ModelConfig, TrainConfig
from jaxtron.data.corpus import entropy_of, is_held_out
from jaxtron.data.tokenizer import SP_FILE, Tokenizer, from_path, load_tokenizer

MANIFEST_FORMAT = "jaxtron.tokens.v1"
TOKEN_DTYPES = ("uint16", "int32")
SPLITS = ("train", "val")
SHARD_NAME = re.compile(r"^\.?(train|val)-\d{5,}-\d{5,}\.arrayrecord(\.tmp)?$")  # ours, temps too
VAL_RULE = "sha256"  # is_val's hash, recorded so one output directory never mixes two rules
MAX_EXAMPLES = 100  # bad-input examples in the manifest
# A damaged dataset's fix: jaxtron prepare-data rerun into the same --out goes on from the units
# it recorded as finished, so it would find nothing to do.
AGAIN = "prepare it again into a new --out (a rerun into this one keeps what it finished)"
VOCAB_MULTIPLE = 128  # a vocabulary padded to this keeps the lm_head's matmul tile-aligned


def read_manifest(path: str) -> dict:
    """`<path>/manifest.json`, checked against the format; a one-line ConfigError names the path."""
    file = Path(path).expanduser() / "manifest.json"
    where = f"data.mixture path {path}"
    try:
        manifest = json.loads(file.read_text())
        tok, splits = manifest["tokenizer"], manifest["splits"]
        ok = (manifest["format"] == MANIFEST_FORMAT and manifest["dtype"] in TOKEN_DTYPES
              and {"sha256", "vocab_size", "bos_id", "eos_id"} <= set(tok)
              and all(isinstance(splits[s]["shards"], list) for s in SPLITS))
    except OSError as e:
        if not file.exists() and (file.parent / ".parts").is_dir():  # dataset_dir.PARTS
            raise ConfigError(f"{where} is an unfinished jaxtron prepare-data output (no "
                              "manifest.json yet); rerun the same command to finish it") from None
        shown = file if file.is_absolute() else f"{file} in {Path.cwd()}"  # relative: to here
        raise ConfigError(f"{where}: cannot read {shown} ({e.strerror})") from None
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{where}: {file} is not a {MANIFEST_FORMAT} manifest "
                          f"({type(e).__name__}: {e})") from None
    if not ok:
        raise ConfigError(f"{where}: {file} is not a {MANIFEST_FORMAT} manifest "
                          "(check its format, dtype, tokenizer and splits)")
    missing = [s for split in SPLITS for s in splits[split]["shards"]
               if not (file.parent / s).is_file()]
    if missing:
        raise ConfigError(f"{where}: shard {missing[0]} is missing ({len(missing)} in all)")
    return manifest


def tokenizer_file(path: str, manifest: dict) -> Path:
    """The copy of the tokenizer a dataset was tokenized with: its tokenizer.model or
    tokenizer.json (manifests without a `file` are SentencePiece's)."""
    return Path(path).expanduser() / manifest["tokenizer"].get("file", SP_FILE)


def _identity(tok: dict) -> tuple[str, int, int]:
    """What two datasets' tokenizers must share: the ids (sha256 of the file) and bos and eos."""
    return tok["sha256"], tok["bos_id"], tok["eos_id"]


def _sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_mixture(data: DataConfig, vocab_size: int) -> None:
    """Weights, one shared tokenizer, non-empty train splits, and a vocabulary that fits."""
    for entry in data.mixture:
        if not (entry.weight > 0 and np.isfinite(entry.weight)):
            raise ConfigError(f"data.mixture path {entry.path}: weight={entry.weight} must be a "
                              "finite number above 0")
    seen = {}
    for entry in data.mixture:
        if (where := Path(entry.path).expanduser().resolve()) in seen:
            raise ConfigError(f"data.mixture lists {where} twice ({seen[where]} and {entry.path}); "
                              "give it once, with the two weights added")
        seen[where] = entry.path
    manifests = [read_manifest(entry.path) for entry in data.mixture]
    first, tok = data.mixture[0].path, manifests[0]["tokenizer"]
    for entry, manifest in zip(data.mixture, manifests):
        if _identity(manifest["tokenizer"]) != _identity(tok):
            raise ConfigError(f"data.mixture path {entry.path} was tokenized with another "
                              f"tokenizer than {first} (sha256, bos_id, eos_id); all datasets of "
                              "a mixture must share one")
        if not manifest["splits"]["train"]["shards"]:
            raise ConfigError(f"data.mixture path {entry.path}: the train split has no shards")
        _check_shards(entry.path, manifest)
    model = tokenizer_file(first, manifests[0])
    if not model.is_file() or _sha256(model) != tok["sha256"]:
        raise ConfigError(f"data.mixture path {first}: {model.name} is missing or does not match "
                          f"the manifest's sha256; {AGAIN}")
    if data.tokenizer:
        mine = load_tokenizer(data, vocab_size)
        if (mine.sha256, mine.bos_id(), mine.eos_id()) != _identity(tok):
            raise ConfigError(f"data.tokenizer={data.tokenizer} is not the datasets' tokenizer "
                              f"({model}, with its bos and eos); set data.tokenizer='' or to that "
                              "file")
    if tok["vocab_size"] > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the datasets' "
                          f"tokenizer ({tok['vocab_size']} pieces); raise it")


def _check_shards(path: str, manifest: dict) -> None:
    """Every shard opens and each split holds the documents its manifest counts: a shard emptied
    or cut short (a copy or a disk that failed) is one line here, not a data worker's traceback
    mid-run. Opening reads a shard's footer only, once per process while the file is unchanged
    (a start checks the datasets several times)."""
    root = Path(path).expanduser()
    for split in SPLITS:
        documents = 0
        for shard in manifest["splits"][split]["shards"]:
            try:
                stat = (root / shard).stat()
                documents += _documents_in(str(root / shard), stat.st_size, stat.st_mtime_ns)
            except (RuntimeError, OSError, ValueError) as e:
                why = f" ({str(e).strip().splitlines()[0]})" if str(e).strip() else ""
                raise ConfigError(f"data.mixture path {path}: shard {shard} cannot be read, cut "
                                  f"short or damaged{why}; {AGAIN}") from None
        if documents != manifest["splits"][split]["documents"]:
            listed = manifest["splits"][split]["documents"]
            raise ConfigError(f"data.mixture path {path}: the {split} shards hold {documents:,} "
                              f"documents, its manifest.json {listed:,}"
                              f"; {AGAIN}")


@functools.lru_cache(maxsize=None)
def _documents_in(shard: str, size: int, mtime_ns: int) -> int:
    """The records of one ArrayRecord file of this size and modification time."""
    return len(grain.sources.ArrayRecordDataSource([shard]))


def check_dataset(data: DataConfig, vocab_size: int) -> None:
    """Every check of `data` against the datasets on disk; call before anything compiles."""
    if data.source not in SOURCES:
        raise ConfigError(f"data.source={data.source} is not one of {', '.join(SOURCES)}")
    if data.workers < 0:
        raise ConfigError(f"data.workers={data.workers} must be >= 0")
    if data.source == "stdlib" and data.mixture:
        raise ConfigError("data.mixture is set but data.source=stdlib; "
                          "set data.source=arrayrecord or drop data.mixture")
    if data.source == "arrayrecord":
        if not data.mixture:
            raise ConfigError("data.source=arrayrecord needs data.mixture=[{path: ..., weight: 1}]")
        _check_mixture(data, vocab_size)


def unused_vocab(data: DataConfig, model: ModelConfig) -> str | None:
    """A warning when model.vocab_size is far above the tokenizer's pieces: embedding (and
    output) rows no token id reaches, parameters and lm_head FLOPs spent on nothing."""
    if data.source == "stdlib" and not data.tokenizer:  # CORPUS_PIECES, said in the data line
        return None
    pieces = checked_tokenizer(data, model.vocab_size).get_piece_size()
    padded = -(-pieces // VOCAB_MULTIPLE) * VOCAB_MULTIPLE
    unused = model.vocab_size - pieces
    if model.vocab_size <= padded or unused <= model.vocab_size // 100:
        return None
    params = unused * model.d_model * (1 if model.tie_embeddings else 2)
    return (f"model.vocab_size={model.vocab_size} leaves {unused:,} rows that no token id reaches "
            f"(the tokenizer has {pieces:,} pieces; {params:,} parameters unused): set "
            f"model.vocab_size={padded} (the next multiple of {VOCAB_MULTIPLE})")


def check_eval(data: DataConfig, eval_every: int) -> None:
    """With eval on (train.eval_every > 0), every prepared dataset has val documents."""
    if eval_every > 0 and data.source == "arrayrecord":
        for entry in data.mixture:
            if not read_manifest(entry.path)["splits"]["val"]["documents"]:
                raise ConfigError(empty_val(entry.path))


def empty_val(path: str) -> str:
    return (f"data.mixture path {path}: the val split is empty; set train.eval_every=0, or "
            "prepare the dataset again with a larger --val-fraction (with more documents: a "
            "plain text file is one)")


def tokenizer_check(now: DataConfig,
                    vocab_size: int) -> Callable[[DataConfig, str], str | None]:
    """check_start's `data_change` (jaxtron/train/start.py) for a run on `now`: tokenizer_change
    against the checkpoint's data (and checkpoint.restore's path, or "")."""
    return lambda saved, restore: tokenizer_change(saved, now, vocab_size, restore)


def tokenizer_change(saved: DataConfig, now: DataConfig, vocab_size: int,
                     restore: str = "") -> str | None:
    """A resumed run's data (or, with `restore`, a run's from checkpoint.restore) against the
    checkpoint's: a ConfigError message when they were tokenized by another tokenizer (the ids
    would mean other text), else None. Data of the checkpoint's that is gone cannot be compared."""
    before, after = _tokenized_by(saved, vocab_size), _tokenized_by(now, vocab_size)
    if before is None or after is None or before == after:  # what is missing is named later
        return None
    theirs = _data_name(saved, short=True)
    if restore:
        return (f"{_data_name(now)} was tokenized by another tokenizer than checkpoint.restore="
                f"{restore} was trained on ({theirs}), so its token ids mean other text to that "
                "model; train on data of that tokenizer (jaxtron prepare-data --tokenizer with "
                "its file)")
    return (f"{_data_name(now)} was tokenized by another tokenizer than the checkpoint's data "
            f"({theirs}), so its token ids mean other text; resume with "
            "data of that tokenizer, or start a new run.dir (checkpoint.restore=... with "
            "checkpoint.weights_only=true to fine-tune from it)")


def _tokenized_by(data: DataConfig, vocab_size: int) -> tuple[str, int, int] | None:
    """The identity of `data`'s tokenizer (sha256, bos, eos); None where it is gone or was
    never there."""
    if data.source == "arrayrecord":
        path = Path(data.mixture[0].path).expanduser() if data.mixture else None
        if path is None or not (path / "manifest.json").is_file():
            return None
        return _identity(read_manifest(str(path))["tokenizer"])
    if data.tokenizer and not Path(data.tokenizer).expanduser().exists():
        return None
    tok = load_tokenizer(data, vocab_size)
    return tok.sha256, tok.bos_id(), tok.eos_id()


def _data_name(data: DataConfig, short: bool = False) -> str:
    if data.source == "arrayrecord":
        return data.mixture[0].path if short else f"data.mixture path {data.mixture[0].path}"
    if data.tokenizer:
        return f"data.source={data.source} with data.tokenizer={data.tokenizer}"
    return f"data.source={data.source} (its tokenizer trained at model.vocab_size)"


def dataset_tokenizer(data: DataConfig, vocab_size: int) -> Tokenizer:
    """The tokenizer the batches are made with, `data` checked first (check_dataset): for a
    command that reads a run's data outside its set-up (convert-hf, generate)."""
    check_dataset(data, vocab_size)
    return checked_tokenizer(data, vocab_size)


def checked_tokenizer(data: DataConfig, vocab_size: int) -> Tokenizer:
    """The tokenizer the batches are made with, of `data` already checked (check_dataset, as a
    start's set-up does once): the datasets' own when source=arrayrecord."""
    if data.source != "arrayrecord":
        tok = load_tokenizer(data, vocab_size)
        if tok.get_piece_size() > vocab_size:
            raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the tokenizer's "
                              f"{tok.get_piece_size()} pieces; raise it")
        return tok
    path = data.mixture[0].path
    return from_path(tokenizer_file(path, read_manifest(path)))


def decode_tokens(record: bytes, dtype: str) -> np.ndarray:
    """One record (a document's token ids, little-endian) as int32."""
    return np.frombuffer(record, np.dtype(dtype).newbyteorder("<")).astype(np.int32)


class Shards(grain.sources.RandomAccessDataSource):
    """The records of a split's shards in order, as one source; a record that cannot be read
    mid-run (a shard damaged after the start's checks, or a chunk whose checksum fails) stops
    the run with one line naming the dataset, shard and record instead of a reader's traceback."""

    def __init__(self, path: str, shards: list[str]):
        self.path, self.names = path, shards
        root = Path(path).expanduser()
        self.sources = [grain.sources.ArrayRecordDataSource([str(root / s)]) for s in shards]
        self.ends = np.cumsum([len(source) for source in self.sources])

    def __len__(self) -> int:
        return int(self.ends[-1]) if len(self.ends) else 0

    def __getitem__(self, index: int) -> bytes:
        shard = int(np.searchsorted(self.ends, index, side="right"))
        record = int(index - (self.ends[shard - 1] if shard else 0))
        try:
            return self.sources[shard][record]
        except (RuntimeError, OSError) as e:
            why = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise ConfigError(f"data.mixture path {self.path}: shard {self.names[shard]} record "
                              f"{record} cannot be read ({why}); {AGAIN}, or drop the dataset "
                              "from data.mixture; the run's checkpoints are kept") from None


def split_documents(path: str, split: str) -> grain.MapDataset | None:
    """The documents of one split of a prepared dataset as int32 arrays; None if it is empty."""
    manifest = read_manifest(path)
    source = Shards(path, manifest["splits"][split]["shards"])
    if not len(source):
        return None
    decode = functools.partial(decode_tokens, dtype=manifest["dtype"])
    return grain.MapDataset.source(source).map(decode)


def mixture_shares(data: DataConfig) -> list[tuple[DatasetEntry, dict, float]]:
    """(entry, its train split from the manifest, its share of the tokens read) per dataset:
    weights count documents, so a share is weight x mean document length, normalised."""
    splits = [read_manifest(e.path)["splits"]["train"] for e in data.mixture]
    shares = [e.weight * s["tokens"] / max(s["documents"], 1) for e, s in zip(data.mixture, splits)]
    return [(e, s, share / sum(shares)) for e, s, share in zip(data.mixture, splits, shares)]


def unread(data: DataConfig, train: TrainConfig) -> str | None:
    """A warning naming the datasets of which the run reads less than one (mean) document."""
    if data.source != "arrayrecord":
        return None
    read = train.steps * train.batch_size * train.seq_len
    never = [f"{e.path} (weight {e.weight:g})" for e, s, share in mixture_shares(data)
             if read * share < s["tokens"] / max(s["documents"], 1)]
    if not never:
        return None
    fix = ("raise train.steps or train.batch_size" if len(never) == len(data.mixture)
           else "raise its weight, or drop it from data.mixture")
    return f"the run reads less than one document of {', '.join(never)}; {fix}"


def mixture_summary(data: DataConfig) -> str:
    """One log line: each dataset's weight, documents and tokens (from its manifest)."""
    parts = []
    for entry in data.mixture:
        s = read_manifest(entry.path)["splits"]
        entropy = s["train"].get("unigram_entropy")
        docs, train, val = s["train"]["documents"], s["train"]["tokens"], s["val"]["documents"]
        parts.append(f"{entry.path} (weight {entry.weight:g}): {docs:,} document"
                     f"{'' if docs == 1 else 's'}, {train:,} tokens, {val:,} held out"
                     + (f", unigram entropy {entropy:.3f} nats" if entropy else ""))
    return "data: " + "; ".join(parts)


# ---------------------------------------------------------------- writing
def is_val(rel: str, index: int, val_fraction: float) -> bool:
    """Whether a document goes to val: the rule the stdlib corpus holds files out by
    (corpus.is_held_out), keyed by the file's relative path and the document's index in it."""
    return is_held_out(f"{rel}\0{index}", val_fraction)


class SplitShards:
    """One split's shards of one unit: a new part every `part_tokens` tokens, named when done."""

    def __init__(self, out: Path, split: str, index: int, part_tokens: int):
        self.out, self.prefix, self.part_tokens = out, f"{split}-{index:05d}", part_tokens
        self.shards: list[str] = []
        self.documents = self.tokens = self.part_written = 0
        self.writer: ArrayRecordWriter | None = None

    def write(self, tokens: np.ndarray) -> None:
        """Append one document, rolling over to a new part once this one holds enough tokens."""
        if self.writer is None:
            self.shards.append(f"{self.prefix}-{len(self.shards):05d}.arrayrecord")
            temporary = self.out / f".{self.shards[-1]}.tmp"
            self.writer = ArrayRecordWriter(str(temporary), "group_size:1")  # random access
            self.part_written = 0
        self.writer.write(tokens.tobytes())
        self.documents, self.tokens = self.documents + 1, self.tokens + len(tokens)
        self.part_written += len(tokens)
        if self.part_written >= self.part_tokens:
            self.finish()

    def finish(self) -> dict:
        """Close the open part, give it its final name; this split's shards, documents, tokens."""
        if self.writer is not None:
            self.writer.close()
            os.replace(self.out / f".{self.shards[-1]}.tmp", self.out / self.shards[-1])
            self.writer = None
        return {"shards": self.shards, "documents": self.documents, "tokens": self.tokens}


def build_manifest(records: list[dict], tok: Tokenizer, run: dict) -> dict:
    """manifest.json of docs/data_format.md, from the units' completion records in order."""
    splits = {name: {"shards": [], "documents": 0, "tokens": 0} for name in SPLITS}
    for record in records:
        for name, split in splits.items():
            for key in split:
                split[key] += record["splits"][name][key]
    if records and all("unigram" in record for record in records):
        counts = np.zeros(tok.get_piece_size(), np.int64)
        for record in records:
            ids, n = record["unigram"]
            np.add.at(counts, np.asarray(ids, np.int64), np.asarray(n, np.int64))
        splits["train"]["unigram_entropy"] = round(
            entropy_of(counts, splits["train"]["documents"], tok.eos_id()), 6)
    files = [f for record in records for f in record["files"]]
    examples = [entry for record in records for entry in record["bad_examples"]]
    tokenizer = {"file": tok.file, "sha256": run["tokenizer_sha256"],
                 "vocab_size": tok.get_piece_size(), "bos_id": tok.bos_id(), "eos_id": tok.eos_id()}
    return {"format": MANIFEST_FORMAT, "tokenizer": tokenizer, "dtype": run["dtype"],
            "val_fraction": run["val_fraction"], "splits": splits,
            "sources": [{k: f[k] for k in ("path", "documents", "tokens", "bad")} for f in files],
            "bad_input": {"count": sum(f["bad"] for f in files),
                          "examples": examples[:MAX_EXAMPLES]}}

