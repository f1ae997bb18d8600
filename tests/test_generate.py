"""Generation with the KV cache (jaxtron/model/generate.py, Transformer.decode, tools/generate.py).

On tiny random transformers models saved as Hugging Face directories: greedy continuation equals
transformers' `generate(do_sample=False)` token for token; the cached decode's logits equal the full
forward's at every step (measured max |diff| in float32: llama3_gqa 1.1e-5, qwen2_bias_tied 1.4e-5,
against logits up to ~7; tolerance 1e-4); the sampler keeps and weighs the tokens that top-k,
top-p and temperature say; the command line prints the same ids and turns bad input into one line
and exit status 2.
"""

import dataclasses
import importlib
import itertools
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import assert_refused
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from jaxtron import hf
from jaxtron.model import abstract_model, init_cache
from jaxtron.model import generate as gen

TOOL = Path(__file__).resolve().parents[1] / "tools" / "generate.py"
VOCAB = 256
TINY = {"vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "rms_norm_eps": 1e-5, "max_position_embeddings": 64, "attn_implementation": "eager"}
# original_max_position_embeddings 32 and head_dim 16: the llama3 scaling changes the angles of
# positions past 32, which every continuation below reaches.
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
               "rope_theta": 10000.0}
CASES = {
    "llama3_gqa": (LlamaConfig, LlamaForCausalLM, {
        "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16,
        "tie_word_embeddings": False, "rope_parameters": LLAMA3_ROPE}),
    "qwen2_bias_tied": (Qwen2Config, Qwen2ForCausalLM, {
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": True}),
    # mixtures of experts: the experts run in the cached decode too
    "mixtral": (MixtralConfig, MixtralForCausalLM, {
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
        "num_local_experts": 4, "num_experts_per_tok": 2}),
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM, {
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "tie_word_embeddings": False, "num_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "norm_topk_prob": True}),
    # an 8-token window: the prompt alone passes it, and the continuation 6 times over
    "mistral_window": (MistralConfig, MistralForCausalLM, {
        "num_attention_heads": 4, "num_key_value_heads": 2, "tie_word_embeddings": False,
        "sliding_window": 8}),
}
TOL = 1e-4  # cached against full logits; float32 summation order gives ~1e-5
PROMPT, NEW = 12, 40  # one length each, so that the tests share one compiled program per model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(HF model with random weights, its saved directory, our config and params read back)."""
    config_cls, model_cls, overrides = CASES[request.param]
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY, **overrides, eos_token_id=2, bos_token_id=1)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():  # norms and biases too: a dropped one shows
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight")
                    else 0.2 * torch.randn_like(p))
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    cfg, params = hf.from_pretrained(path)
    assert cfg.qkv_bias == (request.param == "qwen2_bias_tied")
    return model, path, cfg, params


def _prompt(length: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(3, VOCAB, length).tolist()


def _hf_greedy(model, prompt: list[int], new: int, eos: int | None) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new,
                             eos_token_id=eos, pad_token_id=0)
    return out[0, len(prompt):].tolist()


# ---------------------------------------------------------------- greedy = transformers
def test_greedy_equals_transformers(case):
    model, _, cfg, params = case
    prompt = _prompt(PROMPT)
    ours = gen.generate(cfg, params, prompt, NEW)
    assert ours == _hf_greedy(model, prompt, NEW, eos=None)


def test_greedy_stops_at_eos_as_transformers_does(case):
    """End at an id the greedy continuation reaches mid-way: both stop there, the id included."""
    model, _, cfg, params = case
    prompt = _prompt(PROMPT, seed=1)
    free = gen.generate(cfg, params, prompt, NEW)
    eos = free[10]
    ours = gen.generate(cfg, params, prompt, NEW, eos_id=eos)
    assert ours == free[:free.index(eos) + 1]
    assert ours == _hf_greedy(model, prompt, NEW, eos=eos)
    assert gen.generate(cfg, params, prompt, NEW, eos_id=[VOCAB + 5, eos]) == ours


# ---------------------------------------------------------------- cached decode = full forward
def test_cached_logits_equal_full_forward_at_every_step(case):
    """Two rows; a 10-token prefill, a 3-token chunk at slot 10, then one token per call, in a
    cache longer than the sequence (unwritten slots must stay unseen)."""
    _, _, cfg, params = case
    tokens = np.array([_prompt(40, seed=2), _prompt(40, seed=3)], np.int32)
    full = hf.logits(cfg, params, tokens)
    graphdef = nnx.graphdef(abstract_model(cfg))
    decode = jax.jit(lambda p, t, c, s: nnx.merge(graphdef, p).decode(t, c, s))
    cache = init_cache(cfg, 2, 48)
    cuts = [0, 10, 13, *range(14, 41)]
    for start, end in itertools.pairwise(cuts):
        logits, cache = decode(params, jnp.asarray(tokens[:, start:end]), cache, start)
        diff = float(np.abs(np.asarray(logits) - full[:, start:end]).max())
        assert diff < TOL, f"slots {start}..{end - 1}: cached logits off by {diff:.2e}"
    assert np.abs(full).max() > 3  # logits large enough for the tolerance to mean something


# ---------------------------------------------------------------- sampling
def test_sampling_limits_reduce_to_greedy_and_seeds_repeat(case):
    _, _, cfg, params = case
    prompt = _prompt(PROMPT, seed=4)
    greedy = gen.generate(cfg, params, prompt, NEW)
    assert gen.generate(cfg, params, prompt, NEW, temperature=1.5, top_k=1, seed=3) == greedy
    assert gen.generate(cfg, params, prompt, NEW, temperature=1.5, top_p=1e-6, seed=3) == greedy
    hot = [gen.generate(cfg, params, prompt, NEW, temperature=1.5, seed=s) for s in (7, 7, 8)]
    assert hot[0] == hot[1] and hot[0] != hot[2] and hot[0] != greedy
    # Nearly uniform: each draw's rank among the logits before it is ~uniform over 256, unless
    # the steps share one key (then every step draws the same rank).
    boiling = gen.generate(cfg, params, prompt, NEW, temperature=1e4, seed=0)
    logits = hf.logits(cfg, params, np.array([prompt + boiling]))[0, PROMPT - 1:-1]
    ranks = [int(np.sum(row > row[token])) for row, token in zip(logits, boiling)]
    assert len(set(ranks)) > NEW // 2, ranks


@pytest.mark.parametrize("temperature, top_k, top_p, want", [
    (1.0, 0, 1.0, [0.5, 0.3, 0.15, 0.05]),
    (1.0, 3, 1.0, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    (1.0, 0, 0.7, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),  # 0.5 < 0.7 <= 0.5 + 0.3
    (1.0, 0, 0.85, [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0]),
    (1.0, 2, 0.9, [0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]),  # top-k first, then top-p within it
    (0.5, 0, 1.0, np.array([0.5, 0.3, 0.15, 0.05]) ** 2 / 0.365),
])
def test_pick_draws_with_the_probabilities_asked_for(temperature, top_k, top_p, want):
    """20000 draws over 4 tokens (ids shuffled so that the order is not the id order): each
    frequency within 0.015 of its probability (about 4 standard deviations)."""
    ids = np.array([2, 0, 3, 1])  # token ids of probabilities 0.5, 0.3, 0.15, 0.05
    logits = np.zeros(4, np.float32)
    logits[ids] = np.log([0.5, 0.3, 0.15, 0.05])
    knobs = gen.Sampling(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
                         jnp.array([-1], jnp.int32))
    keys = jax.random.split(jax.random.key(0), 20000)
    drawn = jax.jit(jax.vmap(lambda k: gen.pick(jnp.asarray(logits), k, knobs)))(keys)
    freq = np.bincount(np.asarray(drawn), minlength=4)[ids] / len(keys)
    np.testing.assert_allclose(freq, want, atol=0.015)


@pytest.mark.parametrize("kwargs, match", [
    ({"max_new_tokens": 0}, "max_new_tokens=0"),
    ({"temperature": -0.1}, "temperature=-0.1"),
    ({"top_k": -1}, "top_k=-1"),
    ({"top_p": 0.0}, r"top_p=0.0: must be in \(0, 1\]"),
    ({"top_p": 1.5}, "top_p=1.5"),
    ({"top_k": 5}, "top_k and top_p choose .* temperature=0 is greedy and would ignore them: add a temperature above 0$"),
    ({"top_p": 0.5}, "temperature=0 is greedy and would ignore them"),
    ({"prompt_ids": []}, "non-empty"),
    ({"prompt_ids": [1, VOCAB]}, rf"\[0, {VOCAB}\)"),
])
def test_bad_arguments_are_named(case, kwargs, match):
    _, _, cfg, params = case
    args = {"prompt_ids": [1, 2], "max_new_tokens": 4} | kwargs
    with pytest.raises(gen.ConfigError, match=match):
        gen.generate(cfg, params, args.pop("prompt_ids"), args.pop("max_new_tokens"), **args)


def test_the_window_changes_the_continuation(case):
    """The windowed case's continuation (equal to transformers' above) is not full causal
    attention's: the same weights without the window continue otherwise."""
    _, _, cfg, params = case
    if not cfg.sliding_window:
        pytest.skip("no window")
    prompt = _prompt(PROMPT)
    assert gen.generate(cfg, params, prompt, NEW) != gen.generate(
        dataclasses.replace(cfg, sliding_window=0), params, prompt, NEW)


# ---------------------------------------------------------------- command line
def _tool(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *map(str, args)], capture_output=True,
                          text=True, timeout=300, check=False)


def test_cli_prints_transformers_greedy_ids(case):
    """--tokens on a saved directory: transformers' ids, which stop at its eos (2) if reached."""
    model, path, _, _ = case
    prompt = _prompt(6, seed=5)
    done = _tool(path, "--tokens", ",".join(map(str, prompt)), "--max-new-tokens", 20)
    assert done.returncode == 0, done.stderr
    ids = [int(i) for i in done.stdout.strip().split(",")]
    assert ids == _hf_greedy(model, prompt, 20, eos=model.generation_config.eos_token_id)


@pytest.fixture(scope="module")
def tool():
    return importlib.import_module("jaxtron.commands.generate")


def _word_tokenizer(path: Path, bos: bool = True, specials: tuple[str, str] = ("<s>", "</s>"),
                    named: dict[int, str] | None = None, config: dict | None = None) -> None:
    """A tokenizer.json over the tiny vocabulary: ids 3.. are the words w3.. (or the names in
    `named`), `specials` 1 and 2 (Llama's BOS and EOS by default, BOS put before a prompt by the
    post-processor as Llama's tokenizer.json does; none with bos=False, as Qwen2's), and
    `config` written as tokenizer_config.json. Text is the words with spaces between."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors

    words = {i: f"w{i}" for i in range(3, VOCAB)} | (named or {})
    vocab = {"<unk>": 0, specials[0]: 1, specials[1]: 2} | {word: i for i, word in words.items()}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, special=True)
                            for t in (*specials, *(named or {}).values())])
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{specials[0]} $A", special_tokens=[(specials[0], 1)])
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))


def _import(convert, hf_dir: Path, out: Path) -> Path:
    """A jaxtron import of `hf_dir` (its tokenizer copied beside it, named by data.tokenizer)."""
    assert convert.main(["import", str(hf_dir), str(out), "--compute-dtype", "float32"]) == 0
    return out


def test_cli_prompt_text_on_hf_dir_and_on_its_jaxtron_import(case, tool, tmp_path, capsys):
    """--prompt reads the directory's tokenizer.json, which puts BOS in front; prints text
    without special tokens: the words of transformers' greedy ids, stopping at </s>, which is
    not printed (it was). The same from the jaxtron checkpoint tools/convert_hf.py imports (its
    tokenizer is copied beside it)."""
    model, path, _, _ = case
    hf_dir = tmp_path / "hf"
    shutil.copytree(path, hf_dir)
    _word_tokenizer(hf_dir)
    imported = _import(importlib.import_module("jaxtron.commands.convert_hf"), hf_dir,
                       tmp_path / "imported")
    capsys.readouterr()
    want = _hf_greedy(model, [1, 17, 42, 99, 5], 12, eos=2)
    for directory in (hf_dir, imported):
        assert tool.main([str(directory), "--prompt", "w17 w42  w99 w5", "--max-new-tokens",
                          "12"]) == 0
        text = capsys.readouterr().out
        assert text == " ".join(f"w{i}" for i in want if i != 2) + "\n", directory


def _stops_early(case_name: str) -> None:
    """The tests of where a jaxtron checkpoint stops run on one model: the stop is the
    command's, the same for every architecture, and each import costs a compile."""
    if case_name != "llama3_gqa":
        pytest.skip("run on llama3_gqa only")


def test_cli_tokens_on_an_import_and_its_checkpoint_stop_at_the_tokenizers_eos(
        request, case, tool, tmp_path, capsys):
    """--tokens on a jaxtron import, or on its checkpoint (the tokenizer then found through
    data.tokenizer, as for a run fine-tuned from it), stops at the tokenizer's end ids. It ran
    to --max-new-tokens (the issue's '16,2,2,16,2,2,...'): no tokenizer was read for --tokens.
    The vocabulary is arranged so that the end comes early: the id the free greedy continuation
    gives fifth is named the document end (tokenizer_config.json's eos_token), or a chat turn
    end (<|im_end|>, eos_token of an instruct config, which ends generation beside </s> 2)."""
    _stops_early(request.node.callspec.params["case"])
    _, path, cfg, params = case
    prompt, new = [1, 17, 42, 99, 5], 24
    free = gen.generate(cfg, params, prompt, new)
    end = free[4]
    assert end > 2 and end not in free[:4] and 2 not in free[:4], free
    convert = importlib.import_module("jaxtron.commands.convert_hf")
    for kind, named, config in [("document end", {}, {"eos_token": f"w{end}"}),
                                ("turn end", {end: "<|im_end|>"}, {"eos_token": "<|im_end|>"})]:
        hf_dir = tmp_path / kind.replace(" ", "_")
        shutil.copytree(path, hf_dir)
        _word_tokenizer(hf_dir, named=named, config=config)
        imported = _import(convert, hf_dir, tmp_path / f"imp_{hf_dir.name}")
        capsys.readouterr()
        for where in (imported, imported / "checkpoints" / "0"):
            assert tool.main([str(where), "--tokens", ",".join(map(str, prompt)),
                              "--max-new-tokens", str(new)]) == 0
            out, err = capsys.readouterr()
            assert (out, err) == (",".join(map(str, free[:5])) + "\n", ""), (kind, where)
    assert len(free) == new and free[5:] != []  # without the end id it goes on


def test_cli_prompt_starts_with_bos_once_as_training_does(case, tool, tmp_path, capsys,
                                                          monkeypatch):
    """The ids --prompt feeds the model start with the BOS training puts before each document,
    once: whether the tokenizer.json's post-processor adds it (Llama 3) or not (a Llama 2
    tokenizer.json without the template), and the document start of a vocabulary without a BOS
    (Qwen2's <|endoftext|>, here id 2), which transformers does not add; a prompt that writes
    the BOS out keeps one. --tokens are fed as given. --prompt "" is BOS alone (it was no
    tokens, refused, for a tokenizer that adds none)."""
    _, path, _, _ = case
    fed = []
    monkeypatch.setattr(tool, "generate", lambda cfg, params, prompt, *a, **k: fed.append(
        list(prompt)) or [7, 2])
    qwen = ("<|im_start|>", "<|endoftext|>")  # no BOS in the vocabulary: EOS starts documents
    for name, bos, specials, text, want in [
            ("template", True, ("<s>", "</s>"), "w17 w42", [1, 17, 42]),
            ("template", True, ("<s>", "</s>"), "<s> w17 w42", [1, 17, 42]),
            ("plain", False, ("<s>", "</s>"), "w17 w42", [1, 17, 42]),
            ("plain", False, ("<s>", "</s>"), "", [1]),
            ("qwen", False, qwen, "w17 w42", [2, 17, 42]),
            ("qwen", False, qwen, "", [2])]:
        hf_dir = tmp_path / name
        if not hf_dir.exists():
            shutil.copytree(path, hf_dir)
            _word_tokenizer(hf_dir, bos, specials)
        assert tool.main([str(hf_dir), "--prompt", text, "--max-new-tokens", "4"]) == 0
        assert fed.pop() == want, (name, text)
        assert capsys.readouterr().out == "w7\n"  # the end token 2 is not printed
    assert tool.main([str(path), "--tokens", "17,42", "--max-new-tokens", "4"]) == 0
    assert fed.pop() == [17, 42] and capsys.readouterr().out == "7,2\n"


@pytest.mark.parametrize("args, match", [
    (["--tokens", "1,2", "--top-p", "1.5"], r"--top-p 1.5: must be in \(0, 1\]"),
    (["--tokens", "1,2", "--temperature", "-1"], "--temperature -1.0: use 0"),
    (["--tokens", "1,2", "--top-k", "5"], "--top-k and --top-p choose among tokens to sample; "
                                          "--temperature 0 is greedy and would ignore them: add a "
                                          "--temperature above 0$"),
    (["--tokens", "1,2", "--max-new-tokens", "0"], "--max-new-tokens 0: generate at least"),
    (["--tokens", "1,x"], r"argument --tokens: '1,x' is not a list of token ids \(0 or more\)"),
    (["--tokens", ""], r"argument --tokens: '' is not a list of token ids \(0 or more\), such as 1,2,3 "
                       r"\(see python tools/generate.py --help\)$"),
    (["--tokens", " , "], "argument --tokens: ' , ' is not a list of token ids"),
    (["--tokens=-5"], "argument --tokens: '-5' is not a list of token ids"),
    (["--tokens", "1,2", "--top-k", "two"], "argument --top-k: invalid int value"),
    (["--prompt", "hello"], "no tokenizer.json or tokenizer.model; --prompt needs one: give "
                            "--tokens ids instead$"),
    (["--tokens", ",".join(["5"] * 63)], (
        r"\(63 tokens\) and --max-new-tokens 64 pass the 64 positions the model takes "
        r"\(max_position_embeddings in config.json\); use --max-new-tokens 1 or less")),
    (["--tokens", ",".join(["5"] * 64)], "the prompt is 64 tokens, more than the model takes"),
    (["--tokens", "5"], r"the prompt \(1 token\) and --max-new-tokens 64 pass .* 63 or less$"),
    (["--tokens", "1,2", "--prompt", "hi"], "not allowed with argument"),
    (["--tokens", "1,999"], r"prompt ids must be in \[0, 256\)"),
])
def test_cli_bad_input_is_one_line_and_status_2(case, tool, capsys, args, match):
    """max_position_embeddings is 64 in these configs; --max-new-tokens defaults to 64."""
    _, path, _, _ = case
    try:
        status = tool.main([str(path), *args])
    except SystemExit as e:  # argparse's own errors
        status = e.code
    err = capsys.readouterr().err
    assert status == 2 and len(err.strip().splitlines()) == 1, err
    assert err.startswith("generate.py: error: "), err
    assert re.search(match, err), err


def test_cli_takes_prompt_and_continuation_up_to_the_models_positions(case, tool, capsys):
    _, path, cfg, params = case
    prompt = _prompt(60, seed=6)
    assert tool.main([str(path), "--tokens", ",".join(map(str, prompt)),
                      "--max-new-tokens", "4"]) == 0  # 60 + 4 = max_position_embeddings
    ids = [int(i) for i in capsys.readouterr().out.split(",")]
    assert ids == gen.generate(cfg, params, prompt, 4, eos_id=2)


def test_cli_missing_directory(tool, tmp_path, capsys):
    missing = tmp_path / "nowhere"
    assert_refused(tool.main([str(missing), "--tokens", "1"]), capsys.readouterr().err,
                   f"generate.py: error: {missing}: no such file")


def test_cli_prompt_on_an_import_without_tokenizer_is_one_line(request, case, tool, tmp_path,
                                                               capsys):
    """No tokenizer came with the import: --prompt says so (rather than training one on the
    default corpus for a vocabulary it was never meant for); --tokens stops at the end id the
    import kept from the directory's config.json (it was lost, and generation ran on), and
    with none kept generates every token asked for, with a note that no end id is known."""
    _, path, cfg, params = case
    convert = importlib.import_module("jaxtron.commands.convert_hf")
    free = gen.generate(cfg, params, [1, 2], 6)
    end = next(i for k, i in enumerate(free) if k and i not in free[:k])
    for name, eos in (("imp", end), ("bare", None)):
        if name == "bare" and request.node.callspec.params["case"] != "llama3_gqa":
            break  # the note is the command's, the same for every architecture
        hf_dir = tmp_path / f"{name}_hf"
        shutil.copytree(path, hf_dir, ignore=shutil.ignore_patterns("generation_config.json"))
        config = json.loads((hf_dir / "config.json").read_text())
        (hf_dir / "config.json").write_text(json.dumps({**config, "eos_token_id": eos}))
        assert convert.main(["import", str(hf_dir), str(tmp_path / name)]) == 0
    capsys.readouterr()
    assert_refused(tool.main([str(tmp_path / "imp"), "--prompt", "hi", "--max-new-tokens", "2"]),
                   capsys.readouterr().err, str(tmp_path / "imp"), "tokenizer", "--prompt",
                   "--tokens")
    assert tool.main([str(tmp_path / "imp"), "--tokens", "1,2", "--max-new-tokens", "6"]) == 0
    assert capsys.readouterr() == (",".join(map(str, free[:free.index(end) + 1])) + "\n", "")
    assert len(free) == 6 and free.index(end) < 5
    if (tmp_path / "bare").exists():
        assert tool.main([str(tmp_path / "bare"), "--tokens", "1,2", "--max-new-tokens",
                          "6"]) == 0
        out, err = capsys.readouterr()
        assert out == ",".join(map(str, free)) + "\n"
        assert err == (f"generate.py: note: no end-of-sequence id known ({tmp_path / 'bare'}: "
                       "imported without a tokenizer); generating all 6 tokens\n")


@pytest.mark.parametrize("name, text, message", [
    ("config.json", "[1, 2]", "{d}/config.json: not a JSON object of settings"),
    ("config.json", '{"model_type": ', "{d}/config.json: not valid JSON (Expecting value"),
    ("generation_config.json", "{bad", "{d}/generation_config.json: not valid JSON (Expecting"),
    ("generation_config.json", "[2]", "{d}/generation_config.json: not a JSON object of settings"),
    ("generation_config.json", '{"eos_token_id": "x"}',
     "{d}: eos_token_id 'x' is not a token id or a list of them"),
])
def test_cli_broken_json_in_the_directory_is_one_line(case, tool, tmp_path, capsys, name, text,
                                                      message):
    _, path, _, _ = case
    shutil.copytree(path, tmp_path / "hf")
    (tmp_path / "hf" / name).write_text(text)
    assert tool.main([str(tmp_path / "hf"), "--tokens", "1,2", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"generate.py: error: {message}".format(
        d=tmp_path / "hf")), err


def test_cli_truncated_weights_are_one_line(case, tool, tmp_path, capsys):
    """An interrupted download: the file is shorter than its header promises, said in one line
    (it was numpy's 'mmap length is greater than file size')."""
    _, path, _, _ = case
    shutil.copytree(path, tmp_path / "hf")
    f = tmp_path / "hf" / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:len(data) // 2])
    assert_refused(tool.main([str(tmp_path / "hf"), "--tokens", "1,2", "--max-new-tokens", "2"]),
                   capsys.readouterr().err, f"{f} is truncated",
                   f"{len(data) // 2} of {len(data)} bytes")
