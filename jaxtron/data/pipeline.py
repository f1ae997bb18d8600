"""Training and eval batches: token documents -> chunk -> shuffle/repeat -> shard -> pack -> batch.

Two sources feed the same stages. `stdlib` (the default) is the Python standard library's own
sources, tokenized once and cached as one flat token array; its documents are chunked up front and
the chunks shuffled. `arrayrecord` is a weighted mixture of datasets made by jaxtron prepare-data
(docs/data_format.md); there the documents are shuffled (reading every record's length up front
would cost a pass over the data) and each one is cut into the same chunks after sharding.

Every document is bos + tokens + eos, cut into chunks of at most seq_len + 1 tokens that overlap by
one token, so each token after bos is a target exactly once per epoch. Chunks are packed first-fit
into rows of seq_len; `segment_ids` number the chunks in a row from 1 (0 is padding) and
`positions` count from 0 inside each chunk, so no token attends across a document boundary.
Each process builds only the rows its devices hold, from the packing of each global batch (rows.py).

Eval batches come the same way from held-out documents (the manifests' val splits, or ~1 % of the
stdlib files), unshuffled, whole on every process. Resume is exact for the same worker count and
pipeline on any process count; otherwise `BatchIterator.restore` warns and skips ahead
deterministically (docs/data.md).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path

import grain
import numpy as np
from absl import flags as absl_flags

from jaxtron import lifecycle
from jaxtron.config import ConfigError, DataConfig, TrainConfig
from jaxtron.data import corpus as corpus_lib
from jaxtron.data import prepared
from jaxtron.data.prepared import (
    check_dataset,
    check_eval,
    mixture_summary,
    read_manifest,
    split_documents,
)
from jaxtron.data.resume import InexactResumeWarning, resume_warning, saved_iterator_state
from jaxtron.data.rows import FAN_OUT, PackDocument, Recent, Rows, assemble, placeholder
from jaxtron.data.tokenizer import load_tokenizer

PACKING_BINS_PER_ROW = 4  # packer bins = 4 x local batch: ~1 % padding on the stdlib at seq 256
READ = grain.ReadOptions(num_threads=0, prefetch_buffer_size=0)  # no threads: state is exact
# Documents the packer read are kept for its rows up to this many batches of tokens: the packer's
# bins (4 batches) and a batch being filled.
RECENT_BATCHES = PACKING_BINS_PER_ROW + 2


# ---------------------------------------------------------------- stages shared by both sources
def chunk_index(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """[num_chunks, 2] (document, start) of every chunk; starts count in bos + doc + eos."""
    counts = (np.asarray(lengths, np.int64) + seq_len) // seq_len  # ceil((len + 1) / seq_len)
    docs = np.repeat(np.arange(len(counts)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    return np.stack([docs, (np.arange(len(docs)) - first) * seq_len], axis=1)


def chunk_lengths(lengths: np.ndarray, seq_len: int) -> np.ndarray:
    """The tokens of every chunk of `chunk_index(lengths, seq_len)`, in its order."""
    index = chunk_index(lengths, seq_len)
    ends = np.minimum(index[:, 1] + seq_len + 1, np.asarray(lengths, np.int64)[index[:, 0]] + 2)
    return ends - index[:, 1] - 1


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


@dataclasses.dataclass(frozen=True)
class SplitDocument(grain.experimental.FlatMapTransform):
    """One document -> its chunks, exactly as `chunk_dataset` cuts them (for streamed documents)."""

    seq_len: int
    bos_id: int
    eos_id: int
    max_fan_out: int = 1 << 20  # unused by the iterator flat-map; required by the interface

    def flat_map(self, doc: np.ndarray) -> list[dict[str, np.ndarray]]:
        index = chunk_index(np.array([len(doc)]), self.seq_len)
        return [_chunk(row, [doc], self.seq_len, self.bos_id, self.eos_id) for row in index]

    def cut(self, doc: np.ndarray, number: int) -> dict[str, np.ndarray]:
        """Chunk `number` of the document alone."""
        return _chunk((0, number * self.seq_len), [doc], self.seq_len, self.bos_id, self.eos_id)


def _stream_seed(seed: int, stream: int) -> int:
    """A 32-bit seed per random stage; unrelated across seeds (Grain adds the epoch to the seed)."""
    return int(np.random.SeedSequence([seed, stream]).generate_state(1)[0])


def shuffle_and_shard(
    ds: grain.MapDataset, seed: int, process_index: int = 0, process_count: int = 1,
    num_epochs: int | None = None, stream: int = 0,
) -> grain.MapDataset:
    """Shuffled anew each epoch, repeated (forever by default), then this process's share."""
    ds = ds.shuffle(seed=_stream_seed(seed, stream)).repeat(num_epochs)
    return ds[process_index::process_count]


