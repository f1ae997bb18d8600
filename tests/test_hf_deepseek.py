"""DeepSeek-V3 to and from Hugging Face (jaxtron/hf: DeepseekV3ForCausalLM <-> family deepseek_v3).

Each case is a random tiny DeepseekV3ForCausalLM (float32, every weight randomised, the router's
balancing bias e_score_correction_bias too, so that it changes the experts chosen), saved by
transformers as a checkpoint on disk (experts one tensor each, as DeepSeek's own files) and read
with jaxtron.hf.from_pretrained: our logits and greedy continuations equal transformers', and
written back with jaxtron.hf.save_pretrained the checkpoint is the same, tensor for tensor.
Dims no other test uses: 3 layers (the first dense), 8 experts in groups, 3 heads.
"""

import dataclasses

import numpy as np
import pytest
import torch
from helpers import (
    HF_TOL,
    assert_exported_as_read,
    assert_greedy_as_transformers,
    hf_logits,
    logit_diff,
)

from jaxtron import hf
from jaxtron.hf import config_json
from jaxtron.hf import mapping as hf_mapping

VOCAB, SEQ, NEW = 112, 40, 8
TINY = dict(vocab_size=VOCAB, hidden_size=48, intermediate_size=72, moe_intermediate_size=20,
            num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=3, kv_lora_rank=24,
            qk_nope_head_dim=12, qk_rope_head_dim=8, v_head_dim=10, n_routed_experts=8,
            num_experts_per_tok=3, first_k_dense_replace=1, routed_scaling_factor=2.5,
            norm_topk_prob=True, rms_norm_eps=1e-6, max_position_embeddings=64,
            rope_interleave=True, attn_implementation="eager", bos_token_id=1, eos_token_id=2)
