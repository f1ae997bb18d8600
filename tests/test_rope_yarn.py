"""YaRN rotary scaling (DeepSeek-V3) against transformers' numbers; default and Llama-3 unchanged."""

import dataclasses
import math

import numpy as np
import pytest
from transformers import DeepseekV3Config
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

from jaxtron.config import ModelConfig
from jaxtron.config.model import MLAConfig
from jaxtron.model.layers import (
    rope_attention_factor,
    rope_dim,
    rope_frequencies,
    softmax_scale_factor,
)

# (rotary dim, MLA on, theta, factor, original len, beta_fast, beta_slow, mscale, mscale_all_dim)
CASES = {
    "deepseek_v3": (64, True, 10000.0, 40.0, 4096, 32.0, 1.0, 1.0, 1.0),
    "factor4_mscale_only": (32, False, 50000.0, 4.0, 2048, 16.0, 2.0, 0.707, 0.0),
    "deepseek_v2_mscales": (64, True, 10000.0, 40.0, 4096, 32.0, 1.0, 0.707, 0.707),
}


def _ours(dim, mla, theta, factor, old_len, fast, slow, mscale, mscale_all):
    base = dict(num_heads=2, num_kv_heads=2, d_model=128, rope_theta=theta,
                rope_scaling_factor=factor, rope_scaling_type="yarn", rope_original_max_len=old_len,
                rope_beta_fast=fast, rope_beta_slow=slow, rope_mscale=mscale,
                rope_mscale_all_dim=mscale_all)
    if mla:
        return ModelConfig(**base, mla=MLAConfig(kv_lora_rank=16, q_lora_rank=0,
                                                 qk_nope_head_dim=32, qk_rope_head_dim=dim,
                                                 v_head_dim=32))
    return ModelConfig(**base, head_dim=dim)


def _hf(dim, rope_parameters):
    return DeepseekV3Config(vocab_size=64, hidden_size=128, intermediate_size=64,
                            moe_intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                            num_key_value_heads=2, kv_lora_rank=16, q_lora_rank=None,
                            qk_nope_head_dim=32, qk_rope_head_dim=dim, v_head_dim=32,
                            max_position_embeddings=163840, rope_parameters=rope_parameters)


@pytest.mark.parametrize("case", list(CASES))
def test_yarn_matches_transformers(case):
    dim, _, theta, factor, old_len, fast, slow, mscale, mscale_all = CASES[case]
    cfg = _ours(*CASES[case])
    hf_cfg = _hf(dim, {"rope_type": "yarn", "rope_theta": theta, "factor": factor,
                       "original_max_position_embeddings": old_len, "beta_fast": fast,
                       "beta_slow": slow, "mscale": mscale, "mscale_all_dim": mscale_all})
    rotary = DeepseekV3RotaryEmbedding(hf_cfg)
    ours = np.asarray(rope_frequencies(cfg))
    assert rope_dim(cfg) == dim and ours.shape == (dim // 2,)
    np.testing.assert_allclose(ours, rotary.inv_freq.numpy(), rtol=1e-6, atol=0)
    # the ramp really bends: first entry unscaled, last divided by factor
    base = 1.0 / theta ** (np.arange(0, dim, 2) / dim)
    np.testing.assert_allclose([ours[0], ours[-1]], [base[0], base[-1] / factor], rtol=1e-6)
    assert rope_attention_factor(cfg) == pytest.approx(rotary.attention_scaling, rel=1e-12)
    attn = DeepseekV3Attention(hf_cfg, layer_idx=0)
    assert softmax_scale_factor(cfg) == pytest.approx(
        attn.scaling / attn.qk_head_dim ** -0.5, rel=1e-12)


def test_deepseek_v3_factors_by_hand():
    cfg = _ours(*CASES["deepseek_v3"])
    assert rope_attention_factor(cfg) == 1.0  # mscale / mscale_all_dim: both 1
    assert softmax_scale_factor(cfg) == pytest.approx((0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    cfg2 = _ours(*CASES["factor4_mscale_only"])
    # mscale_all_dim 0: transformers ignores mscale (0.707) and uses mscale 1
    assert rope_attention_factor(cfg2) == pytest.approx(0.1 * math.log(4) + 1, rel=1e-12)
    assert softmax_scale_factor(cfg2) == 1.0


def test_default_rope_unchanged():
    cfg = dataclasses.replace(_ours(*CASES["deepseek_v3"]), rope_scaling_factor=0.0)
    hf = DeepseekV3RotaryEmbedding(_hf(64, {"rope_type": "default", "rope_theta": 10000.0}))
    expect = 1.0 / 10000.0 ** (np.arange(0, 64, 2) / 64)
    np.testing.assert_allclose(np.asarray(rope_frequencies(cfg)), expect, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(rope_frequencies(cfg)), hf.inv_freq.numpy(), rtol=1e-6)
    assert rope_attention_factor(cfg) == 1.0 and softmax_scale_factor(cfg) == 1.0
    plain = ModelConfig(d_model=256, num_heads=4)  # no MLA: the whole head rotates
    assert rope_dim(plain) == 64 and rope_frequencies(plain).shape == (32,)


def test_llama3_scaling_unchanged():
    cfg = ModelConfig(d_model=128, num_heads=1, rope_theta=500000.0, rope_scaling_factor=8.0,
                      rope_original_max_len=8192, rope_scaling_type="llama3", rope_mscale_all_dim=1.0)
    inv = 1.0 / 500000.0 ** (np.arange(0, 128, 2) / 128)
    smooth = np.clip((8192 / (2 * np.pi / inv) - 1.0) / (4.0 - 1.0), 0.0, 1.0)
    np.testing.assert_allclose(np.asarray(rope_frequencies(cfg)),
                               (1 - smooth) * inv / 8.0 + smooth * inv, rtol=1e-5)
    assert rope_attention_factor(cfg) == 1.0 and softmax_scale_factor(cfg) == 1.0
