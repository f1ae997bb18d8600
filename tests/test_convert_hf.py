"""tools/convert_hf.py on real directories: Hugging Face -> jaxtron -> Hugging Face is exact for every
family and dtype; a pipeline-trained run exports to transformers with matching logits and imports
back to fine-tune on another mesh; pickles, missing, extra and misshapen tensors are refused."""

import dataclasses
import importlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import pytest
import torch
from helpers import (
    HF_CASES,
    HF_TOL,
    LLAMA3,
    LLAMA3_ROPE,
    assert_refused,
    build_bpe,
    hf_case,
    hf_inputs,
    hf_logits,
    ids_of,
)
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GenerationConfig,
    MixtralConfig,
    MixtralForCausalLM,
)

import launch
from jaxtron import checkpoint, hf, parallel
from jaxtron.checkpoint import weights
from jaxtron.config import ConfigError, MeshConfig, PipelineConfig
from jaxtron.data import prepared
from jaxtron.data import tokenizer as tokenizer_lib
from jaxtron.hf import tensorfile
from jaxtron.model import generate
from jaxtron.step import state as state_lib
from jaxtron.step.optim import make_optimizer

ROOT = Path(__file__).resolve().parent.parent

from jaxtron.commands import convert_hf

RUN = ["train.seq_len=64", "train.batch_size=8", "train.eval_every=0", "run.tensorboard=false",
       "run.progress=lines"]


def _convert(*args) -> int:
    try:
        return convert_hf.main([str(a) for a in args])
    except SystemExit as e:
        return e.code


def _save(name: str, path: Path, dtype=torch.float32, **kwargs) -> torch.nn.Module:
    """The tiny random model of HF_CASES[name], saved by transformers (sharded by default)."""
    model = hf_case(name)[0]
    copy = AutoModelForCausalLM.from_config(model.config).eval()
    copy.load_state_dict(model.state_dict())
    copy.to(dtype).save_pretrained(path, **{"max_shard_size": "100KB", **kwargs})
    return copy


def _assert_same_tensors(a: Path, b: Path) -> None:
    left, right = hf.read_tensors(a), hf.read_tensors(b)
    left.pop("lm_head.weight", None) if "lm_head.weight" not in right else None
    assert sorted(left) == sorted(right)
    for name in left:
        assert left[name].dtype == right[name].dtype, name
        np.testing.assert_array_equal(left[name], right[name], err_msg=name)


@pytest.mark.parametrize("name", list(HF_CASES))
def test_import_then_export_gives_the_same_tensors_and_logits(tmp_path, name):
    """float32, sharded with an index: the exported directory has the original's exact tensors,
    loads in transformers with nothing missing or unexpected, and gives the original's logits."""
    original = _save(name, tmp_path / "hf")
    assert _convert("import", tmp_path / "hf", tmp_path / "imp") == 0
    assert (tmp_path / "imp" / "config.yaml").is_file()
    assert _convert("export", tmp_path / "imp", tmp_path / "out") == 0
    _assert_same_tensors(tmp_path / "hf", tmp_path / "out")
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(back).__name__ == type(original).__name__
    tokens, positions, _ = hf_inputs(HF_CASES[name][2])
    assert np.abs(hf_logits(back.eval(), tokens, positions)
                  - hf_logits(original, tokens, positions)).max() < HF_TOL


def test_bfloat16_weights_go_through_bit_exact(tmp_path):
    """Published checkpoints are bfloat16 (no numpy type): read and written without a float32
    detour, bit for bit, in one unsharded file."""
    _save("qwen2", tmp_path / "hf", torch.bfloat16, max_shard_size="1GB")
    assert _convert("import", tmp_path / "hf", tmp_path / "imp", "--dtype", "bfloat16") == 0
    assert _convert("export", tmp_path / "imp", tmp_path / "out") == 0
    assert not (tmp_path / "out" / hf.INDEX).exists()
    _assert_same_tensors(tmp_path / "hf", tmp_path / "out")
    assert hf.read_tensors(tmp_path / "out")["model.norm.weight"].dtype == ml_dtypes.bfloat16
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16" and config["architectures"] == ["Qwen2ForCausalLM"]


def test_tensorfile_reads_what_safetensors_writes_and_back(tmp_path):
    from safetensors.torch import load_file, save_file

    ref = {"a": torch.randn(3, 5, dtype=torch.bfloat16), "b": torch.arange(7, dtype=torch.int64),
           "c": torch.randn(2, 2, 2)}
    save_file(ref, tmp_path / "ref.safetensors")
    entries, start = tensorfile.header(tmp_path / "ref.safetensors")
    ours = {k: tensorfile.read(tmp_path / "ref.safetensors", k, entries, start) for k in ref}
    np.testing.assert_array_equal(ours["a"].view(np.int16), ref["a"].view(torch.int16).numpy())
    specs = {k: (v.shape, v.dtype) for k, v in ours.items()}
    tensorfile.write(tmp_path / "ours.safetensors", list(ref), specs, ours.__getitem__)
    back = load_file(tmp_path / "ours.safetensors")
    assert all(torch.equal(back[k], ref[k]) for k in ref)


@pytest.fixture(scope="module")
def pipeline_run(tmp_path_factory):
    """Two steps of a 4-layer model on a circular pipeline: its checkpoint stores the layers in
    the order 0, 2, 1, 3."""
    run_dir = tmp_path_factory.mktemp("pipe") / "run"
    rc = launch.main([*RUN, "model.num_layers=4", "mesh.stage=2", "mesh.fsdp=4", "train.steps=2",
                      "pipeline.schedule=circular", "pipeline.repeats=2", "train.microbatches=2",
                      f"run.dir={run_dir}"])
    assert rc == 0
    return run_dir


def test_read_params_puts_layers_in_the_order_the_trainer_restores_them(pipeline_run):
    """weights.read_params (one layer at a time, TensorStore) against the trainer's own restore
    and layer permutation onto a mesh without stages."""
    cfg, params = weights.read_params(pipeline_run)
    assert weights.read_meta(weights.locate(pipeline_run)[1])["layer_order"] == [0, 2, 1, 3]
    one = dataclasses.replace(cfg, mesh=MeshConfig(fsdp=1), pipeline=PipelineConfig(),
                              train=dataclasses.replace(cfg.train, microbatches=1))
    tx = make_optimizer(one)
    plan = state_lib.make_plan(one, tx, 1)  # one device, one stage: layers in model order
    mesh = parallel.make_mesh(one.mesh, jax.devices()[:1])
    shardings = parallel.named(plan.specs, mesh)
    restored, meta = checkpoint.restore_from(str(pipeline_run), plan.abstract, shardings, None,
                                             weights_only=True, model=one.model)
    restored = state_lib.in_layer_order(restored, meta, plan, tx, shardings, print)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(restored["params"])):
        np.testing.assert_array_equal(got, np.asarray(want))


