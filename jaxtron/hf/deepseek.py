"""DeepSeek-V3 and -V2 config.json written from jaxtron's model settings (jaxtron/model/
deepseek.py), and what an export refuses; config_json.py reads them. The tensors' names are
jaxtron/hf/mapping.py's (`_deepseek_rows`)."""

from __future__ import annotations

from typing import Any

from jaxtron.config import ConfigError, ModelConfig
from jaxtron.hf.config_json import DEEPSEEK_TYPES as TYPES  # noqa: F401 - the families written

ARCHITECTURES = {"deepseek_v3": "DeepseekV3ForCausalLM", "deepseek_v2": "DeepseekV2ForCausalLM"}


def hf_config(cfg: ModelConfig, model_type: str, context: int | None) -> dict:
    """DeepSeek-V3's or -V2's config.json (the inverse of config_json._deepseek_config): the rope
    dims written interleaved (rope_interleave, as DeepSeek's checkpoints have them), no
    multi-token-prediction layers. `context`: as hf_config; by default YaRN's extended length
    (original length x factor), else 2048."""
    m, moe = cfg.mla, cfg.moe
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    yarn = cfg.rope_scaling_factor > 0
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta,
                "factor": cfg.rope_scaling_factor,
                "original_max_position_embeddings": cfg.rope_original_max_len,
                "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
                **({"mscale": cfg.rope_mscale} if cfg.rope_mscale else {}),
                **({"mscale_all_dim": cfg.rope_mscale_all_dim} if cfg.rope_mscale_all_dim
                   else {})}
    return {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim, "moe_intermediate_size": moe.mlp_dim or cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_heads, "hidden_act": "silu",
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope, "rope_interleave": True,
        "max_position_embeddings": context or (
            int(cfg.rope_original_max_len * cfg.rope_scaling_factor) if yarn else 2048),
        "kv_lora_rank": m.kv_lora_rank, "q_lora_rank": m.q_lora_rank or None,
        "qk_nope_head_dim": m.qk_nope_head_dim, "qk_rope_head_dim": m.qk_rope_head_dim,
        "v_head_dim": m.v_head_dim, "head_dim": m.qk_rope_head_dim,
        "n_routed_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
        "n_shared_experts": moe.shared_experts, "routed_scaling_factor": moe.routed_scale,
        "n_group": moe.groups, "topk_group": moe.topk_groups,
        "first_k_dense_replace": moe.first_dense, "norm_topk_prob": moe.norm_topk_prob,
        "num_nextn_predict_layers": 0, "attention_bias": False, "output_router_logits": False,
        "torch_dtype": cfg.param_dtype,
        **({"topk_method": "group_limited_greedy" if moe.groups > 1 else "greedy"}
           if model_type == "deepseek_v2" else {}),
    }


def check(cfg: ModelConfig, model_type: str) -> None:
    """A model that DeepseekV3ForCausalLM or DeepseekV2ForCausalLM computes (one line naming
    what differs)."""
    arch = ARCHITECTURES[model_type]
    scoring = "sigmoid" if model_type == "deepseek_v3" else "softmax"
    if cfg.moe.scoring != scoring:
        raise ConfigError(f"{arch} scores experts with a {scoring}; model.moe.scoring="
                          f"{cfg.moe.scoring} has no {model_type} equivalent")
    if model_type == "deepseek_v2" and cfg.moe.norm_topk_prob:
        raise ConfigError(f"{arch} never renormalises its top-k router weights; model.moe."
                          "norm_topk_prob=true has no deepseek_v2 equivalent")
    if cfg.moe.shared_experts < 1:
        raise ConfigError(f"{arch} always has shared experts; model.moe."
                          f"shared_experts=0 has no {model_type} equivalent here")
    if cfg.rope_scaling_factor > 0 and cfg.rope_scaling_type != "yarn":
        raise ConfigError(f"{model_type} exports default or yarn RoPE; model.rope_scaling_type="
                          f"{cfg.rope_scaling_type} has no equivalent here")
    if cfg.num_kv_heads != cfg.num_heads:
        raise ConfigError(f"latent attention has a key per head: model.num_kv_heads="
                          f"{cfg.num_kv_heads} must equal model.num_heads={cfg.num_heads}")
