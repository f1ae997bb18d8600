"""Input pipeline: stdlib corpus, tokenizer, ArrayRecord mixtures, eval split, resume."""

import dataclasses
import hashlib
import json
import math
import os
import re
import shutil
import time
from pathlib import Path

import grain
import numpy as np
import pytest
from helpers import assert_refused, random_docs, write_dataset

from jaxtron import data as data_lib
from jaxtron.config import ConfigError, DataConfig, DatasetEntry, ModelConfig, TrainConfig
from jaxtron.data import corpus as corpus_lib
from jaxtron.data import prepared
from jaxtron.data import tokenizer as tokenizer_lib

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
def corpus(cfg, sp) -> corpus_lib.TokenCorpus:
    start = time.perf_counter()
    corpus = corpus_lib.load_corpus(cfg, sp)
    print(f"\ncorpus encoded in {time.perf_counter() - start:.2f} s: {len(corpus.tokens)} tokens")
    return corpus


def test_stdlib_files_are_the_library_without_tests():
    files = corpus_lib.stdlib_files()
    names = {f.name for f in files}
    assert {"os.py", "ast.py", "__init__.py", "typing.py"} <= names
    assert not any(f.name.startswith("test_") or "site-packages" in f.parts for f in files)
    assert not any({"test", "tests", "idle_test"} & set(f.parts) for f in files)
    assert files == sorted(files) and 400 < len(files) < 2000
    assert 8e6 < sum(f.stat().st_size for f in files) < 20e6


def test_tokenizer_round_trips_the_whole_corpus_exactly(cfg, sp, corpus):
    texts = corpus_lib.read_texts(corpus_lib.stdlib_files())
    assert len(texts) == len(corpus)
    decoded = [sp.decode(doc) for doc in corpus]
    assert sum(d != t for d, t in zip(decoded, texts)) == 0
    assert sp.piece_to_id("<unk>") == 0 and (corpus.tokens != 0).all()  # byte fallback: no UNK
    assert (sp.bos_id(), sp.eos_id(), sp.get_piece_size()) == (1, 2, VOCAB)
    assert sp.encode("\n") == [sp.piece_to_id("\n")]
    assert sp.decode(sp.encode("if x:\n\tpass  # é ✓\r\n")) == "if x:\n\tpass  # é ✓\r\n"
    assert 3.0e6 < len(corpus.tokens) < 4.5e6


def test_second_load_uses_the_cache(cfg, sp, corpus):
    (model,) = corpus_lib.cache_dir(cfg).glob("tokenizer-*.model")
    mtime = model.stat().st_mtime_ns
    start = time.perf_counter()
    again = tokenizer_lib.load_tokenizer(cfg, VOCAB)
    cached_corpus = corpus_lib.load_corpus(cfg, again)
    assert time.perf_counter() - start < 1.0
    assert model.stat().st_mtime_ns == mtime
    assert [again.id_to_piece(i) for i in range(VOCAB)] == [sp.id_to_piece(i) for i in range(VOCAB)]
    np.testing.assert_array_equal(cached_corpus.tokens, corpus.tokens)


def test_config_errors_are_one_line(tmp_path):
    missing = tmp_path / "nope.model"
    with pytest.raises(ConfigError, match=f"^data.tokenizer={re.escape(str(missing))}: no such"):
        tokenizer_lib.load_tokenizer(DataConfig(tokenizer=str(missing)), VOCAB)
    with pytest.raises(ConfigError, match="^data.source=c4 is not one of stdlib, arrayrecord$"):
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
    tiny = corpus_lib.TokenCorpus(np.array([3, 3, 4], np.int32), np.array([0, 3]))
    expected = 0.5 * math.log(2) + 0.5 * math.log(4)  # targets 3, 3, 4, eos
    assert corpus_lib.unigram_entropy(tiny, eos_id=2) == pytest.approx(expected)
    assert 5.5 < corpus_lib.unigram_entropy(corpus, sp.eos_id()) < 7.0  # 6.19 nats here


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