def test_generate_reads_a_pipeline_run_in_model_order(pipeline_run):
    """tools/generate.py on a training run (stacked layers in pipeline order): the ids equal
    jaxtron.model.generate on the params read back in model order (reading the layers in storage
    order would change them)."""
    from jaxtron.model import generate

    cfg, params = weights.read_params(pipeline_run)
    want = generate.generate(cfg.model, params, [1, 40, 41, 42], 6, eos_id=2)  # the run's eos
    order = weights.read_meta(weights.locate(pipeline_run)[1])["layer_order"]
    stored = jax.tree_util.tree_map_with_path(
        lambda p, x: x[np.asarray(order)] if p[0].key == "layers" else x, params)
    assert generate.generate(cfg.model, stored, [1, 40, 41, 42], 6) != want
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "generate.py"), str(pipeline_run),
                           "--tokens", "1,40,41,42", "--max-new-tokens", "6"], check=False,
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert [int(i) for i in proc.stdout.strip().split(",")] == want


def test_a_pipeline_run_exports_to_transformers_and_fine_tunes_back_on_another_mesh(
        pipeline_run, tmp_path):
    cfg, params = weights.read_params(pipeline_run)
    assert _convert("export", pipeline_run, tmp_path / "hf") == 0
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 32))
    theirs = hf_logits(model.eval(), tokens, np.tile(np.arange(32), (2, 1)))
    assert np.abs(hf.logits(cfg.model, params, tokens) - theirs).max() < HF_TOL
    run_tokenizer = prepared.dataset_tokenizer(cfg.data, cfg.model.vocab_size)
    assert tokenizer_lib.from_path(tmp_path / "hf").sha256 == run_tokenizer.sha256

    imp, tuned = tmp_path / "imp", tmp_path / "tuned"
    assert _convert("import", tmp_path / "hf", imp, "--compute-dtype", "float32") == 0
    # lr 0 for one step: the fine-tuning run starts from exactly the exported weights ...
    args = ["--config", str(imp / "config.yaml"), *RUN, "mesh.tensor=2", "mesh.fsdp=2",
            "mesh.data=2", "optim.lr=0"]
    assert launch.main([*args, "train.steps=1", f"run.dir={tuned}"]) == 0
    _, start = weights.read_params(tuned)
    for got, want in zip(jax.tree.leaves(start), jax.tree.leaves(params)):
        np.testing.assert_array_equal(got, want)
    # ... and with a learning rate it trains: the loss falls over a few steps.
    assert launch.main([*args[:-1], "train.steps=6", "train.log_every=1", "optim.lr=3e-3",
                        "optim.warmup_steps=1", f"run.dir={tmp_path / 'tuned2'}"]) == 0
    rows = [json.loads(r) for r in (tmp_path / "tuned2" / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.1, rows


def test_export_states_the_context_the_run_trained_at(pipeline_run, tmp_path, capsys):
    """config.json's max_position_embeddings is the run's train.seq_len (it said 8192 for a model
    trained at 64), so importing it back fine-tunes at 64 tokens, not 2048 (~18.7 GiB for the
    tiny model). The default corpus's SentencePiece ids come with it: bos 1, eos 2, no pad."""
    assert _convert("export", pipeline_run, tmp_path / "hf") == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["max_position_embeddings"] == 64 and "pad_token_id" not in config
    assert (config["bos_token_id"], config["eos_token_id"]) == (tokenizer_lib.BOS_ID,
                                                                tokenizer_lib.EOS_ID)
    assert _convert("import", tmp_path / "hf", tmp_path / "imp") == 0
    assert "preset: model.dtype=float32, train.seq_len=64;" in capsys.readouterr().out
    preset = weights.config_of({"config": (tmp_path / "imp" / "config.yaml").read_text()})
    assert preset.train.seq_len == 64
    assert _convert("export", tmp_path / "imp", tmp_path / "hf2") == 0  # and back: still 64
    assert json.loads((tmp_path / "hf2" / "config.json").read_text())[
        "max_position_embeddings"] == 64


def test_an_import_restores_only_as_weights(tmp_path):
    _save("llama2", tmp_path / "hf")
    assert _convert("import", tmp_path / "hf", tmp_path / "imp") == 0
    with pytest.raises(ConfigError, match="holds imported weights only .*add checkpoint.weights_only=true$"):
        checkpoint.restore_from(str(tmp_path / "imp"), {}, {}, None, weights_only=False,
                                model=hf.read_config(tmp_path / "hf"))


def _one_line(capsys, status: int, *args) -> str:
    capsys.readouterr()  # what came before (transformers' progress bars) is not the tool's
    rc = _convert(*args)
    err = capsys.readouterr().err
    assert rc == status and len(err.strip().splitlines()) == 1, err
    return err


def test_importing_a_jaxtron_run_says_to_export_it(pipeline_run, tmp_path, capsys):
    """A run, its checkpoints directory or one checkpoint given to import said only that it has
    no config.json."""
    (step,) = weights.run_checkpoints(pipeline_run)[-1:]
    for source in (pipeline_run, pipeline_run / "checkpoints", step):
        err = _one_line(capsys, 2, "import", source, tmp_path / "out")
        assert_refused(2, err, str(source), f"jaxtron convert-hf export {source} OUT")
    assert not (tmp_path / "out").exists()


def test_pickled_weights_need_allow_pickle(tmp_path, capsys):
    model = hf_case("llama3")[0]
    model.config.save_pretrained(tmp_path / "hf")
    torch.save(model.state_dict(), tmp_path / "hf" / "pytorch_model.bin")  # the older layout
    err = _one_line(capsys, 2, "import", tmp_path / "hf", tmp_path / "imp")
    assert "pytorch_model.bin" in err and "--allow-pickle" in err
    assert not (tmp_path / "imp").exists()
    assert _convert("import", tmp_path / "hf", tmp_path / "imp", "--allow-pickle") == 0
    _save("llama3", tmp_path / "safe")
    assert _convert("import", tmp_path / "safe", tmp_path / "imp2") == 0
    a, b = weights.read_params(tmp_path / "imp")[1], weights.read_params(tmp_path / "imp2")[1]
    assert all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def _edit_tensors(src: Path, dst: Path, edit) -> None:
    """A copy of the HF directory `src` whose tensors are `edit(dict)`, in one file."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors", hf.INDEX))
    tensors = edit(hf.read_tensors(src))
    specs = {k: (v.shape, v.dtype) for k, v in tensors.items()}
    tensorfile.write(dst / "model.safetensors", list(tensors), specs, tensors.__getitem__)


@pytest.mark.parametrize("defect,message", [
    ("missing", "lacks 1 tensors the config needs: model.layers.1.mlp.up_proj.weight"),
    ("extra", "no place in the model .*: model.layers.0.mlp.extra.weight"),
    ("shape", "model.layers.0.mlp.up_proj.weight gives layers/mlp/w_up shape"),
    ("architecture", "model_type 'gpt2' is not supported"),
    ("not_empty", "already exists and is not empty"),
    ("untied", "an lm_head.weight other than its embedding, but its config ties them "
               r"\(tie_word_embeddings\); set tie_word_embeddings to false in config.json"),
    ("eos", "generation_config.json: not valid JSON"),  # the end ids the import keeps
])
def test_bad_directories_are_refused_in_one_line(tmp_path, capsys, defect, message):
    _save("llama2", tmp_path / "hf")
    bad, out = tmp_path / "bad", tmp_path / "imp"
    if defect == "missing":
        _edit_tensors(tmp_path / "hf", bad, lambda t: {k: v for k, v in t.items()
                                                       if k != "model.layers.1.mlp.up_proj.weight"})
    elif defect == "extra":
        _edit_tensors(tmp_path / "hf", bad, lambda t: {**t, "model.layers.0.mlp.extra.weight":
                                                       np.zeros(3, np.float32)})
    elif defect == "shape":
        _edit_tensors(tmp_path / "hf", bad, lambda t: {**t, "model.layers.0.mlp.up_proj.weight":
                                                       np.zeros((64, 64), np.float32)})
    elif defect == "untied":  # the message named model.tie_embeddings, which import has not
        _edit_tensors(tmp_path / "hf", bad, lambda t: t)
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    else:
        shutil.copytree(tmp_path / "hf", bad)
    if defect == "architecture":
        config = json.loads((bad / "config.json").read_text())
        (bad / "config.json").write_text(json.dumps({**config, "model_type": "gpt2"}))
    if defect == "eos":
        (bad / hf.GENERATION).write_text('{"eos_token_id": [2, ')
    if defect == "not_empty":
        out.mkdir()
        (out / "notes.txt").write_text("keep me")
    err = _one_line(capsys, 2, "import", bad, out)
    assert re.search(message, err), err
    if defect == "not_empty":
        assert [p.name for p in out.iterdir()] == ["notes.txt"]
    else:
        assert not out.exists()


@pytest.mark.parametrize("damage, message", [
    ("cut", "{f} is truncated ({n} of {m} bytes the header promises); download it again"),
    ("cut_header", "{f} is truncated (20 bytes, shorter than its {h}-byte header); download it "
     "again"),
    ("not_json", "{f} is not a safetensors file (unreadable header)"),
    ("short", "{f} is not a safetensors file (too short)"),
])
def test_a_damaged_safetensors_file_is_one_line(tmp_path, capsys, damage, message):
    """An interrupted download (the file shorter than its header promises), a header that is not
    JSON, a file of 3 bytes: one line naming the file, before any tensor is memory-mapped."""
    _save("llama2", tmp_path / "hf", max_shard_size="10GB")
    f = tmp_path / "hf" / "model.safetensors"
    data = f.read_bytes()
    h = 8 + int.from_bytes(data[:8], "little")
    f.write_bytes({"cut": data[:-1000], "cut_header": data[:20], "short": data[:3],
                   "not_json": data[:8] + b"{" * (h - 8) + data[h:]}[damage])
    err = _one_line(capsys, 2, "import", tmp_path / "hf", tmp_path / "imp")
    assert err == "convert_hf.py: error: " + message.format(f=f, n=len(data) - 1000, m=len(data),
                                                             h=h) + "\n"
    assert not (tmp_path / "imp").exists()


@pytest.mark.parametrize("damage, message", [
    ("cut", "{i} is not valid JSON (Expecting "),
    ("no_map", "{i} has no weight_map naming each tensor's shard file; download it again, or "
     "remove it to read every *.safetensors file of the directory"),
    ("list", "{i} has no weight_map naming each tensor's shard file"),
    ("absent", "{i} names model-00009-of-00009.safetensors, which is not in {d}; the download "
     "is incomplete"),
])
def test_a_damaged_index_is_one_line_naming_it(tmp_path, capsys, damage, message):
    """model.safetensors.index.json cut short by a download, without its weight_map, or naming a
    shard that is not there: one line naming the index (a JSONDecodeError or KeyError traceback
    before), and nothing written."""
    _save("llama2", tmp_path / "hf")
    index = tmp_path / "hf" / hf.INDEX
    text = index.read_text()
    weight_map = json.loads(text)["weight_map"]
    index.write_text({"cut": text[:len(text) // 2],
                      "no_map": json.dumps({"metadata": {}}),
                      "list": json.dumps({"weight_map": list(weight_map)}),
                      "absent": json.dumps({"weight_map": {
                          **weight_map, "x": "model-00009-of-00009.safetensors"}})}[damage])
    err = _one_line(capsys, 2, "import", tmp_path / "hf", tmp_path / "imp")
    assert err.startswith("convert_hf.py: error: " + message.format(i=index, d=tmp_path / "hf"))
    assert not (tmp_path / "imp").exists()


def test_a_llama3_import_fine_tunes_with_its_tokenizer_json(tmp_path):
    """The Hub's tokenizer format travels with the weights: import copies tokenizer.json and its
    config, the preset points data.tokenizer at them, and training on text starts each document
    with <|begin_of_text|>."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE,
                         max_position_embeddings=131072)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    build_bpe(tmp_path / "hf", LLAMA3, {"bos_token": "<|begin_of_text|>",
                                        "eos_token": "<|eot_id|>"})
    # the document end, then the instruct config's turn end, as Llama 3 instruct lists them
    ends = ids_of(tmp_path / "hf" / "tokenizer.json", "<|end_of_text|>", "<|eot_id|>")
    _set_eos(tmp_path / "hf", ends)  # not LlamaConfig's default 2
    assert _convert("import", tmp_path / "hf", tmp_path / "imp", "--compute-dtype",
                    "float32") == 0
    assert {p.name for p in (tmp_path / "imp").glob("tokenizer*")} == {
        "tokenizer.json", "tokenizer_config.json"}
    preset = weights.config_of({"config": (tmp_path / "imp" / "config.yaml").read_text()})
    assert Path(preset.data.tokenizer) == (tmp_path / "imp" / "tokenizer.json").absolute()
    tok = tokenizer_lib.from_path(preset.data.tokenizer)
    assert (tok.bos_id(), tok.eos_id()) == tuple(ids_of(tmp_path / "hf" / "tokenizer.json",
                                                        "<|begin_of_text|>", "<|end_of_text|>"))
    assert launch.main(["--config", str(tmp_path / "imp" / "config.yaml"), *RUN,
                        "train.steps=2", f"run.dir={tmp_path / 'run'}"]) == 0
    assert _convert("export", tmp_path / "run", tmp_path / "out") == 0
    assert tokenizer_lib.from_path(tmp_path / "out").sha256 == tok.sha256
    generation = GenerationConfig.from_pretrained(tmp_path / "out")
    assert (generation.bos_token_id, generation.eos_token_id) == (tok.bos_id(), ends)
    # fine-tuned at 64 tokens, it is still the 131,072-token model it was imported as
    assert json.loads((tmp_path / "out" / "config.json").read_text())[
        "max_position_embeddings"] == 131072


def _set_eos(folder: Path, ids) -> None:
    """eos_token_id `ids` (an id, a list or None) in the HF directory's config.json and
    generation_config.json."""
    for name in ("config.json", hf.GENERATION):
        config = json.loads((folder / name).read_text())
        (folder / name).write_text(json.dumps({**config, "eos_token_id": ids}))


def _first_last_tokenizer(folder: Path, vocab: int) -> None:
    """A word-level tokenizer.json whose <s> is 0, </s> 1 and <pad> the last id (transformers'
    defaults are bos 1 and eos 2), named so by a tokenizer_config.json; w2, w3, ... between."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<s>": 0, "</s>": 1} | {f"w{i}": i for i in range(2, vocab - 1)} | {"<pad>": vocab - 1}
    tok = Tokenizer(models.WordLevel(words, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}))


def test_an_export_carries_the_tokenizers_ids_and_generation_stops_at_its_eos(tmp_path, capsys):
    """A tokenizer with bos 0, eos 1: config.json and generation_config.json carry its ids, so
    transformers' generate() and tools/generate.py --tokens on the export stop where the model
    produces 1. Without them transformers took bos 1 and eos 2, and both ran to max_new_tokens.
    The tiny model is made to produce eos after a few tokens by swapping the embedding and
    lm_head rows of id 1 and of the token its greedy continuation gives fifth (27 of
    [53, 4, 22, 36, 27, 35, ...]): the same model with the two ids' names exchanged."""
    _tiny_llama(tmp_path / "src")
    prompt, new = [10, 20, 30], 16
    free = generate.generate(*hf.from_pretrained(tmp_path / "src"), prompt, new)
    swapped = free[4]
    assert swapped not in (0, 1, 2, 63) and not {1, swapped} & set(free[:4] + prompt), free
    rows = np.arange(64)
    rows[[1, swapped]] = rows[[swapped, 1]]
    _edit_tensors(tmp_path / "src", tmp_path / "hf", lambda t: {
        **t, **{k: t[k][rows] for k in ("model.embed_tokens.weight", "lm_head.weight")}})
    _first_last_tokenizer(tmp_path / "hf", 64)
    _set_eos(tmp_path / "hf", None)  # LlamaConfig's default 2 is not this tokenizer's
    assert _convert("import", tmp_path / "hf", tmp_path / "imp") == 0  # copies the tokenizer
    assert _convert("export", tmp_path / "imp", tmp_path / "out") == 0  # the run's tokenizer

    ids = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 63}
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert {k: config.get(k) for k in ids} == ids
    written = json.loads((tmp_path / "out" / hf.GENERATION).read_text())
    assert {k: written.get(k) for k in ids} == ids
    generation = GenerationConfig.from_pretrained(tmp_path / "out")
    assert {k: getattr(generation, k) for k in ids} == ids

    want = free[:4] + [1]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    assert theirs[0, len(prompt):].tolist() == want
    tool = importlib.import_module("jaxtron.commands.generate")
    capsys.readouterr()
    assert tool.main([str(tmp_path / "out"), "--tokens", ",".join(map(str, prompt)),
                      "--max-new-tokens", str(new)]) == 0
    assert capsys.readouterr().out.strip() == ",".join(map(str, want))


