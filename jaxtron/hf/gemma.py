"""Gemma 2 and Gemma 3 (text) config.json <-> jaxtron's model settings (jaxtron/model/gemma.py),
absent keys taking transformers 5.24's Gemma2Config and Gemma3TextConfig defaults, as
transformers reads them. The tensors' names are jaxtron/hf/mapping.py's (`GEMMA_NORMS`)."""

from __future__ import annotations

from typing import Any

from jaxtron.config import ConfigError, ModelConfig
from jaxtron.hf import config_json
from jaxtron.hf.config_json import _rope_overrides, _setting
from jaxtron.model import windows

TYPES = ("gemma2", "gemma3_text")
ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
_SHARED = {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
           "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
           "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
           "attention_bias": False}
DEFAULTS = {
    "gemma2": {**_SHARED, "vocab_size": 256000, "max_position_embeddings": 8192,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": {**_SHARED, "vocab_size": 262208, "max_position_embeddings": 131072,
                    "final_logit_softcapping": None, "attn_logit_softcapping": None},
}
LOCAL, GLOBAL = "sliding_attention", "full_attention"


def config_from_hf(hf_config: dict) -> dict:
    """Gemma's config.json -> our model.* settings."""
    kind = hf_config["model_type"]
    hf = {**DEFAULTS[kind], **{k: v for k, v in hf_config.items() if v is not None
                                or k.endswith("softcapping")}}
    if hf["hidden_activation"] != "gelu_pytorch_tanh":
        raise ValueError(f"hidden_activation '{hf['hidden_activation']}' is not supported "
                         "(Gemma's GeGLU uses gelu_pytorch_tanh)")
    if hf.get("attention_bias") or hf.get("use_bidirectional_attention"):
        raise ValueError("attention biases and bidirectional attention are not supported")
    layers = _setting(hf, "num_hidden_layers", int)
    if not isinstance(hf.get("layer_types"), list):  # transformers' pattern from its default
        every = 2 if kind == "gemma2" else _setting(hf, "sliding_window_pattern", int, 6)
        hf["layer_types"] = [LOCAL if (i + 1) % every else GLOBAL for i in range(layers)]
    heads = _setting(hf, "num_attention_heads", int)
    return {
        "family": kind,
        "vocab_size": _setting(hf, "vocab_size", int),
        "num_layers": layers,
        "d_model": _setting(hf, "hidden_size", int),
        "num_heads": heads,
        "num_kv_heads": _setting(hf, "num_key_value_heads", int, heads),
        "head_dim": _setting(hf, "head_dim", int),
        "mlp_dim": _setting(hf, "intermediate_size", int),
        "norm_eps": _setting(hf, "rms_norm_eps", float),
        "tie_embeddings": _setting(hf, "tie_word_embeddings", bool),
        "qk_norm": kind == "gemma3_text",
        "attn_scale_dim": _setting(hf, "query_pre_attn_scalar", int),
        "attn_softcap": _setting(hf, "attn_logit_softcapping", float, 0.0),
        "logit_softcap": _setting(hf, "final_logit_softcapping", float, 0.0),
        **config_json._window_pattern({**hf, "use_sliding_window": True}),
        **_rope(hf, kind),
    }


def _rope(hf: dict, kind: str) -> dict:
    """The global layers' RoPE as our rope_* fields, and Gemma 3's windowed layers' base
    (model.rope_local_theta): per layer type in rope_parameters (transformers 5), or rope_theta
    with rope_scaling and rope_local_base_freq (transformers 4)."""
    params = hf.get("rope_parameters") or {}
    if kind == "gemma2":
        return _rope_overrides(hf)
    if isinstance(params.get(GLOBAL), dict):
        local = params.get(LOCAL) or {}
        if local.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters.{LOCAL}.rope_type '{local['rope_type']}' is not "
                             "supported (default is)")
        out = _rope_overrides({**hf, "rope_parameters": params[GLOBAL]})
        return {**out, "rope_local_theta": _setting(local, "rope_theta", float, 10000.0,
                                                    f"rope_parameters.{LOCAL}.")}
    out = _rope_overrides({**hf, "rope_parameters": None,
                           "rope_theta": hf.get("rope_theta", 1_000_000.0)})
    return {**out, "rope_local_theta": _setting(hf, "rope_local_base_freq", float, 10000.0)}


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
