"""Gemma 2 and Gemma 3 (text) config.json written from jaxtron's model settings
(jaxtron/model/gemma.py), and what an export refuses; config_json.py reads them. The tensors'
names are jaxtron/hf/mapping.py's (`GEMMA_NORMS`)."""

from __future__ import annotations

from typing import Any

from jaxtron.config import ConfigError, ModelConfig
from jaxtron.hf.config_json import GEMMA_TYPES as TYPES  # noqa: F401 - the families written
from jaxtron.hf.config_json import GLOBAL, LOCAL
from jaxtron.model import windows

ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}


def hf_config(cfg: ModelConfig, model_type: str, context: int | None) -> dict:
    """Gemma's config.json for `cfg` (the inverse of `config_from_hf`), its layer types written
    out. `context`: max_position_embeddings; by default 8192."""
    check(cfg, model_type)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling_factor > 0:
        rope = {"rope_type": "linear", "rope_theta": cfg.rope_theta,
                "factor": cfg.rope_scaling_factor}
    if model_type == "gemma3_text":
        rope = {GLOBAL: rope, LOCAL: {"rope_type": "default",
                                      "rope_theta": cfg.rope_local_theta or cfg.rope_theta}}
    return {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_size, "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": cfg.norm_eps, "tie_word_embeddings": cfg.tie_embeddings,
        "rope_parameters": rope, "max_position_embeddings": context or 8192,
        "query_pre_attn_scalar": cfg.attn_scale_dim or cfg.head_size,
        "attn_logit_softcapping": cfg.attn_softcap or None,
        "final_logit_softcapping": cfg.logit_softcap or None,
        "sliding_window": cfg.sliding_window or None,
        "layer_types": [LOCAL if windows.is_local(cfg, i) else GLOBAL
                        for i in range(cfg.num_layers)],
        "attention_bias": False, "torch_dtype": cfg.param_dtype,
    }


def check(cfg: ModelConfig, model_type: str) -> None:
    """A model that transformers' Gemma family computes (one line naming what differs)."""
    if cfg.rope_scaling_factor > 0 and cfg.rope_scaling_type != "linear":
        raise ConfigError(f"{model_type} exports default or linear RoPE; model."
                          f"rope_scaling_type={cfg.rope_scaling_type} has no equivalent here")
    if model_type == "gemma2" and cfg.rope_local_theta:
        raise ConfigError(f"gemma2 has one RoPE base; model.rope_local_theta="
                          f"{cfg.rope_local_theta} has no gemma2 equivalent")
