"""gpt-oss config.json written from jaxtron's model settings (jaxtron/model/gpt_oss.py;
config_json.py reads it), with its tensors' names (mapping.MLPS["gpt_oss"]) and the
MXFP4-quantised expert weights of OpenAI's checkpoints dequantised on reading (mxfp4.py). An
export writes every tensor in the files' dtype (bfloat16 by default): never MXFP4."""

from __future__ import annotations

from typing import Any, Callable

from jaxtron.config import ConfigError, ModelConfig
from jaxtron.hf import mxfp4
from jaxtron.hf.config_json import GLOBAL, LOCAL
from jaxtron.model import windows

TYPE = "gpt_oss"
ARCHITECTURES = {TYPE: "GptOssForCausalLM"}
def hf_config(cfg: ModelConfig, context: int | None) -> dict:
    """gpt-oss's config.json for `cfg` (the inverse of `read`), its layer types written out.
    `context`: max_position_embeddings; by default YaRN's extended length, else 4096."""
    check(cfg)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    yarn = cfg.rope_scaling_factor > 0
    if yarn:
        rope = {"rope_type": "yarn", "rope_theta": cfg.rope_theta,
                "factor": cfg.rope_scaling_factor, "beta_fast": cfg.rope_beta_fast,
                "beta_slow": cfg.rope_beta_slow, "truncate": cfg.rope_truncate,
                "original_max_position_embeddings": cfg.rope_original_max_len}
    moe = cfg.moe
    return {
        "architectures": [ARCHITECTURES[TYPE]], "model_type": TYPE,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": moe.mlp_dim or cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_size, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "rope_parameters": rope,
        "max_position_embeddings": context or (
            int(cfg.rope_original_max_len * cfg.rope_scaling_factor) if yarn else 4096),
        "sliding_window": cfg.sliding_window or None,
        "layer_types": [LOCAL if windows.is_local(cfg, i) else GLOBAL
                        for i in range(cfg.num_layers)],
        "num_local_experts": moe.num_experts, "num_experts_per_tok": moe.experts_per_token,
        "router_aux_loss_coef": moe.aux_coef, "output_router_logits": False,
        "swiglu_limit": moe.swiglu_limit, "swiglu_alpha": moe.swiglu_alpha,
        "attention_bias": True, "torch_dtype": cfg.param_dtype,
    }


def check(cfg: ModelConfig) -> None:
    """A model that transformers' gpt-oss computes (one line naming what differs)."""
    if cfg.rope_scaling_factor > 0 and cfg.rope_scaling_type != "yarn":
        raise ConfigError(f"gpt_oss exports default or yarn RoPE; model.rope_scaling_type="
                          f"{cfg.rope_scaling_type} has no equivalent there")
    if cfg.rope_mscale_all_dim or not cfg.moe.swiglu_limit:
        raise ConfigError("gpt_oss exports YaRN without mscale_all_dim and the clamped SwiGLU: "
                          "set model.rope_mscale_all_dim=0 and model.moe.swiglu_limit > 0")


def dequantized(names: list[str], get: Callable) -> tuple[list[str], Callable]:
    """(names, reader) of a checkpoint with each MXFP4 pair X_blocks, X_scales read as the one
    float32 tensor X (`mxfp4.dequantize`); unchanged where there are none."""
    pairs = mxfp4.quantized_names(names)
    if not pairs:
        return names, get
    packed = {name for pair in pairs.values() for name in pair}
    read = lambda name: (mxfp4.dequantize(*(get(n) for n in pairs[name])) if name in pairs
                         else get(name))
    return sorted([n for n in names if n not in packed] + list(pairs)), read