def _llama2_words(folder: Path, vocab: int) -> None:
    """A word-level tokenizer.json with Llama 2's <unk> 0, <s> 1 and </s> 2, named so by a
    tokenizer_config.json, and the words w3, w4, ... after them."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"w{i}": i for i in range(3, vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}))


def test_an_imports_own_end_ids_stop_generation_and_are_exported(tmp_path, capsys):
    """The source's generation_config.json lists an end id that no tokenizer file names, as
    Llama 3.1 instruct's lists <|eom_id|> beside the tokenizer's <|end_of_text|> and <|eot_id|>.
    The import keeps it in its meta: generate --tokens stops there on the import and on a run
    fine-tuned from it (lr 0: the same weights), as on the source directory, and the run's
    export lists it after the tokenizer's eos. Generate stopped only at the tokenizer's eos 2
    and ran on, and the export left the id out. The extra id is the one the free greedy
    continuation reaches first after two tokens."""
    _tiny_llama(tmp_path / "hf")
    prompt, new = [10, 20, 30], 12
    free = generate.generate(*hf.from_pretrained(tmp_path / "hf"), prompt, new)
    stop = next(k for k in range(2, new) if free[k] > 2 and free[k] not in free[:k])
    extra = free[stop]
    assert stop < new - 1 and 2 not in free[:stop + 1], free
    generation = json.loads((tmp_path / "hf" / hf.GENERATION).read_text())
    (tmp_path / "hf" / hf.GENERATION).write_text(json.dumps(
        {**generation, "eos_token_id": [2, extra]}))
    _llama2_words(tmp_path / "hf", 64)
    assert _convert("import", tmp_path / "hf", tmp_path / "imp", "--compute-dtype",
                    "float32") == 0
    assert weights.read_meta(weights.locate(tmp_path / "imp")[1])["hf_eos_token_id"] == [2, extra]
    assert launch.main(["--config", str(tmp_path / "imp" / "config.yaml"), *RUN, "optim.lr=0",
                        "train.steps=1", f"run.dir={tmp_path / 'run'}"]) == 0
    tool = importlib.import_module("jaxtron.commands.generate")
    capsys.readouterr()
    for where in ("hf", "imp", "run"):
        assert tool.main([str(tmp_path / where), "--tokens", ",".join(map(str, prompt)),
                          "--max-new-tokens", str(new)]) == 0
        assert capsys.readouterr() == (",".join(map(str, free[:stop + 1])) + "\n", ""), where

    assert _convert("export", tmp_path / "run", tmp_path / "out") == 0
    assert GenerationConfig.from_pretrained(tmp_path / "out").eos_token_id == [2, extra]
    assert json.loads((tmp_path / "out" / "config.json").read_text())["eos_token_id"] == [
        2, extra]


def test_generation_config_without_transformers_is_what_transformers_writes(tmp_path,
                                                                           monkeypatch):
    """Export needs no transformers: without it generation_config.json is written by hand, with
    the keys GenerationConfig.save_pretrained writes, less its version."""
    ids = {"bos_token_id": 0, "eos_token_id": [1, 5], "pad_token_id": 63}
    (tmp_path / "with").mkdir()
    (tmp_path / "without").mkdir()
    hf.write_generation_config(tmp_path / "with", ids)
    monkeypatch.setitem(sys.modules, "transformers", None)  # import transformers: ImportError
    hf.write_generation_config(tmp_path / "without", ids)
    monkeypatch.undo()
    theirs = json.loads((tmp_path / "with" / hf.GENERATION).read_text())
    assert theirs.pop("transformers_version")
    assert json.loads((tmp_path / "without" / hf.GENERATION).read_text()) == theirs == ids
    assert GenerationConfig.from_pretrained(tmp_path / "without").eos_token_id == [1, 5]


def test_a_windowed_mistral_imports_and_fine_tunes_past_its_window(tmp_path):
    """Mistral v0.1's window (4096 there, 64 here) is kept, and the preset trains at its
    context (max_position_embeddings), not at the window: a run at 256 tokens per sequence
    (4x the window) trains, and export writes the window back."""
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(vocab_size=512, hidden_size=64, intermediate_size=128,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                           sliding_window=64, max_position_embeddings=1024)
    MistralForCausalLM(config).save_pretrained(tmp_path / "hf")
    assert _convert("import", tmp_path / "hf", tmp_path / "imp") == 0
    preset = weights.config_of({"config": (tmp_path / "imp" / "config.yaml").read_text()})
    assert (preset.model.sliding_window, preset.train.seq_len) == (64, 1024)
    assert launch.main(["--config", str(tmp_path / "imp" / "config.yaml"), *RUN,
                        "train.steps=2", "train.seq_len=256", f"run.dir={tmp_path / 'run'}"]) == 0
    assert _convert("export", tmp_path / "imp", tmp_path / "out") == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == 64
    _assert_same_tensors(tmp_path / "hf", tmp_path / "out")


@pytest.mark.parametrize("source, out, message", [
    ("nowhere", "imp", "{t}/nowhere: no such directory; give a Hugging Face model directory "
     "(config.json and *.safetensors)"),
    ("afile", "imp", "{t}/afile: not a directory; give a Hugging Face model directory"),
    ("empty", "imp", "{t}/empty/config.json not found: a Hugging Face model directory has a "
     "config.json"),
    ("hf", "afile", "{t}/afile is a file; name a new output directory"),
    ("hf", "afile/imp", "cannot make the output directory {t}/afile/imp: Not a directory"),
])
def test_unusable_paths_are_named_once_in_one_line(tmp_path, capsys, source, out, message):
    _save("llama2", tmp_path / "hf")
    (tmp_path / "afile").write_text("keep")
    (tmp_path / "empty").mkdir()
    before = sorted(tmp_path.rglob("*"))
    err = _one_line(capsys, 2, "import", tmp_path / source, tmp_path / out)
    assert err.startswith(f"convert_hf.py: error: {message.format(t=tmp_path)}"), err
    assert sorted(tmp_path.rglob("*")) == before and (tmp_path / "afile").read_text() == "keep"


@pytest.mark.parametrize("dtype, context, flags, want", [
    (torch.float32, 64, [], ("float32", 64)),
    (torch.bfloat16, 64, [], ("bfloat16", 64)),
    (torch.float32, None, ["--compute-dtype", "bfloat16"], ("bfloat16", 2048)),
])
def test_the_preset_computes_in_the_source_dtype_within_its_context(tmp_path, monkeypatch,
                                                                     dtype, context, flags, want):
    """model.dtype is the dtype the weights were published in unless --compute-dtype says
    otherwise; train.seq_len is max_position_embeddings up to 2048 (2048 when it is not given).
    OUT_DIR may be relative."""
    _save("llama2", tmp_path / "hf", dtype)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["max_position_embeddings"] = context
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    monkeypatch.chdir(tmp_path)
    assert _convert("import", "hf", "imp", *flags) == 0
    preset = weights.config_of({"config": (tmp_path / "imp" / "config.yaml").read_text()})
    assert (preset.model.dtype, preset.train.seq_len) == want
    assert preset.model.param_dtype == "float32"  # master weights, whatever the source


def test_a_one_layer_import_says_one_layer(tmp_path, capsys):
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2)).save_pretrained(
        tmp_path / "hf")
    capsys.readouterr()
    assert _convert("import", tmp_path / "hf", tmp_path / "imp") == 0
    assert capsys.readouterr().out.startswith(f"imported 1 layer of {tmp_path / 'hf'} (float32) "
                                              f"into {tmp_path / 'imp'}/checkpoints/0 (float32); "
                                              "preset: model.dtype=float32, train.seq_len=2048;")


def _tiny_llama(path: Path, layers: int = 2) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=layers, num_attention_heads=2)).save_pretrained(
        path)


@pytest.mark.parametrize("source, target", [
    ("imp/checkpoints/0", "imp/checkpoints/0/x"),  # inside the checkpoint itself
    ("imp/checkpoints/0", "imp/checkpoints/x"),    # beside it, where rotation deletes steps
    ("imp", "imp/checkpoints/0/a/b"),              # a run's newest, named by its run directory
    ("imp", "other/checkpoints/hf"),               # another run's or import's checkpoints
])
def test_an_export_into_a_checkpoints_directory_is_refused(tmp_path, capsys, source, target):
    """A later run's checkpoint rotation deletes a checkpoint with what is in it (and its
    checkpoints directory is the run's to manage): the export is refused, naming a place
    outside, where it then goes."""
    _tiny_llama(tmp_path / "hf")
    for name in ("imp", "other"):
        assert _convert("import", tmp_path / "hf", tmp_path / name) == 0
    before = sorted(tmp_path.rglob("*"))
    holder = (tmp_path / target.split("/checkpoints")[0] / "checkpoints").resolve()
    err = _one_line(capsys, 2, "export", tmp_path / source, tmp_path / target)
    assert_refused(2, err, str(tmp_path / target), str(holder), str(holder.parent / "hf"))
    assert sorted(tmp_path.rglob("*")) == before
    assert _convert("export", tmp_path / source, holder.parent / "hf") == 0


# Each of an import's per-layer saves takes 0.1 s more: a window of seconds to signal in.
SLOW_LAYER_SAVES = """
import time
from jaxtron.program import xla_flags
xla_flags.load_plugins_quietly()  # as the tool does before it imports jax
from orbax.checkpoint import v1

