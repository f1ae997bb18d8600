"""gpt-oss to and from Hugging Face (jaxtron/hf/gpt_oss.py, the gpt_oss family of
jaxtron/model/gpt_oss.py).

A random tiny GptOssForCausalLM (float32, every weight randomised: sinks, biases, router bias,
norms) with a window of 8 under the test's 40 tokens (5x), alternating windowed and global
layers, YaRN with an untruncated range and a scale factor that bites at these lengths, the
clamped SwiGLU with a limit (1.5) that the random activations reach: our logits and greedy
continuations equal transformers', and written back the checkpoint is the same, tensor for
tensor. Its experts stored in MXFP4 (as OpenAI's checkpoints) read as transformers dequantises
them. Dims no other test uses: 6 query heads over 2 kv heads of 12, 5 experts, top 3.
"""

import dataclasses
import json

import numpy as np
import pytest
import torch
from helpers import (
    HF_TOL,
    assert_config_refused,
    assert_exported_as_read,
    assert_greedy_as_transformers,
    hf_logits,
    logit_diff,
    saved_and_read,
)

from jaxtron import hf
from jaxtron.hf import mxfp4, tensorfile
from jaxtron.model import windows

VOCAB, SEQ, NEW, WINDOW = 104, 40, 30, 8
CONFIG = dict(vocab_size=VOCAB, hidden_size=40, intermediate_size=28, num_hidden_layers=4,
              num_attention_heads=6, num_key_value_heads=2, head_dim=12, num_local_experts=5,
              num_experts_per_tok=3, sliding_window=WINDOW, rms_norm_eps=1e-5,
              swiglu_limit=1.5, max_position_embeddings=256,
              rope_parameters={"rope_type": "yarn", "rope_theta": 300.0, "factor": 4.0,
                               "beta_fast": 4.0, "beta_slow": 0.25, "truncate": False,
                               "original_max_position_embeddings": 64},
              attn_implementation="eager", bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _hf_model():
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(4)
    model = GptOssForCausalLM(GptOssConfig(**CONFIG)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            scale = 1.0 + ("norm" in name) if p.ndim == 1 else 0.3
            p.copy_(scale * torch.randn_like(p) if "norm" not in name
                    else 1 + 0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module")
def case(tmp_path_factory):
    """(HF model, its directory as transformers saves it, our config and params)."""
    model = _hf_model()
    path = tmp_path_factory.mktemp("gpt_oss")
    return model, path, *saved_and_read(model, path)


def _tokens(batch: int = 2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(3, VOCAB, (batch, SEQ), np.int32)
    return tokens, np.tile(np.arange(SEQ, dtype=np.int32), (batch, 1))


def test_logits_equal_transformers(case):
    _, _, cfg, params = case
    assert cfg.family == "gpt_oss" and cfg.attn_sinks and not cfg.rope_truncate
    assert windows.layer_windows(cfg) == [WINDOW, 0] * 2
    assert logit_diff(case[0], cfg, params, *_tokens()) < HF_TOL


def test_each_part_matters(case):
    """Without the sinks, the window, YaRN's untruncated range or the clamp, our logits miss
    transformers' by far more than the tolerance: the equality above tests each."""
    model, _, cfg, params = case
    tokens, positions = _tokens()
    ref = hf_logits(model, tokens, positions)
    for change in ({"attn_sinks": False, "family": "mixtral"}, {"global_every": 0},
                   {"rope_truncate": True},
                   {"moe": dataclasses.replace(cfg.moe, swiglu_limit=100.0)}):
        other = dataclasses.replace(cfg, **change)
        if "family" in change:  # the same weights, no sinks: the sink logits dropped
            other = dataclasses.replace(cfg, attn_sinks=False)
            got = _without_sinks(other, params, tokens)
        else:
            got = hf.logits(other, params, tokens)
        assert np.abs(got - ref).max() > 100 * HF_TOL, change


def _without_sinks(cfg, params, tokens):
    """Our logits with every sink at -inf (none in the softmax)."""
    sunk = {**params, "layers": {**params["layers"], "attn": {
        **params["layers"]["attn"], "sinks": np.full_like(params["layers"]["attn"]["sinks"],
                                                          -1e30)}}}
    return hf.logits(dataclasses.replace(cfg, attn_sinks=True), sunk, tokens)


def test_export_is_the_checkpoint_transformers_saved(case, tmp_path):
    model, path, cfg, params = case
    assert_exported_as_read(model, path, cfg, params, tmp_path / "out", "gpt_oss", *_tokens())


def test_greedy_generation_past_the_window_equals_transformers(case):
    model, _, cfg, params = case
    prompt = np.random.default_rng(5).integers(3, VOCAB, 12).tolist()
    assert_greedy_as_transformers(model, cfg, params, prompt, NEW)


def _quantize(w: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    """Random MXFP4 blocks and scales whose dequantised form has w's shape [E, A, B]."""
    e, a, b = w.shape
    blocks = rng.integers(0, 256, (e, b, a // 32, 16), dtype=np.uint8)
    scales = rng.integers(120, 130, (e, b, a // 32), dtype=np.uint8)
    return blocks, scales


def test_mxfp4_experts_read_as_transformers_dequantises_them(case, tmp_path):
    """The directory with its experts as MXFP4 blocks and scales (quantization_config mxfp4,
    hidden size 64 for whole blocks): read as float32 tensors equal to transformers' own
    dequantisation, and our logits on them equal transformers' model loaded from it."""
    from transformers import GptOssConfig, GptOssForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    model, _, _, _ = case
    config = {**CONFIG, "hidden_size": 64, "intermediate_size": 32}
    torch.manual_seed(6)
    base = GptOssForCausalLM(GptOssConfig(**config)).eval()
    with torch.no_grad():
        for _, p in base.named_parameters():
            p.copy_(0.3 * torch.randn_like(p))
    base.save_pretrained(tmp_path)
    names, get = hf.model_dir.open_tensors(tmp_path)
    tensors = {n: np.asarray(get(n)) for n in names}
    rng = np.random.default_rng(0)
    packed = {}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        blocks, scales = _quantize(tensors.pop(name), rng)
        packed |= {name + mxfp4.BLOCKS: blocks, name + mxfp4.SCALES: scales}
        want = convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                          dtype=torch.float32).numpy()
        tensors[name] = want
    tensorfile.write(tmp_path / "model.safetensors", sorted({**tensors, **packed}.keys() - {
        n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))}),
        {n: (v.shape, v.dtype) for n, v in {**tensors, **packed}.items()},
        lambda n: {**tensors, **packed}[n])
    hf_json = json.loads((tmp_path / "config.json").read_text())
    hf_json["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "config.json").write_text(json.dumps(hf_json))
    cfg, params = hf.from_pretrained(tmp_path)
    with torch.no_grad():
        for name, p in base.named_parameters():
            p.copy_(torch.from_numpy(np.array(tensors[name])))
    assert logit_diff(base, cfg, params, *_tokens()) < HF_TOL


@pytest.mark.parametrize("change, match", [
    ({"hidden_act": "gelu"}, "hidden_act other than silu"),
    ({"attention_bias": False}, "without attention biases"),
    ({"quantization_config": {"quant_method": "fp8"}}, "other than mxfp4"),
    ({"layer_types": ["sliding_attention", "full_attention", "full_attention"]},
     r"the windowed layers \[0\] of 3 are not a pattern"),
])
def test_what_gpt_oss_computes_otherwise_is_refused_in_one_line(change, match):
    base = {"model_type": "gpt_oss", "vocab_size": 64, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2}
    assert_config_refused({**base, **change}, match)


def test_convert_hf_exports_bfloat16_and_says_so(case, tmp_path, capsys):
    """`jaxtron convert-hf` import then export: the experts come back in bfloat16 by default
    (OpenAI's MXFP4 is not written), the line says so, and transformers loads the directory as
    GptOssForCausalLM computing the original's logits to bfloat16's precision."""
    from transformers import AutoModelForCausalLM

    from jaxtron.commands import convert_hf

    model, path, _, _ = case
    assert convert_hf.main(["import", str(path), str(tmp_path / "imp")]) == 0
    capsys.readouterr()
    assert convert_hf.main(["export", str(tmp_path / "imp"), str(tmp_path / "out")]) == 0
    line = capsys.readouterr().out
    assert "as GptOssForCausalLM" in line and "every tensor in bfloat16" in line, line
    names, get = hf.model_dir.open_tensors(tmp_path / "out")
    assert {str(get(n).dtype) for n in names} == {"bfloat16"}
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", torch_dtype=torch.float32)
    tokens, positions = _tokens()
    ref = hf_logits(model, tokens, positions)
    assert np.abs(hf_logits(back.eval(), tokens, positions) - ref).max() < 0.05 * np.abs(ref).max()