@pytest.mark.parametrize("seq_len, most", [(256, 0.02), (2048, 0.04)])
def test_batches_are_packed_with_little_padding(cfg, corpus, seq_len, most):
    it = data_lib.make_batches(cfg, TrainConfig(batch_size=16, seq_len=seq_len), VOCAB)
    batches = [next(it) for _ in range(100 if seq_len == 256 else 30)]
    for batch in batches:
        check_packed_batch(batch, 16, seq_len)
    padding = np.mean([(b["segment_ids"] == 0).mean() for b in batches])
    print(f"\npadding fraction at seq_len {seq_len}, batch 16: {padding:.4f}")
    assert padding < most  # 0.85 % at 256, 2.4 % at 2048 with 4 packing bins per row


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


def test_tokenizer_training_is_deterministic():
    texts = corpus_lib.read_texts(corpus_lib.stdlib_files()[:60])
    lines = [line for text in texts for line in text.split("\n") if line]
    first, second = (tokenizer_lib.train_tokenizer(lines, 1024) for _ in range(2))
    assert first == second


# ---------------------------------------------------------------- held-out stdlib files, eval
def test_stdlib_holds_out_about_one_percent_of_files_for_eval(cfg, corpus):
    files = corpus_lib.stdlib_files()
    train, val = corpus_lib.stdlib_split(files)
    assert not set(train) & set(val) and sorted(train + val) == list(range(len(files)))
    assert 0.002 < len(val) / len(files) < 0.03  # 6 of 734 files on Python 3.11
    tc = TrainConfig(batch_size=4, seq_len=128, eval_every=10, eval_batches=3)
    first, again = (data_lib.make_eval_batches(cfg, tc, VOCAB) for _ in range(2))
    assert len(first) == 3 and all(_equal(a, b) for a, b in zip(first, again))
    for batch in first:
        check_packed_batch(batch, 4, 128)
    held_out = b"".join(np.array([1, *corpus[i], 2], np.int32).tobytes() for i in val)
    for batch in first:  # every eval segment is a piece of a held-out file
        for row_tok, row_seg in zip(batch["tokens"], batch["segment_ids"]):
            for s in set(row_seg[row_seg > 0].tolist()):
                assert held_out.find(row_tok[row_seg == s].tobytes()) % 4 == 0


def test_eval_batches_end_once_the_held_out_split_is_read_through(cfg, corpus):
    """train.eval_batches=1000 over the ~13,500 held-out tokens: each evaluation read them 150
    times over (minutes per evaluation with 100000); now it reads them once, with a warning."""
    _, val = corpus_lib.stdlib_split(corpus_lib.stdlib_files())
    tc = TrainConfig(batch_size=4, seq_len=128, eval_every=10, eval_batches=1000)
    batches = data_lib.make_eval_batches(cfg, tc, VOCAB)
    tokens = sum(len(corpus[i]) + 2 for i in val)  # each file with its bos and eos
    assert tokens / (4 * 128) < len(batches) < 1.1 * tokens / (4 * 128) + 2
    seen = np.concatenate([b["tokens"][b["segment_ids"] != 0] for b in batches])
    held_out = np.concatenate([corpus[i] for i in val])
    counts = np.bincount(seen, minlength=VOCAB)[:held_out.max() + 1]
    assert (counts >= np.bincount(held_out)).all()  # every held-out token was read
    assert data_lib.eval_warning(batches, tc) == (
        f"train.eval_batches=1000: the held-out split fills {len(batches)}, which each evaluation "
        f"reads; set train.eval_batches={len(batches)} (or hold out more data)")
    assert data_lib.eval_warning(batches, dataclasses.replace(tc, eval_batches=len(batches))) is None