_save = v1.partial.save
def _slow_save(*args, **kwargs):
    time.sleep(0.1)
    return _save(*args, **kwargs)
v1.partial.save = _slow_save
"""


@pytest.mark.parametrize("sig, existed", [(signal.SIGINT, False), (signal.SIGTERM, False),
                                          (signal.SIGINT, True)])
def test_a_stopped_import_is_one_line_and_leaves_no_output(tmp_path, sig, existed):
    """Ctrl-C or SIGTERM once the import is writing its checkpoint: one line, status 130, no
    traceback, and no OUT (an empty one that was there stays, empty), so the rerun is not
    refused as 'not empty' (a 31-line KeyboardInterrupt traceback before, and OUT holding
    checkpoints/0.partial_save)."""
    _tiny_llama(tmp_path / "hf", layers=32)  # 32 Orbax saves, each slowed by 0.1 s, to stop in
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "sitecustomize.py").write_text(SLOW_LAYER_SAVES)
    out = tmp_path / "imp"
    if existed:
        out.mkdir()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(tmp_path / "slow"), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, str(ROOT / "tools" / "convert_hf.py"), "import",
                             str(tmp_path / "hf"), str(out)], cwd=ROOT, text=True, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    while not list(tmp_path.glob("imp*/checkpoints")) and proc.poll() is None:
        time.sleep(0.005)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=300)
    assert "Traceback" not in err, err[-3000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == (["hf", "imp", "slow"] if existed
                                                          else ["hf", "slow"])
    assert not existed or not any(out.iterdir())
    assert (proc.returncode, err) == (
        130, f"convert_hf.py: stopped by a signal; nothing was written to {out} (run the command "
        "again)\n")
    assert _convert("import", tmp_path / "hf", out) == 0


def test_inspect_ckpt_shows_where_an_import_came_from(tmp_path):
    """It showed an import as `loss: None`, `saved at: unknown`."""
    _tiny_llama(tmp_path / "hf")
    assert _convert("import", tmp_path / "hf", tmp_path / "imp") == 0
    shown = subprocess.run([sys.executable, str(ROOT / "tools" / "inspect_ckpt.py"),
                            str(tmp_path / "imp")], capture_output=True, text=True, timeout=300)
    assert shown.returncode == 0, shown.stderr
    assert (f"imported:    from {tmp_path / 'hf'} (weights only; no loss, no optimizer state)"
            in shown.stdout.splitlines())
    assert "loss:" not in shown.stdout and "saved at:" not in shown.stdout
    # the listing said `step 0  loss None`
    assert f"  step        0  imported from {tmp_path / 'hf'}" in shown.stdout.splitlines()
    assert "loss" not in shown.stdout.split("checkpoint:")[0], shown.stdout


def test_what_a_killed_import_left_is_removed_by_the_next(tmp_path, capsys):
    """kill -9 during an import leaves OUT.partial-<host>-<pid>-<hex> (a model's size); the next
    import into OUT removed nothing (two such stayed after a walkthrough, 110 MB). Now it removes
    this host's whose process is gone, and says so; a live one, another host's, stay."""
    _tiny_llama(tmp_path / "hf")
    out = tmp_path / "imp"
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()  # a pid no process has now
    host = convert_hf._HOST
    names = {"stale": f"imp.partial-{host}-{dead.pid}-abc123",
             "live": f"imp.partial-{host}-{os.getpid()}-abc123",
             "elsewhere": f"imp.partial-otherhost-{dead.pid}-abc123"}
    for name in names.values():
        (tmp_path / name).mkdir()
        (tmp_path / name / "weights").write_bytes(b"x" * 1000)
    assert _convert("import", tmp_path / "hf", out) == 0
    assert (f"removed {tmp_path / names['stale']}, left by a command that was killed\n"
            in capsys.readouterr().out)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["hf", "imp", names["live"], names["elsewhere"]])


def test_of_two_imports_into_one_new_directory_the_second_is_refused(tmp_path, capsys,
                                                                     monkeypatch):
    """Another import finishes OUT while this one writes (each writes beside OUT and renames):
    this one says so in one line and removes its own; OUT is the other's, whole, and every
    path in it names OUT (an 'OSError: Directory not empty' traceback before, or a success
    with OUT mixed from both)."""
    _tiny_llama(tmp_path / "hf")
    out = tmp_path / "imp"
    write_layers, others = weights.write_layers, []

    def meanwhile(*args):
        if not others:  # the other import runs whole, once, while this one writes
            others.append(None)
            others[0] = _convert("import", tmp_path / "hf", out)
        write_layers(*args)

    monkeypatch.setattr(weights, "write_layers", meanwhile)
    err = _one_line(capsys, 2, "import", tmp_path / "hf", out)
    assert others == [0]
    assert_refused(2, err, str(out), "another command", "new output directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "imp"]
    text = (out / "config.yaml").read_text()
    assert ".partial" not in text and f"--config {out}/config.yaml" in text
    assert weights.read_meta(out / "checkpoints" / "0")["config"] == text
    preset = weights.config_of({"config": text})
    assert preset.checkpoint.restore == str(out)
    _, params = weights.read_params(out)
    np.testing.assert_array_equal(params["embed"],
                                  hf.read_tensors(tmp_path / "hf")["model.embed_tokens.weight"])


@pytest.mark.parametrize("edit, message", [
    ({"hidden_size": "256"}, 'hidden_size is "256", a string; it must be an integer'),
    ({"tie_word_embeddings": "false"},
     'tie_word_embeddings is "false", a string; it must be true or false'),
    ({"rms_norm_eps": [1e-5]}, "rms_norm_eps is [1e-05], a list; it must be a number"),
    ({"model_type": None},
     "model_type is missing; add the family (llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, "
     "deepseek_v3, deepseek_v2, gemma2, gemma3_text, gpt_oss)"),
    ({"num_attention_heads": None}, "num_attention_heads is missing; add it (an integer)"),
])
def test_a_config_json_value_of_the_wrong_type_is_one_line(tmp_path, capsys, edit, message):
    """A string where a number belongs (a TypeError traceback from model.py before), or a key
    left out ('model_type None is not supported'): one line naming the key, from import and
    from tools/generate.py alike."""
    from jaxtron.commands import generate as generate_tool

    _tiny_llama(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config = {k: v for k, v in {**config, **edit}.items() if v is not None}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    line = f"{tmp_path / 'hf' / 'config.json'}: {message}\n"
    assert _one_line(capsys, 2, "import", tmp_path / "hf", tmp_path / "imp") == (
        "convert_hf.py: error: " + line)
    assert not (tmp_path / "imp").exists()
    assert generate_tool.main([str(tmp_path / "hf"), "--tokens", "1,2"]) == 2
    assert capsys.readouterr().err == "generate.py: error: " + line


def test_the_fine_tune_command_can_be_pasted(tmp_path, capsys):
    """An OUT with a space: the printed command and config.yaml's header quote it as a shell
    needs (they printed it bare, which a shell splits in two)."""
    _tiny_llama(tmp_path / "hf")
    out = tmp_path / "with space" / "imp"
    capsys.readouterr()
    assert _convert("import", tmp_path / "hf", out) == 0
    command = f"jaxtron train --config '{out}/config.yaml'"
    assert capsys.readouterr().out.splitlines()[-1] == f"fine-tune: {command}"
    assert shlex.split(command)[-1] == str(out / "config.yaml")
    assert (out / "config.yaml").read_text().splitlines()[1] == (
        f"# by jaxtron convert-hf; fine-tune: {command}")


def test_a_windowed_mixtral_keeps_its_window_and_round_trips_through_transformers(tmp_path):
    """Mixtral slides whenever config.json's sliding_window is set (it has no use_sliding_window
    switch), and import read it as full causal attention, silently. The window is kept as
    model.sliding_window, as Mistral's is, and applied past its length; export writes it back,
    and transformers then gives the source's logits. Measured: the window moves transformers'
    logits (up to 4.3) by 3.7 at 24 tokens; ours are within 4.3e-6 of the source's, and the
    export (the same tensors) gives the source's logits exactly."""
    tiny = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                num_experts_per_tok=2, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(0)
    windowed = MixtralForCausalLM(MixtralConfig(**tiny, sliding_window=16)).eval()
    with torch.no_grad():
        for name, p in windowed.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight")
                    else 0.2 * torch.randn_like(p))
    windowed.save_pretrained(tmp_path / "hf")
    full = MixtralForCausalLM(MixtralConfig(**tiny, sliding_window=None)).eval()
    full.load_state_dict(windowed.state_dict())
    tokens, positions, _ = hf_inputs(24)
    tokens %= 128
    want = hf_logits(windowed, tokens, positions)
    # the window matters
    assert np.abs(hf_logits(full, tokens, positions) - want).max() > 100 * HF_TOL

    assert _convert("import", tmp_path / "hf", tmp_path / "imp") == 0
    preset = weights.config_of({"config": (tmp_path / "imp" / "config.yaml").read_text()})
    assert preset.model.sliding_window == 16
    cfg, params = weights.read_params(tmp_path / "imp")
    assert np.abs(hf.logits(cfg.model, params, tokens) - want).max() < HF_TOL

    assert _convert("export", tmp_path / "imp", tmp_path / "out") == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["sliding_window"] == 16
    _assert_same_tensors(tmp_path / "hf", tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert np.abs(hf_logits(back.eval(), tokens, positions) - want).max() < HF_TOL


MOE_RUN = ["model.num_layers=2", "model.d_model=32", "model.num_heads=4", "model.num_kv_heads=2",
           "model.mlp_dim=48", "model.moe.mlp_dim=24", "model.moe.num_experts=4",
           "model.moe.experts_per_token=2", "model.init_std=0.3", "train.steps=1"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_experts_narrower_than_mlp_dim_export_to_transformers_and_back(tmp_path, family):
    """A run whose experts (model.moe.mlp_dim=24) are narrower than model.mlp_dim=48 was written
    with intermediate_size=48, which transformers' Mixtral refused (size mismatch), as did the
    import back. Mixtral's config.json now gives its experts' width as intermediate_size,
    Qwen3-MoE's as moe_intermediate_size: transformers loads every tensor and computes our
    logits, its tokenizer starts text with the BOS training put before each document, and the
    import back holds the same weights. Measured max |logit diff| 2.9e-5 (Mixtral) and 1.2e-5
    (Qwen3-MoE) at logits up to 8.3 (asserted 1e-4)."""
    run = tmp_path / "run"
    qk_norm = [f"model.qk_norm={str(family == 'qwen3_moe').lower()}"]
    assert launch.main([*RUN, *MOE_RUN, *qk_norm, f"run.dir={run}"]) == 0
    cfg, params = weights.read_params(run)
    assert _convert("export", run, tmp_path / "hf") == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    widths = {"mixtral": {"intermediate_size": 24},
              "qwen3_moe": {"intermediate_size": 48, "moe_intermediate_size": 24}}[family]
    assert {k: config.get(k) for k in widths} == widths
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert type(model).__name__ == hf.ARCHITECTURES[family]
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (2, 32))
    theirs = hf_logits(model.eval(), tokens, np.tile(np.arange(32), (2, 1)))
    diff = np.abs(hf.logits(cfg.model, params, tokens) - theirs).max()
    print(f"{family}: max |logit diff| {diff:.1e}, logits up to {np.abs(theirs).max():.1f}")
    assert diff < HF_TOL and np.abs(theirs).max() > 1

    text = "def f(x):\n    return x  # é\n"
    ours = prepared.dataset_tokenizer(cfg.data, cfg.model.vocab_size)
    assert AutoTokenizer.from_pretrained(tmp_path / "hf")(text).input_ids == [
        ours.bos_id(), *ours.encode(text)]

    assert _convert("import", tmp_path / "hf", tmp_path / "imp") == 0
    again, back = weights.read_params(tmp_path / "imp")
    assert (again.model.moe.num_experts, again.model.moe.mlp_dim or again.model.mlp_dim) == (4, 24)
    for got, want in zip(jax.tree.leaves(back), jax.tree.leaves(params)):
        np.testing.assert_array_equal(got, want)


def test_an_exported_sentencepiece_tokenizer_adds_bos_in_transformers(pipeline_run, tmp_path):
    """Training puts BOS before every document; transformers loaded the exported tokenizer.model
    adding none. tokenizer_config.json now says add_bos_token, and AutoTokenizer's ids are the
    run's: [bos] + its pieces, decoding back to the text."""
    cfg, _ = weights.read_params(pipeline_run)
    assert _convert("export", pipeline_run, tmp_path / "hf") == 0
    tok = AutoTokenizer.from_pretrained(tmp_path / "hf")
    ours = prepared.dataset_tokenizer(cfg.data, cfg.model.vocab_size)
    text = "import os\n\nclass A:\n    x = 1  # ünï\n"
    ids = tok(text).input_ids
    assert ids == [ours.bos_id(), *ours.encode(text)] and ids[0] == tokenizer_lib.BOS_ID
    assert tok.decode(ids, skip_special_tokens=True) == text
    assert tokenizer_lib.from_path(tmp_path / "hf").sha256 == ours.sha256  # the same model file


def test_a_tokenizer_with_ids_past_vocab_size_is_refused_naming_the_fix(tmp_path, capsys):
    """A tokenizer with 66 ids beside a 64-row embedding imported without a word; its fine-tune
    command then asked to raise model.vocab_size, which the restore refused as another model.
    The import refuses in one line naming the fix, and the fix (resize the embeddings in
    transformers) imports and fine-tunes with the printed command."""
    _tiny_llama(tmp_path / "hf")
    _first_last_tokenizer(tmp_path / "hf", 66)
    err = _one_line(capsys, 2, "import", tmp_path / "hf", tmp_path / "imp")
    assert_refused(2, err, str(tmp_path / "hf"), "66 ids", "vocab_size is 64",
                   "model.resize_token_embeddings(66)")
    assert not (tmp_path / "imp").exists()

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    model.resize_token_embeddings(66)
    model.save_pretrained(tmp_path / "fixed")
    _first_last_tokenizer(tmp_path / "fixed", 66)
    capsys.readouterr()
    assert _convert("import", tmp_path / "fixed", tmp_path / "imp") == 0
    command = capsys.readouterr().out.splitlines()[-1].removeprefix("fine-tune: ")
    assert shlex.split(command)[:2] == ["jaxtron", "train"]
    assert launch.main([*shlex.split(command)[2:], *RUN, "train.steps=1",
                        f"run.dir={tmp_path / 'tuned'}"]) == 0


def test_export_help_gives_the_default_model_type_a_run_gets(capsys):
    """The help said the default was qwen2 or llama, while a MoE run exports as mixtral or
    qwen3_moe (tests above) and a windowed one as mistral."""
    assert _convert("export", "--help") == 0
    text = " ".join(capsys.readouterr().out.split())
    assert ("default: the imported model's, else the family that computes the model: qwen3_moe "
            "(experts, q/k norms), mixtral (experts), qwen2 (QKV biases), qwen3 (q/k norms), "
            "mistral (an attention window), else llama") in text, text


# A tiny random DeepSeek-V3 (dims no other test uses): the first layer dense (`dense_layers`),
# two MoE layers (`layers`), q compressed, 6 experts in 2 groups of which 1 is kept, 2 shared
# experts, and a nonzero balancing bias, which changes the experts chosen.
DEEPSEEK_TINY = dict(vocab_size=88, hidden_size=40, intermediate_size=56, moe_intermediate_size=12,
                     num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
                     kv_lora_rank=18, q_lora_rank=14, qk_nope_head_dim=6, qk_rope_head_dim=4,
                     v_head_dim=6, n_routed_experts=6, num_experts_per_tok=2, n_group=2,
                     topk_group=1, n_shared_experts=2, first_k_dense_replace=1,
                     routed_scaling_factor=2.5, norm_topk_prob=True, rms_norm_eps=1e-6,
                     max_position_embeddings=48, rope_interleave=True,
                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                     attn_implementation="eager", bos_token_id=1, eos_token_id=2,
                     tie_word_embeddings=False)


def _deepseek(path: Path, **overrides) -> torch.nn.Module:
    """DEEPSEEK_TINY (with `overrides`), every weight and the balancing bias random, saved by
    transformers to `path` (sharded, with an index) with a word-level tokenizer."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**DEEPSEEK_TINY, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight")
                    else 0.3 * torch.randn_like(p))
        for layer in model.model.layers[DEEPSEEK_TINY["first_k_dense_replace"]:]:
            bias = layer.mlp.gate.e_score_correction_bias  # a buffer
            bias.copy_(0.5 * torch.randn_like(bias))
    model.save_pretrained(path, max_shard_size="20KB")
    _llama2_words(path, DEEPSEEK_TINY["vocab_size"])
    return model


@pytest.fixture(scope="module")
def deepseek_import(tmp_path_factory):
    """(the transformers model, its directory, its import by convert-hf)."""
    root = tmp_path_factory.mktemp("deepseek")
    model = _deepseek(root / "hf")
    assert _convert("import", root / "hf", root / "imp") == 0
    return model, root / "hf", root / "imp"


def _deepseek_tokens(seq: int = 20) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(3).integers(3, DEEPSEEK_TINY["vocab_size"], (2, seq), np.int32)
    return tokens, np.tile(np.arange(seq, dtype=np.int32), (2, 1))


def test_a_deepseek_import_holds_each_layer_in_its_stack(deepseek_import):
    """DeepSeek-V3's dense first layer goes to `dense_layers`, the MoE layers to `layers` (the
    import wrote them by model layer, which the MoE stack's index is not): read back, the import
    gives transformers' logits, with the router's balancing bias of each MoE layer."""
    model, path, imp = deepseek_import
    cfg, params = weights.read_params(imp)
    assert cfg.model.family == "deepseek_v3" and cfg.model.moe.first_dense == 1
    assert params["dense_layers"]["mlp"]["w_gate"].shape[0] == 1
    assert params["layers"]["mlp"]["router"].shape[0] == 2
    source = hf.read_tensors(path)
    for i in (1, 2):
        np.testing.assert_array_equal(params["layers"]["mlp"]["router_bias"][i - 1],
                                      source[f"model.layers.{i}.mlp.gate.e_score_correction_bias"])
    tokens, positions = _deepseek_tokens()
    want = hf_logits(model, tokens, positions)
    diff = np.abs(hf.logits(cfg.model, params, tokens) - want).max()
    print(f"max |logit diff| {diff:.1e}, logits up to {np.abs(want).max():.1f}")
    assert diff < HF_TOL and np.abs(want).max() > 1


def test_a_deepseek_import_exports_the_checkpoint_transformers_saved(deepseek_import, tmp_path):
    """Export of the import: every tensor of the source, by name, dtype and value (the balancing
    bias included), written with rope_interleave as the source has it."""
    _, path, imp = deepseek_import
    assert _convert("export", imp, tmp_path / "out") == 0
    _assert_same_tensors(path, tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["model_type"], config["rope_interleave"], config["first_k_dense_replace"]) == (
        "deepseek_v3", True, 1)


def test_generate_on_a_deepseek_import_is_transformers_greedy(deepseek_import, capsys):
    model, _, imp = deepseek_import
    prompt, new = [5, 17, 33, 60], 10
    with torch.no_grad():
        theirs = model.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False)
    want = theirs[0, len(prompt):].tolist()
    tool = importlib.import_module("jaxtron.commands.generate")
    capsys.readouterr()
    assert tool.main([str(imp), "--tokens", ",".join(map(str, prompt)),
                      "--max-new-tokens", str(new)]) == 0
    assert capsys.readouterr().out.strip() == ",".join(map(str, want))


def test_a_deepseek_import_fine_tunes_and_exports(deepseek_import, tmp_path):
    """Two steps at lr 0 from the import (weights only): the run starts from exactly the
    imported weights, each layer in its stack, and its checkpoint (stacked arrays, not the
    import's layer by layer) exports to the source's tensors."""
    _, path, imp = deepseek_import
    run = tmp_path / "run"
    assert launch.main(["--config", str(imp / "config.yaml"), "train.seq_len=16",
                        "train.batch_size=8", "train.eval_every=0", "run.tensorboard=false",
                        "run.progress=lines", "mesh.data=4", "mesh.fsdp=2", "optim.lr=0",
                        "train.steps=2", f"run.dir={run}"]) == 0
    assert weights.read_meta(weights.locate(run)[1])["step"] == 2
    _, start = weights.read_params(run)
    _, imported = weights.read_params(imp)
    for got, want in zip(jax.tree.leaves(start), jax.tree.leaves(imported)):
        np.testing.assert_array_equal(got, want)
    assert _convert("export", run, tmp_path / "out") == 0
    _assert_same_tensors(path, tmp_path / "out")


def test_a_deepseek_import_without_interleaved_rope_exports_interleaved(tmp_path):
    """config.json's rope_interleave=false reaches the import (its weights are taken as they
    are); export writes the rotated dims interleaved, saying rope_interleave: true, and
    transformers then computes the source's logits."""
    model = _deepseek(tmp_path / "hf", rope_interleave=False)
    assert _convert("import", tmp_path / "hf", tmp_path / "imp") == 0
    cfg, params = weights.read_params(tmp_path / "imp")
    tokens, positions = _deepseek_tokens()
    want = hf_logits(model, tokens, positions)
    assert np.abs(hf.logits(cfg.model, params, tokens) - want).max() < HF_TOL
    assert _convert("export", tmp_path / "imp", tmp_path / "out") == 0
    assert json.loads((tmp_path / "out" / "config.json").read_text())["rope_interleave"] is True
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager")
    assert np.abs(hf_logits(back.eval(), tokens, positions) - want).max() < HF_TOL
