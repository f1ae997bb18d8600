"""Each process builds only the rows of the global batch its devices hold (jaxtron/data/rows.py), and
those rows equal the global batch's, element for element, on every mesh and process count.

"Process p of P" is simulated here by taking the mesh's devices of that process as local (the
mesh laid out as on P hosts); the reference is the global batch as every process used to build
it: the chunks themselves packed (data.pack_and_batch), not their placeholders. One real run of
two launch.py processes checks the rows, the log line and the losses end to end.
"""

import dataclasses
import json
import time

import grain
import jax
import numpy as np
import pytest
from helpers import (
    MULTIPROCESS_OVERRIDES,
    MULTIPROCESS_RTOL,
    ROOT,
    metrics_rows,
    random_docs,
    start_processes,
    wait_processes,
    write_dataset,
)

from jaxtron import config, parallel
from jaxtron import data as data_lib
from jaxtron.config import DataConfig, DatasetEntry, MeshConfig, TrainConfig
from jaxtron.data import corpus as corpus_lib
from jaxtron.data import pipeline
from jaxtron.data import tokenizer as tokenizer_lib
from jaxtron.data.rows import local_rows
from jaxtron.train import loop as train_lib

VOCAB = 1024
KEYS = ("tokens", "targets", "segment_ids", "positions")
MESHES = {  # rows of a batch shard on one process, on several, or on all of them
    "data=8": MeshConfig(data=8, fsdp=1),
    "data=2 fsdp=4": MeshConfig(data=2, fsdp=4),
    "fsdp=2 tensor=4": MeshConfig(fsdp=2, tensor=4),
    "stage=2 data=4": MeshConfig(stage=2, data=4, fsdp=1),
    "stage=2 fsdp=2 tensor=2": MeshConfig(stage=2, fsdp=2, tensor=2),
}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict:
    """The stdlib tokenized by a small tokenizer (fast to train), and a mixture of two prepared
    datasets: a of short documents, b of long ones cut into many chunks."""
    tmp = tmp_path_factory.mktemp("per_host")
    start = time.perf_counter()
    texts = corpus_lib.read_texts(corpus_lib.stdlib_files()[:60])
    model = tmp / "tokenizer.model"
    model.write_bytes(tokenizer_lib.train_tokenizer(
        [line for text in texts for line in text.splitlines()], VOCAB))
    stdlib = DataConfig(tokenizer=str(model))
    corpus_lib.load_corpus(stdlib, tokenizer_lib.load_tokenizer(stdlib, VOCAB))  # cached
    a = write_dataset(tmp / "a", {"train": random_docs(0, 300, 300, 3, 500),
                                  "val": random_docs(1, 10, 300, 3, 500)}, model)
    b = write_dataset(tmp / "b", {"train": random_docs(2, 100, 1500, 500, VOCAB),
                                  "val": random_docs(3, 5, 1500, 500, VOCAB)}, model, "int32",
                      shards=3)
    mixture = DataConfig(source="arrayrecord", mixture=[DatasetEntry(a, 0.6), DatasetEntry(b, 0.4)])
    print(f"\nsources ready in {time.perf_counter() - start:.1f} s")
    return {"stdlib": stdlib, "mixture": mixture, "model": str(model)}


def reference(data: DataConfig, train: TrainConfig, start: int = 0) -> grain.DatasetIterator:
    """The global batches from item `start` on, packed from the chunks themselves."""
    stream = pipeline._stream(data, train.seq_len, VOCAB, train.seed)
    ds = stream.items[start:].to_iter_dataset(data_lib.READ)
    if stream.split is not None:
        ds = grain.experimental.FlatMapIterDataset(ds, stream.split)
    return iter(data_lib.pack_and_batch(ds, train.seq_len, train.batch_size, train.seed))


def process_rows(mesh_cfg: MeshConfig, processes: int, train: TrainConfig) -> list:
    """Each simulated process's rows: the mesh as on `processes` hosts of 8 / processes devices,
    the devices of host p taken as process p's."""
    devices, per_host = jax.devices(), 8 // processes
    mesh = parallel.make_mesh(mesh_cfg, devices, per_host=per_host)
    return [local_rows(mesh, train.batch_size, train.seq_len,
                       tuple(devices[p * per_host:(p + 1) * per_host])) for p in range(processes)]


def _take(it, n: int) -> list[dict]:
    return [next(it) for _ in range(n)]


