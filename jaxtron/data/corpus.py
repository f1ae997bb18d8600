"""The built-in corpus: the Python standard library's own sources (found with sysconfig, present
wherever Python is), their digest, the held-out split, the token cache, and the cache directory
every derived file (tokenizers, token arrays) lives in.
"""

from __future__ import annotations

import hashlib
import io
import os
import sysconfig
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from jaxtron.config import SOURCES, ConfigError, DataConfig

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages"})
STDLIB_VAL_FRACTION = 0.01  # files held out for eval, chosen by a hash of their relative path


def cache_dir(data: DataConfig) -> Path:
    """Where derived files (tokenizers, token arrays) are cached."""
    path = data.cache_dir or os.environ.get("JAXTRON_CACHE") or Path.home() / ".cache" / "jaxtron"
    return Path(path).expanduser()


def write_atomic(path: Path, payload: bytes) -> None:
    """Write a file so that readers see either nothing or all of it, even with racing writers.
    A cache that cannot take it (read-only, full) is a ConfigError naming the settings to change."""
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shared cache should be readable by others
        os.replace(tmp, path)
    except BaseException as e:
        if tmp:
            Path(tmp).unlink(missing_ok=True)
        if isinstance(e, OSError):
            why = "it is a file" if path.parent.is_file() else e.strerror
            raise ConfigError(f"cannot write {path.name} into the cache {path.parent} "
                              f"({why}); set data.cache_dir (or JAXTRON_CACHE) to a "
                              "writable directory with space") from None
        raise


def stdlib_root() -> Path:
    """The standard library's directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The standard library's own `.py` sources (no tests, no site-packages), UTF-8 only, sorted."""
    files = []
    for folder, subdirs, names in os.walk(stdlib_root()):
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS]  # prune: site-packages is big
        for name in names:
            path = Path(folder) / name
            if name.endswith(".py") and not name.startswith("test_") and _is_utf8(path):
                files.append(path)
    return sorted(files)


def _is_utf8(path: Path) -> bool:
    """Whether the file is readable as UTF-8 text."""
    try:
        path.read_bytes().decode("utf-8")
    except (UnicodeDecodeError, OSError):
        return False
    return True


def source_files(data: DataConfig) -> list[Path]:
    """The files of the default corpus (all of them: the tokenizer is trained on every file)."""
    if data.source == "arrayrecord":
        raise ConfigError("data.source=arrayrecord has no source files; its tokenizer is the "
                          "datasets' own (jaxtron.data.prepared.dataset_tokenizer)")
    if data.source != "stdlib":
        raise ConfigError(f"data.source={data.source} is not one of {', '.join(SOURCES)}")
    return stdlib_files()


def read_texts(files: Sequence[Path]) -> list[str]:
    """Each file's exact text (bytes decoded, no newline translation)."""
    return [path.read_bytes().decode("utf-8") for path in files]


def files_digest(files: Sequence[Path]) -> str:
    """A hash of the files' paths and contents: the cache key of everything derived from them."""
    digest = hashlib.sha256()
    for path in files:
        content = path.read_bytes()
        digest.update(f"{path}\0{len(content)}\0".encode())
        digest.update(content)
    return digest.hexdigest()


def is_held_out(key: str, fraction: float) -> bool:
    """Whether `key` falls in the held-out `fraction`, by its sha256: the one held-out rule (stdlib
    files by relative path here, prepared documents by path and index in prepared.is_val)."""
    return int(hashlib.sha256(key.encode()).hexdigest()[:16], 16) < fraction * 2**64


def stdlib_split(files: Sequence[Path]) -> tuple[list[int], list[int]]:
    """Indices of the (train, val) files: val is ~1 %, chosen by a hash of the relative path."""
    root = stdlib_root()
    val = {i for i, f in enumerate(files)
           if is_held_out(f.relative_to(root).as_posix(), STDLIB_VAL_FRACTION)}
    return [i for i in range(len(files)) if i not in val], sorted(val)


@dataclass(frozen=True)
class TokenCorpus(Sequence):
    """Documents as one flat token array: document i is tokens[offsets[i]:offsets[i + 1]]."""

    tokens: np.ndarray  # int32 [num_tokens]
    offsets: np.ndarray  # int64 [num_docs + 1]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]

    def subset(self, indices: Sequence[int]) -> TokenCorpus:
        """The documents at `indices`, in that order, as a new corpus."""
        docs = [self[i] for i in indices]
        lengths = np.fromiter((len(d) for d in docs), np.int64, len(docs))
        tokens = np.concatenate(docs) if docs else np.zeros(0, np.int32)
        return TokenCorpus(tokens, np.concatenate([[0], np.cumsum(lengths)]))


class Encoder(Protocol):
    """What the corpus needs of a tokenizer (jaxtron.data.tokenizer.Tokenizer, which imports this
    module and so is not named here)."""

    sha256: str  # of the file the ids depend on: the token cache's key

    def encode_batch(self, texts: Sequence[str], threads: int = 0) -> list[list[int]]: ...


def encode_corpus(tok: Encoder, texts: Sequence[str]) -> TokenCorpus:
    """Tokenize documents with the tokenizer's multithreaded batch encoder."""
    ids = tok.encode_batch(texts)
    lengths = np.fromiter((len(doc) for doc in ids), np.int64, len(ids))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.fromiter((t for doc in ids for t in doc), np.int32, int(offsets[-1]))
    return TokenCorpus(tokens, offsets)


def load_corpus(data: DataConfig, tok: Encoder) -> TokenCorpus:
    """The whole default corpus tokenized by `tok`: encoded once, cached under tokenizer + files."""
    files = source_files(data)
    key = hashlib.sha256(f"{tok.sha256}\0{files_digest(files)}".encode()).hexdigest()[:16]
    path = cache_dir(data) / f"tokens-{data.source}-{key}.npz"
    if not path.is_file():
        corpus = encode_corpus(tok, read_texts(files))
        buffer = io.BytesIO()
        np.savez(buffer, tokens=corpus.tokens, offsets=corpus.offsets)
        write_atomic(path, buffer.getvalue())
    with np.load(path) as arrays:
        return TokenCorpus(arrays["tokens"], arrays["offsets"])


def unigram_entropy(corpus: TokenCorpus, eos_id: int) -> float:
    """Entropy (nats) of the targets' unigram distribution: the loss of a model blind to context."""
    return entropy_of(np.bincount(corpus.tokens), len(corpus), eos_id)


def entropy_of(counts: np.ndarray, documents: int, eos_id: int) -> float:
    """unigram_entropy from token counts (index = id) of `documents` documents."""
    counts = np.pad(np.asarray(counts, np.float64), (0, max(0, eos_id + 1 - len(counts))))
    counts[eos_id] += documents  # every document ends with an eos target
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())
