"""Tokenizers of both kinds behind jaxtron.data.tokenizer.Tokenizer: Hugging Face tokenizer.json files
built here with the `tokenizers` library in the Llama 3, Llama 2 and Qwen2 styles (byte-level BPE,
special tokens added after the learned vocabulary, as in those families), checked against
transformers' encoding; BOS/EOS per family; refusals; prepared datasets and trainer batches made
with them."""

import dataclasses
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import grain
import numpy as np
import pytest
from helpers import BPE_LEARNED, BPE_LINES, LLAMA3, STDLIB, build_bpe, ids_of
from transformers import PreTrainedTokenizerFast

from jaxtron import data as data_lib
from jaxtron.config import ConfigError, DataConfig, DatasetEntry, TrainConfig
from jaxtron.data import corpus as corpus_lib
from jaxtron.data import prepared
from jaxtron.data.tokenizer import from_path, load_tokenizer, train_tokenizer

ROOT = Path(__file__).resolve().parents[1]
UNICODE = "héllo — 世界 🐍 naïve\tcafé\r\n"
TEXTS = [UNICODE, (STDLIB / "textwrap.py").read_text(), "  x = 1\n\n\tif y:  pass  ", ""]

LLAMA2 = ["<unk>", "<s>", "</s>"]
QWEN2 = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@pytest.fixture(scope="module")
def llama3(tmp_path_factory) -> Path:
    return build_bpe(tmp_path_factory.mktemp("llama3"), LLAMA3, bos_template="<|begin_of_text|>")


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory) -> Path:
    return build_bpe(tmp_path_factory.mktemp("qwen2"), QWEN2,
                     {"bos_token": None, "eos_token": "<|endoftext|>"})


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sp") / "small.model"
    path.write_bytes(train_tokenizer(BPE_LINES + UNICODE.split("\n"), 400))
    return path


# ---------------------------------------------------------------- encoding
def test_tokenizer_json_encodes_as_transformers_without_special_tokens(llama3):
    tok = from_path(llama3)
    fast = PreTrainedTokenizerFast(tokenizer_file=str(llama3))
    bos, eos = ids_of(llama3, "<|begin_of_text|>", "<|end_of_text|>")
    assert (bos, eos) == (BPE_LEARNED, BPE_LEARNED + 1)
    assert (tok.bos_id(), tok.eos_id(), tok.get_piece_size()) == (bos, eos, BPE_LEARNED + 3)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == fast.encode(text, add_special_tokens=False)
        assert fast.encode(text) == [bos, *ids]  # the post-processor's BOS is left to the pipeline
        assert tok.decode(ids) == text and bos not in ids
    assert tok.encode_batch(TEXTS) == [tok.encode(t) for t in TEXTS]
    assert len(tok.encode(TEXTS[1])) < len(TEXTS[1].encode()) / 2  # BPE merges, not bytes
    assert tok.encode("a<|end_of_text|>b")[1] == eos  # special tokens in text, as transformers
    assert tok.decode(np.array([bos, *tok.encode("x")], np.int32)) == "<|begin_of_text|>x"
    assert (tok.piece_to_id("<|eot_id|>"), tok.piece_to_id("nope"), tok.id_to_piece(eos)) == (
        BPE_LEARNED + 2, None, "<|end_of_text|>")
    assert tok.file == "tokenizer.json" and tok.files == {"tokenizer.json": llama3.read_bytes()}
    assert tok.sha256 == hashlib.sha256(llama3.read_bytes()).hexdigest()