def check_rows(data: DataConfig, train: TrainConfig, steps: int) -> dict:
    """On every mesh and process count, each process's batches are its rows of the reference;
    together they are the whole reference. Returns {(mesh, processes): rows per process}."""
    expected = _take(reference(data, train), steps)
    layouts = {}
    for name, mesh_cfg in MESHES.items():
        for processes in (1, 2, 4):
            parts = process_rows(mesh_cfg, processes, train)
            layouts[name, processes] = [len(rows) for rows in parts]
            whole = [{k: np.full_like(b[k], -1) for k in KEYS} for b in expected]
            for rows in parts:
                it = data_lib.make_batches(data, train, VOCAB, rows)
                for got, want, put in zip(_take(it, steps), expected, whole):
                    for k in KEYS:
                        np.testing.assert_array_equal(got[k], want[k][rows.indices], err_msg=k)
                        put[k][rows.indices] = got[k]
                it.close()
            for put, want in zip(whole, expected):
                for k in KEYS:
                    np.testing.assert_array_equal(put[k], want[k], err_msg=f"{name}: {k}")
    return layouts


def test_stdlib_rows_of_every_process_make_the_global_batch(sources):
    layouts = check_rows(sources["stdlib"], TrainConfig(batch_size=16, seq_len=64, seed=3), 3)
    assert layouts["data=2 fsdp=4", 2] == [8, 8]
    assert layouts["data=8", 2] == [8, 8]  # four data shards on each process
    assert layouts["stage=2 data=4", 4] == [4, 4, 4, 4]
    assert layouts["fsdp=2 tensor=4", 4] == [8, 8, 8, 8]  # two processes share each half
    assert layouts["stage=2 fsdp=2 tensor=2", 2] == [16, 16]  # a stage a process: every row


def test_mixture_rows_of_every_process_make_the_global_batch(sources):
    """Documents of up to 1,500 tokens, cut into chunks of 32 that land in many rows."""
    check_rows(sources["mixture"], TrainConfig(batch_size=8, seq_len=32, seed=5), 3)


@pytest.mark.parametrize("source, workers", [("stdlib", 0), ("mixture", 0), ("mixture", 2)])
def test_resume_on_another_process_count_is_exact(sources, source, workers):
    """A position saved by one process of a 1-process run resumes exactly in each process of a
    4-process run (rows shared or not), with packing and mixtures, also with Grain workers."""
    data = dataclasses.replace(sources[source], workers=workers)
    train = TrainConfig(batch_size=8, seq_len=32, seed=7)
    it = data_lib.make_batches(data, train, VOCAB)  # one process: every row
    _take(it, 5)
    state = json.loads(json.dumps(it.get_state()))  # as Grain's checkpoint handler stores it
    following = _take(it, 3)
    it.close()
    parts = process_rows(MeshConfig(fsdp=2, tensor=4), 4, train)
    for rows in parts[1:2] if workers else parts:  # workers start slowly: one process of four
        other = data_lib.make_batches(data, train, VOCAB, rows)
        assert data_lib.restore_iterator(other, state) is True
        for got, want in zip(_take(other, 3), following):
            for k in KEYS:
                np.testing.assert_array_equal(got[k], want[k][rows.indices], err_msg=k)
        assert other.get_state() == it.get_state()  # the same global position on every process
        other.close()


MESH = ["mesh.data=2", "mesh.fsdp=4", "train.batch_size=16", "model.num_layers=1",
        "model.d_model=64", "model.num_heads=2", "model.num_kv_heads=1", "model.mlp_dim=128",
        f"model.vocab_size={VOCAB}", "train.steps=2", "checkpoint.every=0"]


def test_two_processes_build_half_the_rows_and_train_as_one(sources, tmp_path, capsys):
    """2 processes x 4 devices, data=2 over the processes: each builds the 8 rows of its data
    shard (each says so in its log), and the losses and grad norms equal one process building
    all 16 over 8 devices."""
    logs = tmp_path / "logs"
    logs.mkdir()
    overrides = [*MESH, f"data.tokenizer={sources['model']}"]
    procs = start_processes(tmp_path / "run", logs, "rows", *overrides)
    try:
        codes = wait_processes(procs, timeout=300)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=60)
    out = [(logs / f"rows-{i}.txt").read_text() for i in range(2)]
    assert codes == [0, 0], out[0][-3000:]
    for text in out:
        assert "input: 8 of 16 rows per step" in text, text[-3000:]
    cfg = config.load([ROOT / "configs" / "tiny.yaml"],
                      [*MULTIPROCESS_OVERRIDES, *overrides, f"run.dir={tmp_path / 'reference'}"])
    reference_rows = train_lib.train(cfg)
    rows = metrics_rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2]
    for key in ("loss", "grad_norm"):
        np.testing.assert_allclose([r[key] for r in rows], [r[key] for r in reference_rows],
                                   rtol=MULTIPROCESS_RTOL)
    assert "input: 16 of 16 rows per step" in capsys.readouterr().out
