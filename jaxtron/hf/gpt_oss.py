"""gpt-oss config.json read into and written from jaxtron's model settings (jaxtron/model/
gpt_oss.py), with its tensors' names (mapping.MLPS["gpt_oss"]) and the MXFP4-quantised expert
weights of OpenAI's checkpoints dequantised on reading (mxfp4.py). An export writes every
tensor in the files' dtype (bfloat16 by default): never MXFP4."""

from __future__ import annotations

from typing import Any, Callable

from jaxtron.config import ConfigError, ModelConfig, MoEConfig
from jaxtron.hf import mxfp4
from jaxtron.hf.config_json import GLOBAL, LOCAL, _rope_overrides, _setting, _window_pattern
from jaxtron.model import windows

TYPE = "gpt_oss"
ARCHITECTURES = {TYPE: "GptOssForCausalLM"}
# GptOssConfig's defaults (transformers 5.24), for keys a config.json leaves out
DEFAULTS = {"num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088,
            "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
            "num_attention_heads": 64, "num_key_value_heads": 8, "sliding_window": 128,
            "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
            "router_aux_loss_coef": 0.001, "attention_bias": True, "rope_theta": 150000.0,
            "max_position_embeddings": 131072}
DEFAULT_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


def read(hf_config: dict) -> dict:
    """gpt-oss's config.json -> our model.* settings, absent keys taking DEFAULTS."""
    hf = {**DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None}}
    if hf["hidden_act"] != "silu" or not hf["attention_bias"]:
        raise ValueError("gpt_oss with hidden_act other than silu or without attention biases "
                         "is not supported")
    quantized = hf.get("quantization_config")
    if quantized and (not isinstance(quantized, dict) or quantized.get("quant_method") != "mxfp4"):
        raise ValueError("quantization_config other than mxfp4 is not supported for gpt_oss")
    layers = _setting(hf, "num_hidden_layers", int)
    if not isinstance(hf.get("layer_types"), list):
        hf["layer_types"] = [LOCAL if (i + 1) % 2 else GLOBAL for i in range(layers)]
    if not hf.get("rope_parameters") and not hf.get("rope_scaling"):
        hf["rope_parameters"] = {**DEFAULT_ROPE, "rope_theta": hf["rope_theta"]}
    heads = _setting(hf, "num_attention_heads", int)
    return {
        "family": TYPE,
        "vocab_size": _setting(hf, "vocab_size", int),
        "num_layers": layers,
        "d_model": _setting(hf, "hidden_size", int),
        "num_heads": heads,
        "num_kv_heads": _setting(hf, "num_key_value_heads", int),
        "head_dim": _setting(hf, "head_dim", int),
        "mlp_dim": _setting(hf, "intermediate_size", int),
        "norm_eps": _setting(hf, "rms_norm_eps", float),
        "tie_embeddings": _setting(hf, "tie_word_embeddings", bool),
        "qkv_bias": True,
        "attn_sinks": True,
        **_window_pattern({**hf, "use_sliding_window": True}),
        **_rope_overrides(hf),
        "moe": MoEConfig(num_experts=_setting(hf, "num_local_experts", int),
                         experts_per_token=_setting(hf, "num_experts_per_tok", int),
                         norm_topk_prob=True,
                         aux_coef=_setting(hf, "router_aux_loss_coef", float),
                         swiglu_limit=_setting(hf, "swiglu_limit", float),
                         swiglu_alpha=_setting(hf, "swiglu_alpha", float)),
    }


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
