"""Default corpus, tokenizer and Grain pipeline: exact round trips, no token lost, determinism."""

import math
import re
import time

import grain
import numpy as np
import pytest

from jaxtron import data as data_lib
from jaxtron import tokenizer as tokenizer_lib
from jaxtron.config import ConfigError, DataConfig, TrainConfig

VOCAB = 8192


@pytest.fixture(scope="session")
def cfg(tmp_path_factory) -> DataConfig:
    return DataConfig(cache_dir=str(tmp_path_factory.mktemp("jaxtron_cache")))


@pytest.fixture(scope="session")
def sp(cfg):
    start = time.perf_counter()
    sp = tokenizer_lib.load_tokenizer(cfg, VOCAB)
    print(f"\ntokenizer trained in {time.perf_counter() - start:.2f} s")
    return sp


@pytest.fixture(scope="session")
def corpus(cfg, sp) -> data_lib.TokenCorpus:
    start = time.perf_counter()
    corpus = data_lib.load_corpus(cfg, sp)
    print(f"\ncorpus encoded in {time.perf_counter() - start:.2f} s: {len(corpus.tokens)} tokens")
    return corpus


def test_stdlib_files_are_the_library_without_tests():
    files = data_lib.stdlib_files()
    names = {f.name for f in files}
    assert {"os.py", "ast.py", "__init__.py", "typing.py"} <= names
    assert not any(f.name.startswith("test_") or "site-packages" in f.parts for f in files)
    assert not any({"test", "tests", "idle_test"} & set(f.parts) for f in files)
    assert files == sorted(files) and 400 < len(files) < 2000
    assert 8e6 < sum(f.stat().st_size for f in files) < 20e6


def test_tokenizer_round_trips_the_whole_corpus_exactly(cfg, sp, corpus):
    texts = data_lib.read_texts(data_lib.stdlib_files())
    assert len(texts) == len(corpus)
    decoded = sp.decode([doc.tolist() for doc in corpus])
    assert sum(d != t for d, t in zip(decoded, texts)) == 0
    assert (corpus.tokens != sp.unk_id()).all()  # byte fallback: nothing is UNK
    assert (sp.bos_id(), sp.eos_id(), sp.get_piece_size()) == (1, 2, VOCAB)
    assert sp.encode("\n") == [sp.piece_to_id("\n")]
    assert sp.decode(sp.encode("if x:\n\tpass  # é ✓\r\n")) == "if x:\n\tpass  # é ✓\r\n"
    assert 3.0e6 < len(corpus.tokens) < 4.5e6


def test_second_load_uses_the_cache(cfg, sp, corpus):
    (model,) = tokenizer_lib.cache_dir(cfg).glob("tokenizer-*.model")
    mtime = model.stat().st_mtime_ns
    start = time.perf_counter()
    again = tokenizer_lib.load_tokenizer(cfg, VOCAB)
    cached_corpus = data_lib.load_corpus(cfg, again)
    assert time.perf_counter() - start < 1.0
    assert model.stat().st_mtime_ns == mtime
    assert [again.id_to_piece(i) for i in range(VOCAB)] == [sp.id_to_piece(i) for i in range(VOCAB)]
    np.testing.assert_array_equal(cached_corpus.tokens, corpus.tokens)


def test_config_errors_are_one_line(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(ConfigError, match=f"^data.tokenizer={re.escape(str(missing))}: no such"):
        tokenizer_lib.load_tokenizer(DataConfig(tokenizer=str(missing)), VOCAB)
    with pytest.raises(ConfigError, match="^data.source=c4 is not supported yet; use stdlib$"):
        data_lib.make_batches(DataConfig(source="c4"), TrainConfig(), VOCAB)
    with pytest.raises(ConfigError, match="vocab_size=100") as e:
        tokenizer_lib.train_tokenizer(["def f(x):", "    return x"] * 10, 100)
    assert "\n" not in str(e.value)


def test_chunks_cover_every_document_token_once():
    seq_len, bos, eos = 8, 1, 2
    docs = [np.arange(10, 10 + n, dtype=np.int32) for n in (0, 1, 6, 7, 8, 9, 29)]
    chunks = list(data_lib.chunk_dataset(docs, seq_len, bos, eos))
    index = data_lib.chunk_index(np.array([len(d) for d in docs]), seq_len)
    assert len(chunks) == len(index) == 1 + 1 + 1 + 1 + 2 + 2 + 4  # ceil((len + 1) / seq_len)
    for doc_id, doc in enumerate(docs):
        mine = [c for c, (d, _) in zip(chunks, index) if d == doc_id]
        assert all(0 < len(c["tokens"]) == len(c["targets"]) <= seq_len for c in mine)
        assert all((c["targets"][:-1] == c["tokens"][1:]).all() for c in mine)
        np.testing.assert_array_equal(np.concatenate([c["tokens"] for c in mine]), [bos, *doc])
        np.testing.assert_array_equal(np.concatenate([c["targets"] for c in mine]), [*doc, eos])


def test_unigram_entropy(corpus, sp):
    tiny = data_lib.TokenCorpus(np.array([3, 3, 4], np.int32), np.array([0, 3]))
    expected = 0.5 * math.log(2) + 0.5 * math.log(4)  # targets 3, 3, 4, eos
    assert data_lib.unigram_entropy(tiny, eos_id=2) == pytest.approx(expected)
    assert 5.5 < data_lib.unigram_entropy(corpus, sp.eos_id()) < 7.0  # 6.19 nats here


def check_packed_batch(batch: dict, rows: int, seq_len: int) -> None:
    """Shapes, dtypes and the packing invariants the trainer relies on."""
    assert set(batch) == {"tokens", "targets", "segment_ids", "positions"}
    assert all(v.shape == (rows, seq_len) and v.dtype == np.int32 for v in batch.values())
    tok, tgt, seg, pos = (batch[k] for k in ("tokens", "targets", "segment_ids", "positions"))
    same = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] != 0)
    assert (tgt[:, :-1][same] == tok[:, 1:][same]).all()  # next-token targets inside a segment
    assert (pos[:, 1:][same] == pos[:, :-1][same] + 1).all()
    starts = (seg[:, 1:] != seg[:, :-1]) & (seg[:, 1:] != 0)
    assert (pos[:, 1:][starts] == 0).all() and (pos[:, 0] == 0).all() and (seg[:, 0] == 1).all()
    assert (seg[:, 1:][starts] == seg[:, :-1][starts] + 1).all()  # 1, 2, 3, ... per row
    pad = seg == 0
    assert (np.diff(pad.astype(int), axis=1) >= 0).all()  # padding only at the row end
    assert (tok[pad] == 0).all() and (tgt[pad] == 0).all() and (pos[pad] == 0).all()


