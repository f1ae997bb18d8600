"""DeepSeek-V2 to and from Hugging Face (jaxtron/hf: DeepseekV2ForCausalLM <-> family
deepseek_v2, the deepseek_v3 family's blocks with a softmax router).

Each case is a random tiny DeepseekV2ForCausalLM (float32, every weight randomised) saved by
transformers and read with jaxtron.hf.from_pretrained: our logits and greedy continuations equal
transformers', and written back the checkpoint is the same, tensor for tensor. V2's router:
softmax scores, never renormalised over the top k, times routed_scaling_factor; greedy top-k
(V2-Lite) or group-limited greedy, its groups ranked by their best score (V3 ranks by the sum
of the best two). Dims no other test uses: 3 layers (the first dense), 12 experts, 2 heads.
"""


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
from jaxtron.model import moe

VOCAB, SEQ, NEW = 104, 36, 8
TINY = dict(vocab_size=VOCAB, hidden_size=40, intermediate_size=56, moe_intermediate_size=12,
            num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=20,
            qk_nope_head_dim=10, qk_rope_head_dim=6, v_head_dim=8, n_routed_experts=12,
            num_experts_per_tok=4, first_k_dense_replace=1, rms_norm_eps=1e-6,
            max_position_embeddings=64, attn_implementation="eager", bos_token_id=1,
            eos_token_id=2)
CASES = {
    # V2-Lite's routing: q projected directly, greedy top-k, 2 shared experts, unscaled
    "lite": dict(q_lora_rank=None, topk_method="greedy", n_shared_experts=2,
                 routed_scaling_factor=1.0,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    # V2's: q compressed, 4 groups of 3 of which 2 are kept, scaled, 1 shared expert, YaRN
    "grouped": dict(q_lora_rank=16, topk_method="group_limited_greedy", n_group=4, topk_group=2,
                    n_shared_experts=1, routed_scaling_factor=3.0,
                    rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                     "original_max_position_embeddings": 16, "beta_fast": 32.0,
                                     "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}),
}


def _hf_model(overrides: dict):
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(1)
    model = DeepseekV2ForCausalLM(DeepseekV2Config(**{**TINY, **overrides})).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("norm.weight")
                    else 0.3 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    """(case name, HF model, its directory as transformers saves it, our config and params)."""
    model = _hf_model(CASES[request.param])
    path = tmp_path_factory.mktemp(request.param)
    return request.param, model, path, *saved_and_read(model, path)


def _tokens(batch: int = 2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.random.default_rng(seed).integers(3, VOCAB, (batch, SEQ), np.int32)
    return tokens, np.tile(np.arange(SEQ, dtype=np.int32), (batch, 1))


def test_logits_equal_transformers(case):
    name, model, _, cfg, params = case
    assert cfg.family == "deepseek_v2" and cfg.moe.scoring == "softmax"
    assert not cfg.moe.norm_topk_prob and "router_bias" not in params["layers"]["mlp"]
    assert (cfg.moe.groups, cfg.moe.topk_groups) == ((4, 2) if name == "grouped" else (1, 1))
    assert logit_diff(model, cfg, params, *_tokens()) < HF_TOL


def test_groups_are_ranked_by_their_best_score(case, monkeypatch):
    """Ranked as V3 ranks them (the sum of their two best scores), the grouped case's experts
    differ and its logits miss transformers' by far more than HF_TOL."""
    name, model, _, cfg, params = case
    if name != "grouped":
        pytest.skip("greedy routing has no groups")
    ranked = moe.within_groups
    monkeypatch.setattr(moe, "within_groups",
                        lambda c, g, k, best=2: ranked(c, g, k, best=2))
    tokens, positions = _tokens(batch=3, seed=7)  # a shape of its own: traced afresh
    diff = np.abs(hf.logits(cfg, params, tokens) - hf_logits(model, tokens, positions)).max()
    assert diff > 100 * HF_TOL, diff


def test_export_is_the_checkpoint_transformers_saved(case, tmp_path):
    """Import then export: the checkpoint transformers saved, which it loads as a
    DeepseekV2ForCausalLM computing the same logits (helpers.assert_exported_as_read)."""
    _, model, path, cfg, params = case
    assert_exported_as_read(model, path, cfg, params, tmp_path / "out", "deepseek_v2",
                            *_tokens())


def test_greedy_generation_equals_transformers(case):
    _, model, _, cfg, params = case
    prompt = np.random.default_rng(5).integers(3, VOCAB, 10).tolist()
    assert_greedy_as_transformers(model, cfg, params, prompt, NEW)


@pytest.mark.parametrize("change, match", [
    ({"topk_method": "noaux_tc"}, "topk_method=\"noaux_tc\" is not supported for deepseek_v2"),
    ({"scoring_func": "sigmoid"}, "scoring_func=\"sigmoid\" is not supported for deepseek_v2"),
    ({"n_shared_experts": 0}, "n_shared_experts=0 is not supported for deepseek_v2"),
])
def test_what_v2_computes_otherwise_is_refused_in_one_line(change, match):
    base = {"model_type": "deepseek_v2", "vocab_size": 64, "hidden_size": 16,
            "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_experts_per_tok": 2}
    assert_config_refused({**base, **change}, match)


def test_export_refuses_renormalised_weights(case, tmp_path):
    import dataclasses

    _, _, _, cfg, params = case
    normed = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, norm_topk_prob=True))
    with pytest.raises(hf.model_dir.ConfigError, match="never renormalises"):
        hf.save_pretrained(normed, params, tmp_path, "deepseek_v2")
