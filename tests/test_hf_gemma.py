"""Gemma 2 and Gemma 3 (text) to and from Hugging Face (jaxtron/hf/gemma.py, the gemma2 and
gemma3_text families of jaxtron/model/gemma.py).

Each case is a random tiny Gemma2ForCausalLM or Gemma3ForCausalLM (float32, every weight
randomised, norms too) with a window of 8 shorter than the test's 40 tokens (5x): our logits
and greedy continuations equal transformers', and written back the checkpoint is the same,
tensor for tensor. Gemma 2: alternating windowed and global layers, soft caps on the scores
(50 by default; 4 here, where it bites) and the logits, query_pre_attn_scalar apart from the
head size. Gemma 3: five windowed layers to one global (6 layers; 7 with one left over), q/k
norms, the windowed layers' own RoPE base and linear scaling on the global ones. Dims no other
test uses: 3 query heads over 1 kv head of 24.
"""

import dataclasses

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
from jaxtron.model import windows

VOCAB, SEQ, NEW, WINDOW = 112, 40, 30, 8
TINY = dict(vocab_size=VOCAB, hidden_size=36, intermediate_size=52, num_attention_heads=3,
            num_key_value_heads=1, head_dim=24, rms_norm_eps=1e-6, max_position_embeddings=128,
            sliding_window=WINDOW, attn_implementation="eager", bos_token_id=1,
            eos_token_id=2, pad_token_id=0)
CASES = {
    "gemma2": ("gemma2", dict(num_hidden_layers=4, query_pre_attn_scalar=16,
                              attn_logit_softcapping=4.0, final_logit_softcapping=3.0,
                              rope_parameters={"rope_type": "default", "rope_theta": 500.0})),
    "gemma3": ("gemma3_text", dict(
        num_hidden_layers=7, query_pre_attn_scalar=24,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0,
                                            "rope_theta": 5000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}})),
}


def _hf_model(kind: str, overrides: dict):
    from transformers import Gemma2Config, Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3TextConfig

    config_cls, model_cls = ((Gemma2Config, Gemma2ForCausalLM) if kind == "gemma2"
                             else (Gemma3TextConfig, Gemma3ForCausalLM))
    torch.manual_seed(2)
    model = model_cls(config_cls(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(0.3 * torch.randn_like(p))  # Gemma's norms are 1 + weight: random too
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(case name, HF model, its directory as transformers saves it, our config and params)."""
    kind, overrides = CASES[request.param]
    model = _hf_model(kind, overrides)
    path = tmp_path_factory.mktemp(request.param)
    return request.param, model, path, *saved_and_read(model, path)


def _tokens(batch: int = 2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(3, VOCAB, (batch, SEQ), np.int32)
    return tokens, np.tile(np.arange(SEQ, dtype=np.int32), (batch, 1))


def test_logits_equal_transformers(case):
    name, model, _, cfg, params = case
    assert cfg.family == CASES[name][0] and cfg.sliding_window == WINDOW
    assert windows.layer_windows(cfg) == ([8, 0] * 2 if name == "gemma2"
                                          else [8] * 5 + [0] + [8])
    assert logit_diff(model, cfg, params, *_tokens()) < HF_TOL


def test_the_window_and_the_caps_matter(case):
    """Without the window (or Gemma 2's caps) our logits miss transformers' by far more than
    the tolerance: the equality above tests each."""
    name, model, _, cfg, params = case
    tokens, positions = _tokens()
    ref = hf_logits(model, tokens, positions)
    changes = [{"sliding_window": 0, "global_every": 0}]
    if name == "gemma2":
        changes += [{"attn_softcap": 0.0}, {"logit_softcap": 0.0}]
    else:
        changes += [{"rope_local_theta": 0.0}]
    for change in changes:
        other = dataclasses.replace(cfg, **change)
        assert np.abs(hf.logits(other, params, tokens) - ref).max() > 100 * HF_TOL, change


def test_export_is_the_checkpoint_transformers_saved(case, tmp_path):
    """Import then export: the checkpoint transformers saved, which it loads as the same
    architecture computing the same logits (helpers.assert_exported_as_read)."""
    name, model, path, cfg, params = case
    assert_exported_as_read(model, path, cfg, params, tmp_path / "out", CASES[name][0],
                            *_tokens())


def test_greedy_generation_past_the_window_equals_transformers(case):
    _, model, _, cfg, params = case
    prompt = np.random.default_rng(5).integers(3, VOCAB, 12).tolist()
    assert_greedy_as_transformers(model, cfg, params, prompt, NEW)


@pytest.mark.parametrize("change, match", [
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu' is not supported"),
    ({"use_bidirectional_attention": True}, "bidirectional attention are not supported"),
    ({"layer_types": ["sliding_attention", "full_attention", "full_attention"]},
     r"the windowed layers \[0\] of 3 are not a pattern"),
])
def test_what_gemma_computes_otherwise_is_refused_in_one_line(change, match):
    base = {"model_type": "gemma3_text", "vocab_size": 64, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2}
    assert_config_refused({**base, **change}, match)