def _as_batch(packed: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The packer's keys renamed to the trainer's."""
    return {
        "tokens": packed["tokens"],
        "targets": packed["targets"],
        "segment_ids": packed["tokens_segment_ids"],
        "positions": packed["tokens_positions"],
    }


def _pack(ds: grain.IterDataset, seq_len: int, local_batch: int, seed: int,
          features: tuple[str, ...], drop_remainder: bool = True) -> grain.IterDataset:
    """First-fit pack the `features` (all of one length per element) into rows, then batch rows.
    Where each element goes depends only on the lengths, the order and the seed."""
    ds = grain.experimental.FirstFitPackIterDataset(
        ds,
        length_struct={key: seq_len for key in features},
        num_packing_bins=PACKING_BINS_PER_ROW * local_batch,
        seed=_stream_seed(seed, 1),
        shuffle_bins=True,
    )
    return ds.batch(local_batch, drop_remainder=drop_remainder)


def pack_and_batch(
    ds: grain.MapDataset | grain.IterDataset, seq_len: int, local_batch: int, seed: int,
    drop_remainder: bool = True,
) -> grain.IterDataset:
    """First-fit pack chunks into rows of seq_len, then batch rows: int32 [local_batch, seq_len]."""
    if isinstance(ds, grain.MapDataset):
        ds = ds.to_iter_dataset(READ)
    return _pack(ds, seq_len, local_batch, seed, ("tokens", "targets"), drop_remainder).map(
        _as_batch)


# ---------------------------------------------------------------- streams and iterators
@dataclasses.dataclass(frozen=True)
class Stream:
    """A global map dataset of pack inputs (chunks, or documents that `split` cuts into chunks),
    and `keys`, the same stream as keys that the packing is made of without the tokens."""

    items: grain.MapDataset
    keys: grain.MapDataset  # per item: its chunk's id in `chunks`, or (documents) its position
    split: SplitDocument | None  # None: items are already chunks
    size: int  # items in one pass (of a repeated stream)
    chunks: grain.MapDataset | None = None  # every chunk by id (the stdlib), and its length
    lengths: np.ndarray | None = None

    def pack(self, key: int, recent: Recent) -> dict[str, np.ndarray] | tuple[int, int]:
        """A chunk's placeholder, or a document's key and length, which only reading it tells
        (the document kept in `recent` for the rows built from the packing)."""
        if self.split is None:
            return placeholder(int(self.lengths[key]), key * FAN_OUT)
        return int(key), len(recent.put(int(key), self.items[key]))

    def fetch(self, key: int, recent: Recent) -> dict[str, np.ndarray] | np.ndarray:
        """The chunk or document of a key."""
        if self.split is None:
            return self.chunks[key]
        return doc if (doc := recent.get(key)) is not None else self.items[key]

    def cut(self, item: dict[str, np.ndarray] | np.ndarray, number: int) -> dict[str, np.ndarray]:
        """Chunk `number` of a fetched item."""
        return item if self.split is None else self.split.cut(item, number)


def _stdlib_stream(data: DataConfig, seq_len: int, vocab_size: int, seed: int | None) -> Stream:
    """Stdlib chunks: train files shuffled and repeated (seed), or the val files in order."""
    tok = load_tokenizer(data, vocab_size)
    if tok.get_piece_size() > vocab_size:
        raise ConfigError(f"model.vocab_size={vocab_size} is smaller than the tokenizer's "
                          f"{tok.get_piece_size()} pieces; raise it")
    train_ids, val_ids = corpus_lib.stdlib_split(corpus_lib.source_files(data))
    docs = corpus_lib.load_corpus(data, tok).subset(train_ids if seed is not None else val_ids)
    chunks = chunk_dataset(docs, seq_len, tok.bos_id(), tok.eos_id())
    if seed is None and not len(chunks):
        raise ConfigError("no stdlib file is held out for eval; set train.eval_every=0")
    ids = grain.MapDataset.range(len(chunks))  # shuffled as the chunks: by their count alone
    items, keys = ((ds.repeat(None) if seed is None else shuffle_and_shard(ds, seed))
                   for ds in (chunks, ids))
    lengths = chunk_lengths(np.fromiter((len(doc) for doc in docs), np.int64, len(docs)), seq_len)
    return Stream(items, keys, None, len(chunks), chunks, lengths)


def _mixture_stream(data: DataConfig, seq_len: int, seed: int | None) -> Stream:
    """Mixture documents: train splits shuffled and repeated (seed), or the val splits in order."""
    parts, size = [], 0
    for k, entry in enumerate(data.mixture):
        docs = split_documents(entry.path, "train" if seed is not None else "val")
        if docs is None:  # check_dataset and check_eval made sure every split has documents
            raise ConfigError(prepared.empty_val(entry.path))
        size += len(docs)
        parts.append(shuffle_and_shard(docs, seed, stream=2 + k) if seed is not None
                     else docs.repeat(None))
    weights = [entry.weight for entry in data.mixture]
    items = parts[0] if len(parts) == 1 else grain.MapDataset.mix(parts, weights)
    tok = read_manifest(data.mixture[0].path)["tokenizer"]
    split = SplitDocument(seq_len, tok["bos_id"], tok["eos_id"])
    return Stream(items, grain.MapDataset.range(len(items)), split, size)


def _stream(data: DataConfig, seq_len: int, vocab_size: int, seed: int | None) -> Stream:
    """The training stream (seeded) or the held-out one (seed None) of `data.source`, checked
    (check_dataset) by the caller."""
    if data.source == "arrayrecord":
        return _mixture_stream(data, seq_len, seed)
    return _stdlib_stream(data, seq_len, vocab_size, seed)


def _batches(stream: Stream, start: int, train: TrainConfig, workers: int,
             rows: np.ndarray | None = None) -> grain.IterDataset:
    """Skip `start` items of the global stream, pack its keys into each *global*
    batch (the same for every process and any process count), and build the rows `rows` of
    it (all when None), with "items": the stream items each batch begins."""
    keys = stream.keys[start:] if start else stream.keys
    recent = Recent(RECENT_BATCHES * train.batch_size * train.seq_len)  # one per Grain worker
    ds = keys.map(functools.partial(stream.pack, recent=recent)).to_iter_dataset(READ)
    if stream.split is not None:
        ds = grain.experimental.FlatMapIterDataset(ds, PackDocument(train.seq_len))
    ds = _pack(ds, train.seq_len, train.batch_size, train.seed, ("tokens",))
    ds = ds.map(functools.partial(assemble, rows=rows, cut=stream.cut,
                                  fetch=functools.partial(stream.fetch, recent=recent)))
    if workers:
        if not absl_flags.FLAGS.is_parsed():  # grain 0.2.18 reads an absl flag once jax is loaded
            absl_flags.FLAGS.mark_as_parsed()  # (google/grain#1355, fixed after that release)
        options = grain.MultiprocessingOptions(num_workers=workers, per_worker_buffer_size=4)
        # The tracker that frees the workers' shared memory after a stop warns of each piece
        # it frees ("leaked shared_memory objects"): nothing is lost, so it does so quietly.
        quiet, given = "ignore:resource_tracker:UserWarning", os.environ.get("PYTHONWARNINGS", "")
        if quiet not in given:
            os.environ["PYTHONWARNINGS"] = f"{given},{quiet}" if given else quiet
        # Each worker packs its own slice (output depends on workers) and dies with the run.
        ds = ds.mp_prefetch(options, worker_init_fn=lifecycle.quiet_worker)
    return ds


class BatchIterator(grain.DatasetIterator):
    """Grain's iterator of packed batches, whose state also records the layout it is exact for."""

    _it: grain.DatasetIterator | None = None  # None until built (Grain's __del__ calls close)

    def __init__(self, build: Callable[[int], grain.IterDataset], layout: dict,
                 rows: Rows | None = None):
        super().__init__()
        self._build, self.layout, self.rows = build, layout, rows
        self._start, self._consumed = 0, 0
        self._it = iter(build(0))

    def __next__(self) -> dict[str, np.ndarray]:
        batch = next(self._it)  # this process's rows of the global batch
        self._consumed += batch.pop("items")  # of the global batch: the same on every process
        return batch

    def get_state(self) -> dict:
        return {"grain": self._it.get_state(), "start": self._start,
                "consumed": self._consumed, **self.layout}

    def set_state(self, state: dict) -> None:
        self.restore(state)

    def restore(self, saved: dict) -> bool:
        """Exact when `saved` has this layout; else warn and skip ahead about as far (False)."""
        if (warning := resume_warning(saved, self.layout)) is None:
            if saved["start"] != self._start:
                self._restart(saved["start"])
            self._it.set_state(saved["grain"])
            self._consumed = saved["consumed"]
            return True
        warnings.warn(warning, InexactResumeWarning, stacklevel=2)
        self._restart(saved["start"] + saved["consumed"])
        return False

    def _restart(self, start: int) -> None:
        """A fresh Grain iterator over the global stream from item `start`."""
        self._it.close()
        self._it = iter(self._build(start))
        self._start, self._consumed = start, 0

    def start_prefetch(self) -> None:
        self._it.start_prefetch()

    def close(self) -> None:
        if self._it is not None:
            self._it.close()


def restore_iterator(it: BatchIterator, saved_state: dict) -> bool:
    """Move `it` to a saved position: True if exact, else False after an InexactResumeWarning."""
    return it.restore(saved_state)


def resume_input(batches: BatchIterator, directory: Path, warn: Callable[[str], None]) -> bool:
    """Move `batches` to the position a checkpoint's data item (`directory`) saved: exact for
    the same process and worker counts; otherwise it resumes deterministically nearby, and
    `warn` says so. Whether it was exact."""
    import jax

    return resume_state(batches, saved_iterator_state(directory, jax.process_index(),
                                                      jax.process_count()), warn)


def resume_state(batches: BatchIterator, saved: dict, warn: Callable[[str], None]) -> bool:
    """Move `batches` to `saved` (its get_state()), as resume_input does; whether exact."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", InexactResumeWarning)
        exact = restore_iterator(batches, saved)
    for w in caught:
        warn(f"warning: {w.message}")
    return exact


def make_input(data: DataConfig, train: TrainConfig, vocab_size: int,
               rows: Rows | None = None) -> tuple[BatchIterator, list[dict[str, np.ndarray]]]:
    """A run's input: make_batches and make_eval_batches, `data` checked once before either
    (check_dataset; check_eval, as evaluation reads every dataset's val split)."""
    check_dataset(data, vocab_size)
    check_eval(data, train.eval_every)
    return _train_batches(data, train, vocab_size, rows), _eval_batches(data, train, vocab_size)


def make_batches(data: DataConfig, train: TrainConfig, vocab_size: int,
                 rows: Rows | None = None) -> BatchIterator:
    """The endless stream of packed training batches, int32 [len(rows), seq_len]: the rows `rows`
    (rows.local_rows; all when None) of the global batches, which are the same for any process
    count, so results and resume do not depend on it."""
    check_dataset(data, vocab_size)
    return _train_batches(data, train, vocab_size, rows)


def _train_batches(data: DataConfig, train: TrainConfig, vocab_size: int,
                   rows: Rows | None) -> BatchIterator:
    stream = _stream(data, train.seq_len, vocab_size, train.seed)
    build = functools.partial(_batches, stream, train=train, workers=data.workers,
                              rows=None if rows is None else rows.indices)
    return BatchIterator(build, layout_of(data, train), rows)


def layout_of(data: DataConfig, train: TrainConfig) -> dict:
    """The fields the batches depend on, as plain JSON values: a checkpoint stores them, and a
    restore compares them field by field with this run's."""
    pipeline = {"source": data.source,
                "mixture": [[entry.path, entry.weight] for entry in data.mixture],
                "seq_len": train.seq_len, "batch_size": train.batch_size, "seed": train.seed}
    return {"workers": data.workers, "pipeline": pipeline}


def make_eval_batches(data: DataConfig, train: TrainConfig,
                      vocab_size: int) -> list[dict[str, np.ndarray]]:
    """The first `train.eval_batches` global batches of the held-out split, unshuffled, the same at
    every call ([] when train.eval_every is 0). They end once the split is read through (its
    last batch filled from its start): the same tokens again would add time, not information."""
    check_dataset(data, vocab_size)
    return _eval_batches(data, train, vocab_size)


def _eval_batches(data: DataConfig, train: TrainConfig,
                  vocab_size: int) -> list[dict[str, np.ndarray]]:
    if train.eval_every <= 0:
        return []
    stream = _stream(data, train.seq_len, vocab_size, None)
    batches, read = [], 0
    for batch in itertools.islice(_batches(stream, 0, train, workers=0), train.eval_batches):
        read += batch.pop("items")
        batches.append(batch)
        if read > stream.size:  # the split began again: every item of it is in
            break
    return batches


def eval_warning(eval_batches: list, train: TrainConfig) -> str | None:
    """A warning when the held-out split filled fewer batches than train.eval_batches asks."""
    if 0 < len(eval_batches) < train.eval_batches:
        return (f"train.eval_batches={train.eval_batches}: the held-out split fills "
                f"{len(eval_batches)}, which each evaluation reads; set train.eval_batches="
                f"{len(eval_batches)} (or hold out more data)")
    return None


def corpus_summary(data: DataConfig, vocab_size: int) -> str:
    """One log line: documents, tokens and the unigram entropy a context-free model would score."""
    if data.source == "arrayrecord":
        return mixture_summary(data)
    tok = load_tokenizer(data, vocab_size)
    corpus = corpus_lib.load_corpus(data, tok)
    held_out = len(corpus_lib.stdlib_split(corpus_lib.source_files(data))[1])
    return (f"corpus: {len(corpus):,} documents ({held_out} held out for eval), "
            f"{len(corpus.tokens):,} tokens, unigram entropy "
            f"{corpus_lib.unigram_entropy(corpus, tok.eos_id()):.3f} nats "
            "(a context-free model's loss)")