# original_max_position_embeddings 16 < SEQ: YaRN's scaled frequencies reach the positions used;
# mscale_all_dim also scales the softmax
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 0.8}
CASES = {
    # q compressed, 2 shared experts, 4 groups of 2 of which 2 are kept, YaRN
    "q_lora_yarn": dict(q_lora_rank=20, n_shared_experts=2, n_group=4, topk_group=2,
                        rope_parameters=YARN),
    # q projected directly, 3 shared experts, 2 groups of 4 of which 1 is kept
    "no_q_lora": dict(q_lora_rank=None, n_shared_experts=3, n_group=2, topk_group=1,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}


def _hf_model(overrides: dict):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(DeepseekV3Config(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight")
                    else 0.2 * torch.randn_like(p))
        for layer in model.model.layers[TINY["first_k_dense_replace"]:]:
            bias = layer.mlp.gate.e_score_correction_bias  # a buffer: set after init
            bias.copy_(0.5 * torch.randn_like(bias))
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(HF model, its directory as transformers saves it, our config and params read back)."""
    model = _hf_model(CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    cfg, params = hf.from_pretrained(path)
    return model, path, cfg, params


def _tokens(batch: int = 2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(3, VOCAB, (batch, SEQ), np.int32)
    return tokens, np.tile(np.arange(SEQ, dtype=np.int32), (batch, 1))


def test_logits_equal_transformers(case):
    model, _, cfg, params = case
    assert cfg.family == "deepseek_v3" and cfg.moe.first_dense == 1
    assert "dense_layers" in params and params["layers"]["mlp"]["router_bias"].any()
    assert logit_diff(model, cfg, params, *_tokens()) < HF_TOL


def test_the_interleave_permutation_and_the_balancing_bias_matter(case):
    """Read as if rope_interleave were false, or without the router's bias, the same weights
    miss transformers by far more than HF_TOL: the case tests both."""
    model, path, cfg, params = case
    tokens, positions = _tokens()
    ref = hf_logits(model, tokens, positions)
    halves = hf_mapping.hf_to_params(hf.read_tensors(path), cfg, rope_interleave=False)
    unbiased = {**params, "layers": {**params["layers"], "mlp": {
        **params["layers"]["mlp"], "router_bias": np.zeros_like(
            params["layers"]["mlp"]["router_bias"])}}}
    for name, wrong in (("no permutation", halves), ("no bias", unbiased)):
        diff = np.abs(hf.logits(cfg, wrong, tokens) - ref).max()
        assert diff > 100 * HF_TOL, f"{name} moved logits by only {diff:.2e}"


def test_rope_interleave_false_reads_without_permutation(tmp_path):
    model = _hf_model({**CASES["no_q_lora"], "rope_interleave": False})
    model.save_pretrained(tmp_path)
    cfg, params = hf.from_pretrained(tmp_path)
    tokens, positions = _tokens(seed=1)
    assert np.abs(hf.logits(cfg, params, tokens) - hf_logits(model, tokens, positions)).max() \
        < HF_TOL


def test_export_is_the_checkpoint_transformers_saved(case, tmp_path):
    """Import then export: the same tensor names and values in memory (params_to_hf), and on
    disk the checkpoint transformers saved, which it loads as a DeepseekV3ForCausalLM computing
    the same logits (helpers.assert_exported_as_read)."""
    model, path, cfg, params = case
    source = hf.read_tensors(path)
    exported = hf_mapping.params_to_hf(params, cfg)
    assert sorted(exported) == sorted(source)
    for name, value in source.items():
        assert np.array_equal(exported[name], value), name
    assert_exported_as_read(model, path, cfg, params, tmp_path / "out", "deepseek_v3",
                            *_tokens())


def test_greedy_generation_equals_transformers(case):
    model, _, cfg, params = case
    prompt = np.random.default_rng(3).integers(3, VOCAB, 12).tolist()
    assert_greedy_as_transformers(model, cfg, params, prompt, NEW)


def test_multi_token_prediction_layers_are_dropped(case):
    """DeepSeek-V3's files hold a multi-token-prediction layer past the model's (known by its
    eh_proj), which transformers drops on load: so do we; another stray layer is refused."""
    _, path, cfg, params = case
    tensors = hf.read_tensors(path)
    mtp = {f"model.layers.3.{n}": np.ones((4, 4), np.float32)
           for n in ("eh_proj.weight", "enorm.weight", "self_attn.q_a_proj.weight")}
    got = hf_mapping.hf_to_params({**tensors, **mtp}, cfg)
    assert all(np.array_equal(a, b) for a, b in zip(*map(_leaves, (got, params))))
    mtp.pop("model.layers.3.eh_proj.weight")
    with pytest.raises(ValueError, match=r"no place .*model\.layers\.3\."):
        hf_mapping.hf_to_params({**tensors, **mtp}, cfg)


def _leaves(tree: dict) -> list:
    return [np.asarray(leaf) for leaf in __import__("jax").tree.leaves(tree)]


# DeepSeek-V3's own config.json (deepseek-ai/DeepSeek-V3-0324, less auto_map and
# quantization_config), in transformers 4's layout: rope_scaling and rope_theta apart.
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
    "attention_bias": False, "attention_dropout": 0.0, "aux_loss_alpha": 0.001,
    "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid",
    "seq_aux": True, "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}


def test_deepseek_v3_config_reads():
    from jaxtron.config import ModelConfig

    cfg = ModelConfig(**config_json.config_from_hf(DEEPSEEK_V3))
    m, moe = cfg.mla, cfg.moe
    assert (cfg.family, cfg.num_layers, cfg.d_model, cfg.num_heads, cfg.num_kv_heads,
            cfg.mlp_dim) == ("deepseek_v3", 61, 7168, 128, 128, 18432)
    assert (m.kv_lora_rank, m.q_lora_rank, m.qk_nope_head_dim, m.qk_rope_head_dim,
            m.v_head_dim) == (512, 1536, 128, 64, 128)
    assert (moe.num_experts, moe.experts_per_token, moe.mlp_dim, moe.scoring, moe.routed_scale,
            moe.groups, moe.topk_groups, moe.shared_experts, moe.first_dense,
            moe.norm_topk_prob, moe.bias_update_speed) == (
        256, 8, 2048, "sigmoid", 2.5, 8, 4, 1, 3, True, 0.0)
    assert (cfg.rope_scaling_type, cfg.rope_scaling_factor, cfg.rope_original_max_len,
            cfg.rope_beta_fast, cfg.rope_beta_slow, cfg.rope_mscale,
            cfg.rope_mscale_all_dim) == ("yarn", 40.0, 4096, 32.0, 1.0, 1.0, 1.0)
    assert config_json.rope_interleave(DEEPSEEK_V3)  # DeepSeek's own files: interleaved
    no_q = config_json.config_from_hf({**DEEPSEEK_V3, "q_lora_rank": None})["mla"]
    assert no_q.q_lora_rank == 0


@pytest.mark.parametrize("change, match", [
    ({"attention_bias": True}, "attention_bias=true is not supported"),
    ({"hidden_act": "gelu"}, "hidden_act=\"gelu\" is not supported"),
    ({"topk_method": "greedy"}, "topk_method=\"greedy\" is not supported"),
    ({"scoring_func": "softmax"}, "scoring_func=\"softmax\" is not supported"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
    ({"num_key_value_heads": 1}, "num_key_value_heads=1 is not supported"),
    ({"n_shared_experts": 0}, "n_shared_experts=0 is not supported"),
    ({"quantization_config": {"quant_method": "fp8"}}, r"quantized weights .*fp8"),
    ({"rope_scaling": {"type": "llama3", "factor": 8.0}}, "'llama3' is not supported for deep"),
    ({"rope_scaling": {**DEEPSEEK_V3["rope_scaling"], "attention_factor": 1.2}},
     "attention_factor is not supported"),
])
def test_what_we_do_not_compute_is_refused_in_one_line(change, match):
    with pytest.raises(ValueError, match=match) as err:
        config_json.config_from_hf({**DEEPSEEK_V3, **change})
    assert "\n" not in str(err.value)


def test_export_refuses_what_transformers_does_not_compute(case, tmp_path):
    _, _, cfg, params = case
    softmax = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, scoring="softmax"))
    with pytest.raises(hf.model_dir.ConfigError, match="scores experts with a sigmoid"):
        hf.save_pretrained(softmax, params, tmp_path, "deepseek_v3")
