"""The workers of jaxtron prepare-data: input files divided into units of about
--part-tokens tokens, and each unit tokenized by one pool worker into its shards per split, with
each file's tally, its bad input and the train split's token counts (its completion record)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from jaxtron import lifecycle
from jaxtron.config import ConfigError
from jaxtron.data.corpus import write_atomic
from jaxtron.data.dataset_dir import PARTS
from jaxtron.data.prepared import SPLITS, SplitShards, is_val
from jaxtron.data.text_inputs import Source, bad_entry, describe, read_documents
from jaxtron.data.tokenizer import Tokenizer, from_path

BYTES_PER_TOKEN = 4  # sizes units before tokenizing; BPE on English or code gives ~3-5
MAX_REPORTED = 20  # bad-input lines kept as examples in the manifest, per input file
ENCODE_BATCH_CHARS = 4 << 20  # documents are encoded in batches of about this much text


class StrictStop(ConfigError):
    """Bad input under --strict; the message names the file and line."""

    def __str__(self) -> str:
        return f"bad input (--strict): {self.args[0]}"


@dataclass(frozen=True)
class Settings:
    """What every worker needs to know of the command line."""

    out: Path
    text_field: str
    val_fraction: float
    dtype: str
    part_tokens: int
    strict: bool
    tokenizer: str  # its file in `out`: tokenizer.model or tokenizer.json


@dataclass(frozen=True)
class Unit:
    """Consecutive input files that one worker tokenizes into one set of shards."""

    index: int
    sources: tuple[Source, ...]
    sizes: tuple[int, ...]  # each file's bytes when divided; a completion record must match them

    @property
    def size(self) -> int:
        """The unit's bytes of input."""
        return sum(self.sizes)


def divide_units(sources: list[Source], sizes: list[int], part_tokens: int) -> list[Unit]:
    """Files in order, grouped while they fit ~part_tokens tokens of bytes; a larger file alone."""
    budget, groups, total = part_tokens * BYTES_PER_TOKEN, [[]], 0
    for source, size in zip(sources, sizes):
        if groups[-1] and total + size > budget:
            groups.append([])
            total = 0
        groups[-1].append((source, size))
        total += size
    return [Unit(i, tuple(s for s, _ in group), tuple(n for _, n in group))
            for i, group in enumerate(groups)]


@dataclass(frozen=True)
class Worker:
    """What one worker process holds for every unit it tokenizes."""

    settings: Settings
    messages: mp.Queue  # progress and bad-input lines for the parent's bar
    stop: Any  # an mp.Event the parent sets under --strict: every unit ends at its next batch
    tok: Tokenizer  # loaded once per process, not once per unit
    threads: int  # encoding threads of each unit


# The pool's initializer runs in each worker process and leaves its Worker here for the tasks
# that process runs next: the one piece of per-process state a multiprocessing pool needs.
_worker: Worker | None = None


def init_worker(settings: Settings, messages: mp.Queue, stop: Any, threads: int) -> None:
    """Load the tokenizer once per worker process."""
    global _worker
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C stops the parent, which ends the pool
    lifecycle.end_with_parent()  # kill -9 of the parent: no worker goes on writing --out
    os.environ.setdefault("RAYON_NUM_THREADS", str(threads))  # tokenizer.json's encoding threads
    tok = from_path(settings.out / settings.tokenizer)
    _worker = Worker(settings, messages, stop, tok, threads)


def process_unit(unit: Unit) -> dict:
    """Tokenize one unit into its shards, then write its completion record."""
    worker = _worker
    try:
        record = UnitJob(worker, unit).run()
        write_atomic(worker.settings.out / PARTS / f"{unit.index:05d}.json",
                     json.dumps(record, indent=1).encode())
        return record
    finally:
        worker.messages.put(("done", unit.index))


class UnitJob:
    """Tokenizing one unit: its shards per split, each file's tally, the unit's bad input."""

    def __init__(self, worker: Worker, unit: Unit):
        self.worker, self.unit, self.settings = worker, unit, worker.settings
        self.dtype = np.dtype(self.settings.dtype).newbyteorder("<")
        self.splits = {s: SplitShards(self.settings.out, s, unit.index, self.settings.part_tokens)
                       for s in SPLITS}
        self.files = [{"path": str(source.path), "rel": source.rel, "bytes": size,
                       "documents": 0, "tokens": 0, "bad": 0}
                      for source, size in zip(unit.sources, unit.sizes)]
        self.bad_reasons: Counter = Counter()
        self.bad_examples: list[dict] = []
        self.unigram = np.zeros(0, np.int64)  # the train split's token counts, by id

    def run(self) -> dict:
        """Read, encode and write every document of every file; the completion record."""
        batch: list[tuple[int, int, dict, str]] = []  # (file, document index, where, text)
        chars = nbytes = 0
        for k, source in enumerate(self.unit.sources):
            for index, where, text, reason, size in read_documents(source.path,
                                                                   self.settings.text_field):
                if self.worker.stop.is_set():
                    raise StrictStop("another unit met bad input")
                nbytes += size
                if reason is not None or not text:
                    self.bad(k, where, reason or "empty document")
                    continue
                batch.append((k, index, where, text))
                chars += len(text)
                if chars >= ENCODE_BATCH_CHARS:
                    self.encode(batch, nbytes)
                    batch, chars, nbytes = [], 0, 0
        self.encode(batch, nbytes)
        splits = {name: shards.finish() for name, shards in self.splits.items()}
        ids = np.flatnonzero(self.unigram)
        return {"files": self.files, "bad_reasons": dict(self.bad_reasons),
                "bad_examples": self.bad_examples, "splits": splits,
                "unigram": [ids.tolist(), self.unigram[ids].tolist()]}

    def bad(self, k: int, where: dict, reason: str) -> None:
        """Count and report one bad document of file k; under --strict, stop."""
        self.bad_reasons[reason] += 1
        self.files[k]["bad"] += 1
        entry = bad_entry(self.unit.sources[k], where, reason)
        if self.files[k]["bad"] <= MAX_REPORTED:
            self.bad_examples.append(entry)
            self.worker.messages.put(("bad", describe(entry)))
        if self.settings.strict:
            raise StrictStop(describe(entry))

    def encode(self, batch: list[tuple[int, int, dict, str]], nbytes: int) -> None:
        """Tokenize a batch of documents and write each to its split."""
        ids = self.worker.tok.encode_batch([text for *_, text in batch], self.worker.threads)
        documents = tokens = 0
        train: list[list[int]] = []
        for (k, index, where, _), doc in zip(batch, ids):
            if not doc:  # possible with a tokenizer that normalizes whitespace away
                self.bad(k, where, "empty document")
                continue
            val = is_val(self.unit.sources[k].rel, index, self.settings.val_fraction)
            self.splits["val" if val else "train"].write(np.asarray(doc, self.dtype))
            if not val:
                train.append(doc)
            self.files[k]["documents"] += 1
            self.files[k]["tokens"] += len(doc)
            documents, tokens = documents + 1, tokens + len(doc)
        if train:
            counts = np.bincount(np.concatenate([np.asarray(d, np.int64) for d in train]))
            grown = np.zeros(max(len(counts), len(self.unigram)), np.int64)
            grown[:len(self.unigram)] = self.unigram
            grown[:len(counts)] += counts
            self.unigram = grown
        self.worker.messages.put(("progress", documents, tokens, nbytes))