def test_batches_are_packed_with_little_padding(cfg, corpus):
    it = data_lib.make_batches(cfg, TrainConfig(batch_size=16, seq_len=256), VOCAB)
    batches = [next(it) for _ in range(100)]
    for batch in batches:
        check_packed_batch(batch, 16, 256)
    padding = np.mean([(b["segment_ids"] == 0).mean() for b in batches])
    print(f"\npadding fraction at seq_len 256: {padding:.4f}")
    assert padding < 0.02  # ~0.9 % with 4 packing bins per row


def test_one_epoch_targets_every_token_exactly_once(corpus):
    docs = [corpus[i] for i in range(0, len(corpus), 12)]  # a 62-document corpus, ~300 k tokens
    chunks = data_lib.chunk_dataset(docs, seq_len=64, bos_id=1, eos_id=2)
    rows = data_lib.shuffle_and_shard(chunks, seed=3, num_epochs=1)
    batches = list(data_lib.pack_and_batch(rows, 64, local_batch=8, seed=3, drop_remainder=False))
    for batch in batches[:-1]:
        check_packed_batch(batch, 8, 64)
    seg = np.concatenate([b["segment_ids"] for b in batches])
    targets = np.concatenate([b["targets"] for b in batches])[seg != 0]
    expected = np.concatenate([np.append(doc, 2) for doc in docs])
    np.testing.assert_array_equal(np.sort(targets), np.sort(expected))
    assert seg.max(axis=1).sum() == len(chunks)  # segments per row are 1..k: one per chunk


def test_same_seed_same_batches_and_state_restores(cfg, corpus):
    def first(seed: int, n: int = 4) -> list[dict]:
        it = data_lib.make_batches(cfg, TrainConfig(batch_size=4, seq_len=128, seed=seed), VOCAB)
        return [next(it) for _ in range(n)]

    same = first(0), first(0)
    assert all((a[k] == b[k]).all() for a, b in zip(*same) for k in a)
    assert not (first(1)[0]["tokens"] == same[0][0]["tokens"]).all()
    it = data_lib.make_batches(cfg, TrainConfig(batch_size=4, seq_len=128), VOCAB)
    assert isinstance(it, grain.DatasetIterator)
    next(it), next(it)
    state = it.get_state()
    after = [next(it) for _ in range(2)]
    resumed = data_lib.make_batches(cfg, TrainConfig(batch_size=4, seq_len=128), VOCAB)
    resumed.set_state(state)
    again = [next(resumed) for _ in range(2)]
    assert all((a[k] == b[k]).all() for a, b in zip(after, again) for k in a)


def test_processes_read_disjoint_chunks_that_cover_one_process(cfg, corpus):
    def chunk_ids(process_index: int, process_count: int) -> list[int]:
        ds = grain.MapDataset.range(n)  # stands for the chunks; indexing avoids prefetch threads
        ds = data_lib.shuffle_and_shard(ds, 5, process_index, process_count, num_epochs=2)
        return [ds[i] for i in range(len(ds))]

    n = len(data_lib.chunk_index(np.diff(corpus.offsets), 256))
    one, two = chunk_ids(0, 1), [chunk_ids(0, 2), chunk_ids(1, 2)]
    assert two[0] == one[0::2] and two[1] == one[1::2]
    for epoch in (slice(0, n), slice(n, 2 * n)):  # each epoch: disjoint halves, all chunks
        halves = [{x for k, x in enumerate(one[epoch], epoch.start) if k % 2 == i} for i in (0, 1)]
        assert not halves[0] & halves[1] and halves[0] | halves[1] == set(range(n))
    it = data_lib.make_batches(cfg, TrainConfig(batch_size=16, seq_len=256), VOCAB, 1, 2)
    check_packed_batch(next(it), 8, 256)


def test_tokenizer_training_is_deterministic():
    texts = data_lib.read_texts(data_lib.stdlib_files()[:60])
    lines = [line for text in texts for line in text.split("\n") if line]
    first, second = (tokenizer_lib.train_tokenizer(lines, 1024) for _ in range(2))
    assert first == second