def test_sentencepiece_model_and_directories(sp_model, llama3, tmp_path):
    tok = from_path(sp_model)
    assert (tok.bos_id(), tok.eos_id(), tok.get_piece_size(), tok.file) == (1, 2, 400,
                                                                           "tokenizer.model")
    assert tok.files == {"tokenizer.model": sp_model.read_bytes()}
    assert all(tok.decode(tok.encode(t)) == t for t in TEXTS)
    assert tok.piece_to_id("\n") == tok.encode("\n")[0] and tok.piece_to_id("nope") is None
    both = tmp_path / "both"  # a Llama 2 model directory ships both: tokenizer.json is read
    build_bpe(both, LLAMA2, {"bos_token": "<s>", "eos_token": "</s>"})
    (both / "tokenizer.model").write_bytes(sp_model.read_bytes())
    assert from_path(both).file == "tokenizer.json"
    assert set(from_path(both).files) == {"tokenizer.json", "tokenizer_config.json"}
    only_sp = tmp_path / "sp"
    only_sp.mkdir()
    (only_sp / "tokenizer.model").write_bytes(sp_model.read_bytes())
    assert from_path(only_sp).sha256 == tok.sha256
    assert load_tokenizer(DataConfig(tokenizer=str(llama3.parent)), 0).sha256 == \
        from_path(llama3).sha256