def _equal(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def _take(it, n: int) -> list[dict]:
    return [next(it) for _ in range(n)]


# ---------------------------------------------------------------- prepared datasets (fixtures)
A_TRAIN, A_VAL, B_TRAIN, B_VAL = (10, 4000), (4000, 4096), (4096, 8000), (8000, 8192)


@pytest.fixture(scope="session")
def datasets(cfg, sp, tmp_path_factory) -> dict:
    """a: short docs (uint16); b: long docs (int32 records); c: no val split."""
    (model,) = corpus_lib.cache_dir(cfg).glob("tokenizer-*.model")
    root = tmp_path_factory.mktemp("datasets")
    a = {"train": random_docs(0, 600, 300, *A_TRAIN), "val": random_docs(1, 30, 300, *A_VAL)}
    b = {"train": random_docs(2, 300, 1500, *B_TRAIN), "val": random_docs(3, 10, 1500, *B_VAL)}
    c = {"train": random_docs(4, 50, 300, *A_TRAIN), "val": []}
    return {"a": write_dataset(root / "a", a, model), "b": write_dataset(root / "b", b, model,
            "int32", shards=3), "c": write_dataset(root / "c", c, model), "model": str(model),
            "docs": {"a": a, "b": b}}


def mixture(datasets: dict, cache: str, *weights: tuple[str, float], **kw) -> DataConfig:
    entries = [DatasetEntry(datasets[name], w) for name, w in weights]
    return DataConfig(source="arrayrecord", mixture=entries, cache_dir=cache, **kw)


def test_records_decode_to_the_documents_written(datasets):
    for name, shards in (("a", 2), ("b", 3)):
        for split, docs in datasets["docs"][name].items():
            read = data_lib.split_documents(datasets[name], split)
            written = [d for part in range(shards) for d in docs[part::shards]]
            assert len(read) == len(written)
            assert all(np.array_equal(read[i], d) and read[i].dtype == np.int32
                       for i, d in enumerate(written))
    assert data_lib.split_documents(datasets["c"], "val") is None


def test_streamed_documents_are_cut_like_chunked_ones_and_one_epoch_covers_all(datasets):
    docs = datasets["docs"]["b"]["train"]
    whole = list(data_lib.chunk_dataset(docs, 64, 1, 2))
    split = data_lib.SplitDocument(64, 1, 2)
    streamed = [c for doc in docs for c in split.flat_map(doc)]
    assert len(whole) == len(streamed) and all(_equal(a, b) for a, b in zip(whole, streamed))
    ds = data_lib.split_documents(datasets["b"], "train")
    ds = data_lib.shuffle_and_shard(ds, seed=3, num_epochs=1).to_iter_dataset(data_lib.READ)
    ds = grain.experimental.FlatMapIterDataset(ds, split)
    batches = list(data_lib.pack_and_batch(ds, 64, local_batch=8, seed=3, drop_remainder=False))
    for batch in batches[:-1]:
        check_packed_batch(batch, 8, 64)
    seg = np.concatenate([b["segment_ids"] for b in batches])
    targets = np.concatenate([b["targets"] for b in batches])[seg != 0]
    np.testing.assert_array_equal(np.sort(targets), np.sort(np.concatenate(
        [np.append(doc, 2) for doc in docs])))


def _doc_starts(batch: dict) -> np.ndarray:
    """The first token of every document that begins in the batch (after its bos)."""
    tok, seg, pos = batch["tokens"], batch["segment_ids"], batch["positions"]
    rows, cols = np.nonzero((pos == 0) & (seg != 0) & (tok == 1))
    return tok[rows, cols + 1]  # a 1-token document is bos + token; its chunk has 2 tokens


def test_mixture_documents_follow_the_weights(cfg, datasets):
    data = mixture(datasets, cfg.cache_dir, ("a", 7.0), ("b", 3.0))  # normalised: 0.7 / 0.3
    it = data_lib.make_batches(data, TrainConfig(batch_size=8, seq_len=128, seed=1), VOCAB)
    batches = _take(it, 300)
    for batch in batches[:5]:
        check_packed_batch(batch, 8, 128)
    firsts = np.concatenate([_doc_starts(b) for b in batches])
    share_a = np.mean(firsts < A_TRAIN[1])
    print(f"\nmixture 0.7/0.3: {len(firsts)} documents, {share_a:.4f} from a")
    assert len(firsts) > 800 and abs(share_a - 0.7) < 0.02  # the interleave is exact; the packer
    assert ((firsts >= A_TRAIN[0]) & (firsts < B_TRAIN[1])).all()  # holds a few docs back
    again = _take(data_lib.make_batches(data, TrainConfig(batch_size=8, seq_len=128, seed=1),
                                        VOCAB), 3)
    assert all(_equal(x, y) for x, y in zip(batches, again))


def _first_chunks(batches: list[dict]) -> set[bytes]:
    """The first chunk (from bos) of every document that begins in the batches, as bytes."""
    out = set()
    for batch in batches:
        for tok, seg, pos in zip(batch["tokens"], batch["segment_ids"], batch["positions"]):
            out |= {tok[seg == s].tobytes() for s in np.unique(seg[(pos == 0) & (tok == 1)])}
    return out - {b""}


def test_arrayrecord_batches_hold_distinct_documents(cfg, datasets):
    data, tc = mixture(datasets, cfg.cache_dir, ("a", 1.0)), TrainConfig(batch_size=8, seq_len=512)
    first, again = (_take(data_lib.make_batches(data, tc, VOCAB), 8) for _ in range(2))
    assert all(_equal(a, b) for a, b in zip(first, again))  # every process reads the same batches
    starts = [doc for batch in first for doc in _first_chunks([batch])]
    assert len(starts) > 80 and len(set(starts)) == len(starts)  # no document twice in an epoch


def test_arrayrecord_eval_batches_come_from_the_val_splits(cfg, datasets):
    data = mixture(datasets, cfg.cache_dir, ("a", 1.0), ("b", 1.0))
    tc = TrainConfig(batch_size=4, seq_len=128, eval_every=5, eval_batches=6)
    first, again = (data_lib.make_eval_batches(data, tc, VOCAB) for _ in range(2))
    assert len(first) == 6 and all(_equal(a, b) for a, b in zip(first, again))
    tokens = np.concatenate([b["tokens"][b["segment_ids"] != 0] for b in first])
    body = tokens[tokens > 2]
    assert ((body >= A_VAL[0]) & (body < A_VAL[1]) | (body >= B_VAL[0])).all()
    assert (body < A_VAL[1]).any() and (body >= B_VAL[0]).any()
    empty = mixture(datasets, cfg.cache_dir, ("a", 1.0), ("c", 1.0))
    with pytest.raises(ConfigError, match="^data.mixture path .*/c: the val split is empty; set "
                       "train.eval_every=0"):
        data_lib.make_eval_batches(empty, tc, VOCAB)
    assert data_lib.make_eval_batches(empty, TrainConfig(eval_every=0), VOCAB) == []


def test_the_dry_run_refuses_an_empty_val_split_as_the_run_would(datasets, capsys, tmp_path):
    """Eval needs every dataset's val split: the dry run says so, not the run after compiling."""
    import launch

    data = ["data.source=arrayrecord", f"data.mixture=[{{path: {datasets['c']}, weight: 1}}]",
            f"run.dir={tmp_path / 'run'}", "model.vocab_size=8192", "--dry-run"]
    assert_refused(launch.main([*data, "train.eval_every=5"]), capsys.readouterr().err,
                   f"data.mixture path {datasets['c']}", "val split", "train.eval_every=0",
                   "--val-fraction")
    assert launch.main([*data, "train.eval_every=0"]) == 0


def test_dataset_checks_are_one_line_config_errors(cfg, datasets, tmp_path):
    ok = mixture(datasets, cfg.cache_dir, ("a", 0.5), ("b", 0.5))
    data_lib.check_dataset(ok, VOCAB)
    data_lib.check_dataset(dataclasses.replace(ok, tokenizer=datasets["model"]), VOCAB)
    assert prepared.dataset_tokenizer(ok, VOCAB).get_piece_size() == VOCAB
    old = tmp_path / "old"  # a manifest from before tokenizer.json: no "file", tokenizer.model
    write_dataset(old, {"train": [np.arange(5)], "val": []}, Path(datasets["model"]))
    meta = json.loads((old / "manifest.json").read_text())
    del meta["tokenizer"]["file"]
    (old / "manifest.json").write_text(json.dumps(meta))
    old_data = mixture({"old": str(old)}, cfg.cache_dir, ("old", 1.0))
    assert prepared.dataset_tokenizer(old_data, VOCAB).sha256 == meta["tokenizer"]["sha256"]
    bad_manifest = tmp_path / "bad"
    bad_manifest.mkdir()
    (bad_manifest / "manifest.json").write_text('{"format": "other"}')
    other = tmp_path / "other"
    write_dataset(other, {"train": [np.arange(5)], "val": []}, Path(datasets["model"]))
    (other / "tokenizer.model").write_bytes(b"another tokenizer")
    meta = json.loads((other / "manifest.json").read_text())
    meta["tokenizer"]["sha256"] = hashlib.sha256(b"another tokenizer").hexdigest()
    (other / "manifest.json").write_text(json.dumps(meta))
    stray = tmp_path / "stray.model"
    stray.write_bytes(b"x")
    damaged = {}  # a shard emptied, cut in half, or a manifest counting other shards
    for kind in ("emptied", "halved", "recounted"):
        damaged[kind] = tmp_path / kind
        write_dataset(damaged[kind], {"train": [np.arange(50)] * 40, "val": []},
                      Path(datasets["model"]), shards=1)
        (shard,) = damaged[kind].glob("train-*.arrayrecord")
        if kind != "recounted":
            os.truncate(shard, 0 if kind == "emptied" else shard.stat().st_size // 2)
        else:
            meta = json.loads((damaged[kind] / "manifest.json").read_text())
            meta["splits"]["train"]["documents"] += 1
            (damaged[kind] / "manifest.json").write_text(json.dumps(meta))
    cases = [
        (DataConfig(source="arrayrecord"), VOCAB, "^data.source=arrayrecord needs data.mixture"),
        (DataConfig(mixture=ok.mixture), VOCAB, "^data.mixture is set but data.source=stdlib"),
        (dataclasses.replace(ok, workers=-1), VOCAB, "^data.workers=-1 must be >= 0"),
        (mixture({"x": str(tmp_path / "nope")}, "", ("x", 1.0)), VOCAB,
         f"^data.mixture path {tmp_path / 'nope'}: cannot read .*manifest.json"),
        (mixture({"x": "no/such"}, "", ("x", 1.0)), VOCAB,  # relative: to the working directory
         f"^data.mixture path no/such: cannot read no/such/manifest.json in {re.escape(str(Path.cwd()))} "
         r"\(No such file or directory\)$"),
        (mixture({"x": str(bad_manifest)}, "", ("x", 1.0)), VOCAB,
         f"^data.mixture path {bad_manifest}: .* is not a jaxtron.tokens.v1 manifest"),
        (mixture(datasets, "", ("a", 1.0), ("b", 0.0)), VOCAB,
         "^data.mixture path .*/b: weight=0.0 must be a finite number above 0"),
        (mixture({"x": str(damaged["emptied"])}, "", ("x", 1.0)), VOCAB,
         f"^data.mixture path {damaged['emptied']}: shard train-00000-00000.arrayrecord cannot be "
         r"read, cut short or damaged \(.+\); " + re.escape(prepared.AGAIN) + "$"),
        (mixture({"x": str(damaged["halved"])}, "", ("x", 1.0)), VOCAB,
         f"^data.mixture path {damaged['halved']}: shard train-00000-00000.arrayrecord cannot be "
         r"read, cut short or damaged( \(.+\))?; " + re.escape(prepared.AGAIN) + "$"),
        (mixture({"x": str(damaged["recounted"])}, "", ("x", 1.0)), VOCAB,
         f"^data.mixture path {damaged['recounted']}: the train shards hold 40 documents, its "
         "manifest.json 41; " + re.escape(prepared.AGAIN) + "$"),
        (mixture({**datasets, "o": str(other)}, "", ("a", 1.0), ("o", 1.0)), VOCAB,
         f"^data.mixture path {other} was tokenized with another tokenizer than .*/a"),
        (dataclasses.replace(ok, tokenizer=str(stray)), VOCAB,
         f"^data.tokenizer={stray}: not a SentencePiece model$"),
        (dataclasses.replace(ok, tokenizer=str(tmp_path / "none.json")), VOCAB,
         f"^data.tokenizer={tmp_path / 'none.json'}: no such file or directory"),
        (ok, 1000, "^model.vocab_size=1000 is smaller than the datasets' tokenizer \\(8192"),
    ]
    for data, vocab, message in cases:
        with pytest.raises(ConfigError, match=message) as e:
            data_lib.check_dataset(data, vocab)
        assert "\n" not in str(e.value)


# ---------------------------------------------------------------- exact and inexact resume
@pytest.mark.parametrize("case", ["stdlib", "arrayrecord", "mixture", "mixture_workers2"])
def test_resume_is_exact(cfg, datasets, case):
    data = {"stdlib": cfg, "arrayrecord": mixture(datasets, cfg.cache_dir, ("b", 1.0)),
            "mixture": mixture(datasets, cfg.cache_dir, ("a", 0.6), ("b", 0.4))}[case.split("_")[0]]
    data = dataclasses.replace(data, workers=2 if case.endswith("workers2") else 0)
    tc = TrainConfig(batch_size=4, seq_len=64, seed=7)
    it = data_lib.make_batches(data, tc, VOCAB)
    _take(it, 7)
    state = json.loads(json.dumps(it.get_state()))  # as Grain's checkpoint handler stores it
    uninterrupted = _take(it, 50)
    resumed = data_lib.make_batches(data, tc, VOCAB)
    assert data_lib.restore_iterator(resumed, state) is True
    assert all(_equal(a, b) for a, b in zip(uninterrupted, _take(resumed, 50)))
    assert state["workers"] == data.workers
    if data.workers:  # a state from 2 workers restored into 0: said plainly, not bit-exact
        single = data_lib.make_batches(dataclasses.replace(data, workers=0), tc, VOCAB)
        with pytest.warns(data_lib.InexactResumeWarning,
                          match="^data: data.workers 2 -> 0 since the checkpoint"):
            assert data_lib.restore_iterator(single, state) is False
        next(single)
    for iterator in (it, resumed):
        iterator.close()


def test_inexact_resume_names_only_what_changed(cfg):
    """The warning leads with the changed field (config key, old -> new) and what that means for
    the batches, in one line; the fields that did not change are not named."""
    saved_with = TrainConfig(batch_size=4, seq_len=64, seed=7)
    it = data_lib.make_batches(cfg, saved_with, VOCAB)
    _take(it, 3)
    state = json.loads(json.dumps(it.get_state()))
    resumed = data_lib.make_batches(cfg, dataclasses.replace(saved_with, seq_len=128), VOCAB)
    with pytest.warns(data_lib.InexactResumeWarning) as caught:
        assert data_lib.restore_iterator(resumed, state) is False
    (message,) = [str(w.message) for w in caught]
    assert message.startswith("data: train.seq_len 64 -> 128 since the checkpoint: the input "
                              "cannot resume exactly, and the batches from here on differ"), message
    assert "\n" not in message
    for unchanged in ("workers", "batch_size", "seed", "source", "mixture"):
        assert unchanged not in message, message
    for iterator in (it, resumed):
        iterator.close()


def test_resume_with_another_process_count_is_exact(cfg, tmp_path):
    """Every process reads the same global batches, so a position saved by one process resumes
    exactly on any other process count: each gets the batches that would have come next."""
    tc = TrainConfig(batch_size=8, seq_len=128)
    it = data_lib.make_batches(cfg, tc, VOCAB)
    _take(it, 5)
    state = json.loads(json.dumps(it.get_state()))
    following = _take(it, 3)
    for _ in range(2):  # two processes' iterators, restored from the one saved position
        other = data_lib.make_batches(cfg, tc, VOCAB)
        assert data_lib.restore_iterator(other, state) is True
        assert all(_equal(a, b) for a, b in zip(following, _take(other, 3)))
    grain.checkpoint.CheckpointHandler().save(tmp_path, item=it)  # what a checkpoint holds
    assert data_lib.saved_iterator_state(tmp_path, 0, 1) == json.loads(json.dumps(it.get_state()))
    assert data_lib.saved_iterator_state(tmp_path, 1, 2) == json.loads(json.dumps(it.get_state()))


# ---------------------------------------------------------------- packing through the model
def test_packed_batch_logits_equal_each_document_alone(cfg, corpus):
    import jax
    from flax import nnx

    from jaxtron.model import Transformer, abstract_model

    model_cfg = ModelConfig(vocab_size=VOCAB, num_layers=2, d_model=32, num_heads=4,
                            num_kv_heads=2, mlp_dim=64, dtype="float32", param_dtype="float32")
    graphdef = nnx.graphdef(abstract_model(model_cfg))
    params = jax.jit(lambda: nnx.state(Transformer(model_cfg, nnx.Rngs(0))))()  # eager init: 8 s
    forward = jax.jit(lambda t, p, s: nnx.merge(graphdef, params)(t[None], p[None], s[None])[0])
    it = data_lib.make_batches(cfg, TrainConfig(batch_size=8, seq_len=256), VOCAB)
    batch = max(_take(it, 10), key=lambda b: b["segment_ids"].max(axis=1).sum())  # most packed
    tok, pos, seg = (batch[k] for k in ("tokens", "positions", "segment_ids"))
    checked = 0
    for row in np.argsort(-seg.max(axis=1))[:3]:  # the three rows with the most documents
        packed = np.asarray(forward(tok[row], pos[row], seg[row]))
        for s in np.unique(seg[row][seg[row] > 0]):
            mask = seg[row] == s
            n = mask.sum()  # the document alone at the start of a row, positions from 0
            alone = [np.pad(x, (0, 256 - n)) for x in (tok[row][mask], np.arange(n), np.ones(n))]
            single = np.asarray(forward(*(x.astype(np.int32) for x in alone)))
            np.testing.assert_allclose(packed[mask], single[:n], atol=1e-5, rtol=0)
            checked += 1
    assert checked >= 6, checked  # rows of several documents were compared


def test_resuming_on_data_of_another_tokenizer_is_refused(datasets, capsys, tmp_path):
    """The checkpoint's datasets and this run's were tokenized by different tokenizers: the
    token ids would mean other text, and training went on without a word."""
    import json

    import launch
    from jaxtron import config as config_lib

    other = tmp_path / "other"
    shutil.copytree(datasets["a"], other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"]["sha256"] = "0" * 64  # as if prepared with another tokenizer
    (other / "manifest.json").write_text(json.dumps(manifest))
    run_dir = tmp_path / "run"
    args = [f"run.dir={run_dir}", "data.source=arrayrecord", "model.vocab_size=8192",
            "train.eval_every=0"]
    saved = config_lib.load([launch.DEFAULT_CONFIG], [*args, f"data.mixture=[{{path: "
                                                              f"{datasets['a']}, weight: 1}}]"])
    step = run_dir / "checkpoints" / "3"  # what check_start reads of a checkpoint
    (step / "state").mkdir(parents=True)
    (step / "state" / "_METADATA").write_text("{}")
    (step / "meta").mkdir()
    (step / "meta" / "metadata").write_text(json.dumps({"step": 3,
                                                        "config": config_lib.to_yaml(saved)}))
    same = _dry_run(capsys, args, datasets["a"])
    assert same[0] == 0 and "start: resumes from" in same[1]
    assert _dry_run(capsys, args, other)[::2] == (2, (
        f"launch.py: error: data.mixture path {other} was tokenized by another tokenizer than "
        f"the checkpoint's data ({datasets['a']}), so its token ids mean other text; resume with "
        "data of that tokenizer, or start a new run.dir (checkpoint.restore=... with "
        "checkpoint.weights_only=true to fine-tune from it)\n"))


def _dry_run(capsys, args: list[str], dataset) -> tuple[int, str, str]:
    """launch.py --dry-run on one prepared dataset: its status, stdout and stderr."""
    import launch

    status = launch.main(["--dry-run", *args, f"data.mixture=[{{path: {dataset}}}]"])
    return (status, *capsys.readouterr())


def test_a_dataset_twice_in_a_mixture_is_refused(datasets, cfg):
    """The same dataset listed twice (once through a relative path) is one dataset of the two
    weights summed; listed twice, it was read as two."""
    twice = mixture(datasets, cfg.cache_dir, ("a", 1.0), ("b", 1.0))
    twice.mixture.append(DatasetEntry(datasets["a"] + "/./", 2.0))
    with pytest.raises(ConfigError, match=r"data.mixture lists .*/a twice \(.*/a and .*/a/\./\); "
                                          "give it once, with the two weights added"):
        prepared.check_dataset(twice, VOCAB)


@pytest.mark.parametrize("vocab_size,unused", [(VOCAB, None), (VOCAB + 64, None),
                                               (VOCAB + 100, 100), (2 * VOCAB, VOCAB)])
def test_a_vocabulary_far_above_the_tokenizers_is_a_warning(datasets, cfg, vocab_size, unused):
    """Rows of the embedding and the lm_head that no token id reaches: 1% or a pad to a multiple
    of 128 is fine, more is named with the size that fits."""
    model = ModelConfig(vocab_size=vocab_size, d_model=64)
    warning = prepared.unused_vocab(mixture(datasets, cfg.cache_dir, ("a", 1.0)), model)
    if unused is None:
        assert warning is None
    else:
        assert warning == (f"model.vocab_size={vocab_size} leaves {unused:,} rows that no token id "
                           f"reaches (the tokenizer has {VOCAB:,} pieces; {unused * 128:,} "
                           f"parameters unused): set model.vocab_size={VOCAB} (the next multiple "
                           "of 128)")


def test_a_resume_that_changes_data_source_compares_the_tokenizers(datasets, capsys, tmp_path):
    """A run trained on data.source=stdlib (its tokenizer trained at model.vocab_size) resumed
    on prepared datasets: allowed when they were tokenized by that same tokenizer, refused when
    by another (the source changed, and the ids were compared with nothing)."""
    import json

    import launch
    from jaxtron import config as config_lib

    other = tmp_path / "other"
    shutil.copytree(datasets["a"], other)
    manifest = json.loads((other / "manifest.json").read_text())
    manifest["tokenizer"]["sha256"] = "0" * 64
    (other / "manifest.json").write_text(json.dumps(manifest))
    run_dir = tmp_path / "run"
    args = [f"run.dir={run_dir}", "model.vocab_size=8192", "train.eval_every=0"]
    saved = config_lib.load([launch.DEFAULT_CONFIG], args)
    step = run_dir / "checkpoints" / "3"
    (step / "state").mkdir(parents=True)
    (step / "state" / "_METADATA").write_text("{}")
    (step / "meta").mkdir()
    (step / "meta" / "metadata").write_text(json.dumps({"step": 3,
                                                        "config": config_lib.to_yaml(saved)}))
    prepared_args = [*args, "data.source=arrayrecord"]
    same = launch.main(["--dry-run", *prepared_args, f"data.mixture=[{{path: {datasets['a']}}}]"])
    assert same == 0 and "start: resumes from" in capsys.readouterr().out
    assert launch.main(["--dry-run", *prepared_args, f"data.mixture=[{{path: {other}}}]"]) == 2
    assert capsys.readouterr().err.startswith(
        f"launch.py: error: data.mixture path {other} was tokenized by another tokenizer than "
        "the checkpoint's data (data.source=stdlib (its tokenizer trained at model.vocab_size)), "
        "so its token ids mean other text")
    # The same checkpoint as checkpoint.restore of a new run (fine-tuning): compared too (it was
    # not: training went on, the model reading other text under its ids).
    for weights_only in ("true", "false"):
        restore = [*prepared_args[1:], f"run.dir={tmp_path / 'tune'}", f"checkpoint.restore={run_dir}",
                   "data.source=arrayrecord", f"checkpoint.weights_only={weights_only}"]
        same = _dry_run(capsys, restore, datasets["a"])
        assert same[0] == 0 and f"start: from {step}" in same[1]
        assert _dry_run(capsys, restore, other)[::2] == (2, (
            f"launch.py: error: data.mixture path {other} was tokenized by another tokenizer than "
            f"checkpoint.restore={run_dir} was trained on (data.source=stdlib (its tokenizer "
            "trained at model.vocab_size)), so its token ids mean other text to that model; train "
            "on data of that tokenizer (jaxtron prepare-data --tokenizer with its file)\n"))
