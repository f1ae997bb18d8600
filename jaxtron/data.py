"""Training batches: a source of token documents -> Grain shuffle -> shard -> pack -> batch.

The stages are separate so that sources can be swapped: the default source is the Python standard
library's own sources, tokenized once and cached as one flat token array plus document offsets;
the later production source (pre-tokenized ArrayRecord shards) is another sequence of token arrays
fed to the same `chunk_dataset -> shuffle_and_shard -> pack_and_batch` chain.

Every document is bos + tokens + eos, cut into chunks of at most seq_len + 1 tokens that overlap by
one token, so each token after bos is a target exactly once per epoch. Chunks are packed first-fit
into rows of seq_len; `segment_ids` number the chunks in a row from 1 (0 is padding) and
`positions` count from 0 inside each chunk.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import io
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import grain
import numpy as np
import sentencepiece as spm

from jaxtron.config import ConfigError, DataConfig, TrainConfig
from jaxtron.tokenizer import cache_dir, load_tokenizer, write_atomic

EXCLUDED_DIRS = frozenset({"test", "tests", "idle_test", "site-packages"})
PACKING_BINS_PER_ROW = 4  # packer bins = 4 x local batch: ~1 % padding on the stdlib at seq 256


def stdlib_files() -> list[Path]:
    """The standard library's own `.py` sources (no tests, no site-packages), UTF-8 only, sorted."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, subdirs, names in os.walk(root):
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
    """The files of the default corpus that `data.source` names."""
    if data.source != "stdlib":
        raise ConfigError(f"data.source={data.source} is not supported yet; use stdlib")
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


@dataclasses.dataclass(frozen=True)
class TokenCorpus(Sequence):
    """Documents as one flat token array: document i is tokens[offsets[i]:offsets[i + 1]]."""

    tokens: np.ndarray  # int32 [num_tokens]
    offsets: np.ndarray  # int64 [num_docs + 1]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]


def encode_corpus(sp: spm.SentencePieceProcessor, texts: Sequence[str]) -> TokenCorpus:
    """Tokenize documents with SentencePiece's multithreaded batch encoder."""
    ids = sp.encode(list(texts), num_threads=os.cpu_count() or 1)
    lengths = np.fromiter((len(doc) for doc in ids), np.int64, len(ids))
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    tokens = np.fromiter((t for doc in ids for t in doc), np.int32, int(offsets[-1]))
    return TokenCorpus(tokens, offsets)


def load_corpus(data: DataConfig, sp: spm.SentencePieceProcessor) -> TokenCorpus:
    """The default corpus tokenized by `sp`: encoded once, cached under tokenizer + files hash."""
    files = source_files(data)
    model = sp.serialized_model_proto()
    key = hashlib.sha256(model + files_digest(files).encode()).hexdigest()[:16]
    path = cache_dir(data) / f"tokens-{data.source}-{key}.npz"
    if not path.is_file():
        corpus = encode_corpus(sp, read_texts(files))
        buffer = io.BytesIO()
        np.savez(buffer, tokens=corpus.tokens, offsets=corpus.offsets)
        write_atomic(path, buffer.getvalue())
    with np.load(path) as arrays:
        return TokenCorpus(arrays["tokens"], arrays["offsets"])


def unigram_entropy(corpus: TokenCorpus, eos_id: int) -> float:
    """Entropy (nats) of the targets' unigram distribution: the loss of a model blind to context."""
    counts = np.bincount(corpus.tokens).astype(np.float64)
    counts = np.pad(counts, (0, max(0, eos_id + 1 - len(counts))))
    counts[eos_id] += len(corpus)  # every document ends with an eos target
    p = counts[counts > 0] / counts.sum()
    return float(-(p * np.log(p)).sum())


