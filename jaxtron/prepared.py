"""Prepared datasets on disk (docs/data_format.md): manifests, the checks made before compiling,
and the documents of a split as a Grain map dataset over its ArrayRecord shards.
"""

from __future__ import annotations

import functools
import hashlib
import json
from pathlib import Path

import grain
import numpy as np
import sentencepiece as spm

from jaxtron.config import SOURCES, ConfigError, DataConfig
from jaxtron.tokenizer import load_tokenizer

MANIFEST_FORMAT = "jaxtron.tokens.v1"
TOKEN_DTYPES = ("uint16", "int32")
SPLITS = ("train", "val")


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
        raise ConfigError(f"{where}: cannot read {file} ({e.strerror})") from None
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
    """The copy of the SentencePiece model a dataset was tokenized with."""
    return Path(path).expanduser() / manifest["tokenizer"].get("file", "tokenizer.model")


def _sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_mixture(data: DataConfig, vocab_size: int) -> None:
    """Weights, one shared tokenizer, non-empty train splits, and a vocabulary that fits."""
    for entry in data.mixture:
        if not (entry.weight > 0 and np.isfinite(entry.weight)):
            raise ConfigError(f"data.mixture path {entry.path}: weight={entry.weight} must be a "
                              "positive number")
    manifests = [read_manifest(entry.path) for entry in data.mixture]
    first, tok = data.mixture[0].path, manifests[0]["tokenizer"]
    for entry, manifest in zip(data.mixture, manifests):
        if manifest["tokenizer"]["sha256"] != tok["sha256"]:
            raise ConfigError(f"data.mixture path {entry.path} was tokenized with another "
                              f"tokenizer than {first}; all datasets of a mixture must share one")
        if not manifest["splits"]["train"]["shards"]:
            raise ConfigError(f"data.mixture path {entry.path}: the train split has no shards")
    model = tokenizer_file(first, manifests[0])
    if not model.is_file() or _sha256(model) != tok["sha256"]:
        raise ConfigError(f"data.mixture path {first}: {model.name} is missing or does not match "
                          "the manifest's sha256; prepare the dataset again")
    if data.tokenizer:
        mine = Path(data.tokenizer).expanduser()
        if not mine.is_file() or _sha256(mine) != tok["sha256"]:
            raise ConfigError(f"data.tokenizer={data.tokenizer} is not the datasets' tokenizer "
                              f"({model}); set data.tokenizer='' or to that file")
    if tok["vocab_size"] > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the datasets' "
                          f"tokenizer ({tok['vocab_size']} pieces); raise it")


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


def dataset_tokenizer(data: DataConfig, vocab_size: int) -> spm.SentencePieceProcessor:
    """The tokenizer the batches are made with: the datasets' own when source=arrayrecord."""
    if data.source != "arrayrecord":
        return load_tokenizer(data, vocab_size)
    check_dataset(data, vocab_size)
    path = data.mixture[0].path
    return spm.SentencePieceProcessor(model_file=str(tokenizer_file(path, read_manifest(path))))


def decode_tokens(record: bytes, dtype: str) -> np.ndarray:
    """One record (a document's token ids, little-endian) as int32."""
    return np.frombuffer(record, np.dtype(dtype).newbyteorder("<")).astype(np.int32)


def split_documents(path: str, split: str) -> grain.MapDataset | None:
    """The documents of one split of a prepared dataset as int32 arrays; None if it is empty."""
    manifest = read_manifest(path)
    shards = [str(Path(path).expanduser() / s) for s in manifest["splits"][split]["shards"]]
    source = grain.sources.ArrayRecordDataSource(shards) if shards else []
    if not len(source):
        return None
    decode = functools.partial(decode_tokens, dtype=manifest["dtype"])
    return grain.MapDataset.source(source).map(decode)


def mixture_summary(data: DataConfig) -> str:
    """One log line: each dataset's weight, documents and tokens (from its manifest)."""
    parts = []
    for entry in data.mixture:
        s = read_manifest(entry.path)["splits"]
        parts.append(f"{entry.path} (weight {entry.weight:g}): {s['train']['documents']:,} "
                     f"documents, {s['train']['tokens']:,} tokens, {s['val']['documents']:,} "
                     "held out")
    return "data: " + "; ".join(parts)