# ---------------------------------------------------------------- BOS / EOS per family
@pytest.mark.parametrize("specials, config, bos, eos", [
    (LLAMA3, None, "<|begin_of_text|>", "<|end_of_text|>"),
    (LLAMA3, {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
     "<|begin_of_text|>", "<|end_of_text|>"),
    # Llama 3 instruct: the config's eos ends a chat turn; documents end with <|end_of_text|>
    (LLAMA3, {"bos_token": {"content": "<|begin_of_text|>", "special": True},
              "eos_token": "<|eot_id|>"}, "<|begin_of_text|>", "<|end_of_text|>"),
    (["<|begin_of_text|>", "<|eot_id|>"], {"eos_token": "<|eot_id|>"}, "<|begin_of_text|>",
     "<|eot_id|>"),  # no document end to prefer: the config's turn end it is
    (LLAMA2, None, "<s>", "</s>"),
    (LLAMA2, {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>"}, "<s>", "</s>"),
    (LLAMA2, {"add_bos_token": False, "bos_token": "<s>", "eos_token": "</s>"}, "</s>", "</s>"),
    (QWEN2, {"bos_token": None, "eos_token": "<|endoftext|>"}, "<|endoftext|>", "<|endoftext|>"),
    (QWEN2, {"bos_token": None, "eos_token": "<|im_end|>"}, "<|endoftext|>", "<|endoftext|>"),
    (QWEN2, None, "<|endoftext|>", "<|endoftext|>"),  # no BOS: EOS separates documents
    (["<pad>", "<eod>"], {"eos_token": "<eod>"}, "<eod>", "<eod>"),  # any token a config names
])
def test_bos_and_eos_follow_each_family(tmp_path, specials, config, bos, eos):
    path = build_bpe(tmp_path, specials, config)
    tok = from_path(path)
    assert (tok.bos_id(), tok.eos_id()) == tuple(ids_of(path, bos, eos))
    assert tok.eos_id() >= BPE_LEARNED  # a special token, not a learned piece


def _one_line_error(path, message: str) -> None:
    with pytest.raises(ConfigError, match=message) as e:
        from_path(path)
    assert "\n" not in str(e.value)


def test_refusals_are_one_line(tmp_path, sp_model):
    no_eos = build_bpe(tmp_path / "no_eos", ["<pad>", "<|begin_of_text|>"])
    _one_line_error(no_eos, f"^{no_eos}: no end-of-document token .* add a tokenizer_config.json "
                    "beside it whose eos_token names the token that ends a document$")
    wrong = build_bpe(tmp_path / "wrong", LLAMA2, {"eos_token": "<|endoftext|>"})
    _one_line_error(wrong, "names eos_token '<\\|endoftext\\|>', which is not in the vocabulary")
    wrong_bos = build_bpe(tmp_path / "wrong_bos", LLAMA2, {"bos_token": "<bos>"})
    _one_line_error(wrong_bos, "names bos_token '<bos>', which is not in the vocabulary")
    garbage = tmp_path / "garbage.json"
    garbage.write_text('{"model": 3}')
    _one_line_error(garbage, f"^{garbage}: not a Hugging Face tokenizer.json \\(")
    (tmp_path / "bad_config").mkdir()
    (tmp_path / "bad_config" / "tokenizer.json").write_bytes(no_eos.read_bytes())
    (tmp_path / "bad_config" / "tokenizer_config.json").write_text("{")
    _one_line_error(tmp_path / "bad_config", f"^{tmp_path / 'bad_config'} \\(tokenizer.json\\): "
                    "the tokenizer_config.json beside it is not JSON")
    bad_model = tmp_path / "bad.model"
    bad_model.write_bytes(b"not a model")
    _one_line_error(bad_model, f"^{bad_model}: not a SentencePiece model$")
    _one_line_error(tmp_path / "missing.json", "no such file or directory; give a SentencePiece")
    (tmp_path / "empty").mkdir()
    _one_line_error(tmp_path / "empty", "the directory holds no tokenizer.json or tokenizer.model")
    with pytest.raises(ConfigError, match=f"^data.tokenizer={no_eos}: no end-of-document token"):
        load_tokenizer(DataConfig(tokenizer=str(no_eos)), 10**6)


# ---------------------------------------------------------------- the trainer's batches
def check_segments(batches: list[dict], docs, bos: int, eos: int) -> tuple[int, int]:
    """Assert that packed segments (tokens and last target) are pieces of bos + doc + eos of
    `docs` (every one that starts with bos or ends with eos, and 16 others: a search is slow), and
    that bos and eos appear nowhere else; the segments that start with bos, and end with eos."""
    stream = np.concatenate([np.concatenate([[bos], doc, [eos]]) for doc in docs])
    stream = stream.astype(np.int32).tobytes()
    starts = ends = others = 0
    for batch in batches:
        for tokens, targets, seg in zip(batch["tokens"], batch["targets"], batch["segment_ids"]):
            for s in set(seg[seg > 0].tolist()):
                whole = np.append(tokens[seg == s], targets[seg == s][-1]).astype(np.int32)
                assert not np.isin(whole[1:-1], [bos, eos]).any()
                starts, ends = starts + (whole[0] == bos), ends + (whole[-1] == eos)
                others += whole[0] != bos and whole[-1] != eos
                if whole[0] == bos or whole[-1] == eos or others <= 16:
                    assert stream.find(whole.tobytes()) % 4 == 0
    return starts, ends


def test_stdlib_batches_put_bos_and_eos_around_documents(llama3, tmp_path):
    """data.source=stdlib with data.tokenizer=tokenizer.json (~5 s: it encodes the stdlib): every
    segment is a slice of some bos + document + eos, documents start with <|begin_of_text|> and end
    with <|end_of_text|>, and neither id appears anywhere else. Qwen2's convention (EOS first too)
    is checked on a prepared dataset below."""
    path = llama3
    data = DataConfig(tokenizer=str(path), cache_dir=str(tmp_path))
    tok = from_path(path)
    bos, eos = ids_of(path, *LLAMA3[:2])
    with pytest.raises(ConfigError, match=f"^model.vocab_size={BPE_LEARNED + 2} is smaller than "
                       f"the tokenizer's {BPE_LEARNED + 3} pieces; raise it$"):
        data_lib.make_batches(data, TrainConfig(), BPE_LEARNED + 2)
    it = data_lib.make_batches(data, TrainConfig(batch_size=16, seq_len=256, seed=3),
                               BPE_LEARNED + 3)
    batches = [next(it) for _ in range(20)]
    it.close()
    docs = corpus_lib.load_corpus(data, tok)
    assert len(docs) == len(corpus_lib.stdlib_files()) and len(docs.tokens) > 10**6
    assert docs[0].tolist() == tok.encode(corpus_lib.read_texts(corpus_lib.stdlib_files()[:1])[0])
    assert not np.isin(docs.tokens, [bos, eos]).any()
    starts, ends = check_segments(batches, docs, bos, eos)
    assert starts > 2 and ends > 2  # 5 and 6 of 321 segments (stdlib files are long)


# ---------------------------------------------------------------- prepared datasets
def run_prepare(*args) -> subprocess.CompletedProcess:
    """tools/prepare_data.py as users run it."""
    command = [sys.executable, str(ROOT / "tools" / "prepare_data.py"), *map(str, args)]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, check=False)


def _split(out: Path, split: str) -> list[list[int]]:
    """A prepared split's documents, read back with Grain's ArrayRecord source."""
    manifest = json.loads((out / "manifest.json").read_text())
    shards = [str(out / name) for name in manifest["splits"][split]["shards"]]
    source = grain.sources.ArrayRecordDataSource(shards) if shards else []
    return [np.frombuffer(source[i], manifest["dtype"]).tolist() for i in range(len(source))]


def test_prepared_dataset_with_a_tokenizer_json(tmp_path, qwen2, sp_model):
    docs = [line + "\n" + UNICODE for line in BPE_LINES[:300]]
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "ds"
    out.mkdir()
    (out / "tokenizer.model").write_bytes(sp_model.read_bytes())  # another kind's, left over
    done = run_prepare(tmp_path / "docs.jsonl", "--out", out, "--tokenizer", qwen2.parent,
                       "--val-fraction", 0.2, "--workers", 2, "--part-tokens", 2000)
    assert done.returncode == 0, done.stderr
    tok = from_path(qwen2)
    val = [prepared.is_val("docs.jsonl", i, 0.2) for i in range(len(docs))]
    assert _split(out, "val") == [tok.encode(d) for d, v in zip(docs, val) if v]
    assert _split(out, "train") == [tok.encode(d) for d, v in zip(docs, val) if not v]
    assert 30 < sum(val) < 90
    manifest = json.loads((out / "manifest.json").read_text())
    (eos,) = ids_of(qwen2, "<|endoftext|>")
    assert manifest["tokenizer"] == {"file": "tokenizer.json", "sha256": hashlib.sha256(
        qwen2.read_bytes()).hexdigest(), "vocab_size": BPE_LEARNED + 3, "bos_id": eos,
        "eos_id": eos}
    assert manifest["dtype"] == "uint16"
    assert sorted(p.name for p in out.glob("tokenizer*")) == ["tokenizer.json",
                                                             "tokenizer_config.json"]
    assert (out / "tokenizer_config.json").read_bytes() == \
        (qwen2.parent / "tokenizer_config.json").read_bytes()

    data = DataConfig(source="arrayrecord", mixture=[DatasetEntry(str(out), 1.0)],
                      cache_dir=str(tmp_path), tokenizer=str(qwen2))
    assert prepared.dataset_tokenizer(data, BPE_LEARNED + 3).sha256 == tok.sha256
    it = data_lib.make_batches(data, TrainConfig(batch_size=4, seq_len=64, seed=1), BPE_LEARNED + 3)
    batches = [next(it) for _ in range(3)]
    it.close()
    starts, ends = check_segments(batches, [np.array(d) for d in _split(out, "train")], eos, eos)
    assert starts > 5 and ends > 5

    same_ids = tmp_path / "qwen_bos"  # the same tokenizer.json, a config giving another BOS
    same_ids.mkdir()
    (same_ids / "tokenizer.json").write_bytes(qwen2.read_bytes())
    (same_ids / "tokenizer_config.json").write_text('{"bos_token": "<|im_start|>"}')
    for other in (sp_model, build_bpe(tmp_path / "l2", LLAMA2), same_ids):
        with pytest.raises(ConfigError, match=f"^data.tokenizer={other} is not the datasets' "
                           "tokenizer .*with its bos and eos"):
            data_lib.check_dataset(dataclasses.replace(data, tokenizer=str(other)), BPE_LEARNED + 3)
    twin = tmp_path / "twin"  # the same ids in another dataset, but documents start otherwise
    shutil.copytree(out, twin)
    manifest["tokenizer"]["bos_id"] = ids_of(qwen2, "<|im_start|>")[0]
    (twin / "manifest.json").write_text(json.dumps(manifest))
    both = dataclasses.replace(data, tokenizer="", mixture=[*data.mixture, DatasetEntry(str(twin),
                                                                                        1.0)])
    with pytest.raises(ConfigError, match=f"^data.mixture path {twin} was tokenized with another "
                       f"tokenizer than {out}"):
        data_lib.check_dataset(both, BPE_LEARNED + 3)
    with pytest.raises(ConfigError, match=f"^model.vocab_size={BPE_LEARNED} is smaller than the "
                       f"datasets' tokenizer \\({BPE_LEARNED + 3} pieces\\)"):
        data_lib.check_dataset(data, BPE_LEARNED)


def test_prepare_refuses_a_tokenizer_json_without_eos_in_one_line(tmp_path):
    no_eos = build_bpe(tmp_path / "no_eos", ["<pad>"])
    (tmp_path / "a.txt").write_text("some text")
    done = run_prepare(tmp_path / "a.txt", "--out", tmp_path / "ds", "--tokenizer", no_eos)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert done.stderr.startswith(f"prepare_data.py: error: --tokenizer {no_eos}: no "
                                  "end-of-document token")
    assert not (tmp_path / "ds").exists() or not any((tmp_path / "ds").iterdir())


def test_prompts_start_as_training_documents_with_one_bos(llama3, qwen2, sp_model):
    """Generation prompts are what training feeds a document's first tokens (data.chunk_dataset:
    BOS, then the text): for Llama 3 that is what transformers' tokenizer gives (its
    post-processor adds <|begin_of_text|>); Qwen2's starts with <|endoftext|>, the id its documents
    start with, which transformers does not add; SentencePiece puts its bos piece first. BOS comes
    once, also when the text starts with it written out (it gave two before a fix)."""
    text = "def f(x):\n    return x"
    for path in (llama3, qwen2, sp_model):
        tok = from_path(path)
        trained = data_lib.chunk_dataset([np.array(tok.encode(text))], 64, tok.bos_id(),
                                         tok.eos_id())[0]["tokens"]
        prompt = tok.encode_prompt(text)
        assert prompt == trained.tolist() and prompt.count(tok.bos_id()) == 1, path
        assert tok.encode_prompt("") == [tok.bos_id()]
    assert from_path(llama3).encode_prompt(text) == \
        PreTrainedTokenizerFast(tokenizer_file=str(llama3)).encode(text)
    assert from_path(llama3).encode_prompt(f"{LLAMA3[0]}{text}") == \
        from_path(llama3).encode_prompt(text)
    qwen = from_path(qwen2)
    assert qwen.encode_prompt(text) == [*ids_of(qwen2, "<|endoftext|>"), *qwen.encode(text)]
    assert from_path(sp_model).encode_prompt(text)[0] == 1  # the trainer's bos_id


@pytest.mark.parametrize("specials, config, ends", [
    (LLAMA3, None, ["<|end_of_text|>"]),
    (LLAMA3, {"eos_token": "<|eot_id|>"}, ["<|end_of_text|>", "<|eot_id|>"]),  # instruct
    (QWEN2, {"eos_token": "<|endoftext|>"}, ["<|endoftext|>"]),
    (QWEN2, {"eos_token": {"content": "<|im_end|>"}}, ["<|endoftext|>", "<|im_end|>"]),
    (["<|begin_of_text|>", "<|eot_id|>"], {"eos_token": "<|eot_id|>"}, ["<|eot_id|>"]),
])
def test_a_continuation_ends_at_the_document_end_or_the_configs_turn_end(tmp_path, specials,
                                                                        config, ends):
    """end_ids: the ids generation stops at, as an export's generation_config.json lists them."""
    path = build_bpe(tmp_path, specials, config)
    assert from_path(path).end_ids() == ids_of(path, *ends)


def test_decode_skips_special_tokens_when_asked(llama3, sp_model):
    """A continuation's text leaves out its end token, as transformers' skip_special_tokens."""
    tok = from_path(llama3)
    bos, eos = ids_of(llama3, "<|begin_of_text|>", "<|end_of_text|>")
    ids = [bos, *tok.encode("x = 1"), eos]
    assert tok.decode(ids) == "<|begin_of_text|>x = 1<|end_of_text|>"
    assert tok.decode(ids, skip_special=True) == "x = 1"
    sp = from_path(sp_model)
    assert sp.decode([1, *sp.encode("x = 1"), 2], skip_special=True) == "x = 1"
    assert sp.end_ids() == [2]