def chunk_index(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """[num_chunks, 2] (document, start) of every chunk; starts count in bos + doc + eos."""
    counts = (np.asarray(lengths, np.int64) + seq_len) // seq_len  # ceil((len + 1) / seq_len)
    docs = np.repeat(np.arange(len(counts)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([docs, (np.arange(len(docs)) - first) * seq_len], axis=1)


def _chunk(
    doc_and_start: np.ndarray, docs: Sequence[np.ndarray], seq_len: int, bos_id: int, eos_id: int
) -> dict[str, np.ndarray]:
    """Tokens and targets of one chunk: bos + doc + eos sliced to [start, start + seq_len + 1)."""
    doc_id, start = (int(x) for x in doc_and_start)
    doc = np.asarray(docs[doc_id], np.int32)
    stop = min(start + seq_len + 1, len(doc) + 2)
    parts = [np.array([bos_id], np.int32)] if start == 0 else []
    parts.append(doc[max(start, 1) - 1 : min(stop, len(doc) + 1) - 1])
    if stop == len(doc) + 2:
        parts.append(np.array([eos_id], np.int32))
    chunk = np.concatenate(parts)
    return {"tokens": chunk[:-1], "targets": chunk[1:]}


def chunk_dataset(
    docs: Sequence[np.ndarray], seq_len: int, bos_id: int, eos_id: int
) -> grain.MapDataset:
    """Every chunk of every document as {tokens, targets} of length <= seq_len, in corpus order."""
    lengths = np.fromiter((len(doc) for doc in docs), np.int64, len(docs))
    chunk = functools.partial(_chunk, docs=docs, seq_len=seq_len, bos_id=bos_id, eos_id=eos_id)
    return grain.MapDataset.source(chunk_index(lengths, seq_len)).map(chunk)


def _stream_seed(seed: int, stream: int) -> int:
    """A 32-bit seed per random stage; unrelated across seeds (Grain adds the epoch to the seed)."""
    return int(np.random.SeedSequence([seed, stream]).generate_state(1)[0])


def shuffle_and_shard(
    ds: grain.MapDataset, seed: int, process_index: int = 0, process_count: int = 1,
    num_epochs: int | None = None,
) -> grain.MapDataset:
    """Shuffled anew each epoch, repeated (forever by default), then this process's share."""
    ds = ds.shuffle(seed=_stream_seed(seed, 0)).repeat(num_epochs)
    return ds[process_index::process_count]


def _as_batch(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The packer's keys renamed to the trainer's."""
    return {
        "tokens": packed["tokens"],
        "targets": packed["targets"],
        "segment_ids": packed["tokens_segment_ids"],
        "positions": packed["tokens_positions"],
    }


def pack_and_batch(
    ds: grain.MapDataset, seq_len: int, local_batch: int, seed: int, drop_remainder: bool = True
) -> grain.IterDataset:
    """First-fit pack chunks into rows of seq_len, then batch rows: int32 [local_batch, seq_len]."""
    ds = ds.to_iter_dataset(grain.ReadOptions(num_threads=0, prefetch_buffer_size=0))
    ds = grain.experimental.FirstFitPackIterDataset(
        ds,
        length_struct={"tokens": seq_len, "targets": seq_len},
        num_packing_bins=PACKING_BINS_PER_ROW * local_batch,
        seed=_stream_seed(seed, 1),
        shuffle_bins=True,
    )
    return ds.batch(local_batch, drop_remainder=drop_remainder).map(_as_batch)


def make_batches(
    data: DataConfig, train: TrainConfig, vocab_size: int, process_index: int = 0,
    process_count: int = 1,
) -> grain.DatasetIterator:
    """This process's endless stream of packed batches of the default corpus."""
    if train.batch_size % process_count:
        raise ConfigError(
            f"train.batch_size={train.batch_size} is not divisible by the {process_count} processes"
        )
    source_files(data)  # fail on an unsupported source before training a tokenizer
    sp = load_tokenizer(data, vocab_size)
    if sp.get_piece_size() > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the tokenizer's "
                          f"{sp.get_piece_size()} pieces; raise it")
    corpus = load_corpus(data, sp)
    chunks = chunk_dataset(corpus, train.seq_len, sp.bos_id(), sp.eos_id())
    rows = shuffle_and_shard(chunks, train.seed, process_index, process_count)
    return iter(pack_and_batch(rows, train.seq_len, train.batch_size // process_count, train.seed))


def corpus_summary(data: DataConfig, vocab_size: int) -> str:
    """One log line: documents, tokens and the unigram entropy a context-free model would score."""
    sp = load_tokenizer(data, vocab_size)
    corpus = load_corpus(data, sp)
    return (f"corpus: {len(corpus):,} documents, {len(corpus.tokens):,} tokens, unigram entropy "
            f"{unigram_entropy(corpus, sp.eos_id()):.3f} nats (a context-free model's loss)")
