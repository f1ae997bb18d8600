"""Hugging Face config.json <-> jaxtron's model settings: which `model_type`s are read (each a
jaxtron family, jaxtron/model/families.py), what each key means here, absent keys taking
transformers' defaults, and one line refusing what jaxtron does not compute. The tensors'
names are jaxtron/hf/mapping.py's.
"""

from __future__ import annotations

import json
from typing import Any

from jaxtron.config import MoEConfig
from jaxtron.config.model import MLAConfig

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3",
                   "deepseek_v2", "gemma2", "gemma3_text", "gpt_oss")
GEMMA_TYPES = ("gemma2", "gemma3_text")  # written by jaxtron/hf/gemma.py
DEEPSEEK = "deepseek_v3"
DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v2")  # latent attention and DeepSeek-MoE


def _rope_overrides(hf: dict) -> dict:
    """RoPE fields from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (4)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError("per-layer-type RoPE parameters are not supported")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    where = "rope_parameters." if hf.get("rope_parameters") else "rope_scaling."
    theta = _setting(hf, "rope_theta", float, 10000.0)
    out = {"rope_theta": _setting(rope, "rope_theta", float, theta, where)}
    kind = rope.get("rope_type", rope.get("type", "default"))
    deepseek = hf.get("model_type") in DEEPSEEK_TYPES
    if deepseek and kind not in ("default", "yarn"):
        raise ValueError(f"RoPE scaling type '{kind}' is not supported for {hf['model_type']} "
                         "(default and yarn are)")
    if kind == "llama3":
        out |= {
            "rope_scaling_factor": _setting(rope, "factor", float, where=where),
            "rope_low_freq_factor": _setting(rope, "low_freq_factor", float, where=where),
            "rope_high_freq_factor": _setting(rope, "high_freq_factor", float, where=where),
            "rope_original_max_len": (_setting(rope, "original_max_position_embeddings", int, 0,
                                               where)
                                      or _setting(hf, "max_position_embeddings", int)),
        }
    elif kind == "yarn" and (deepseek or hf.get("model_type") == "gpt_oss"):
        out |= _yarn(rope, hf, where)
    elif kind == "linear" and hf.get("model_type") == "gemma3_text":
        out |= {"rope_scaling_factor": _setting(rope, "factor", float, where=where),
                "rope_scaling_type": "linear"}
    elif kind != "default":
        raise ValueError(f"RoPE scaling type '{kind}' is not supported (default and llama3 are; "
                         "yarn for deepseek_v3, deepseek_v2 and gpt_oss only)")
    return out


def _yarn(rope: dict, hf: dict, where: str) -> dict:
    """YaRN's fields as transformers' _compute_yarn_parameters reads them (beta_fast 32 and
    beta_slow 1 when absent or 0; mscale and mscale_all_dim count only when set, so absent is
    0 here), for DeepSeek-V3 (whose softmax scale takes mscale_all_dim too) and gpt-oss (its
    correction range untruncated)."""
    if rope.get("attention_factor") is not None:
        raise ValueError(f"{where}attention_factor is not supported (the factor is computed "
                         "from factor, mscale and mscale_all_dim)")
    return {
        "rope_scaling_type": "yarn",
        "rope_truncate": _setting(rope, "truncate", bool, True, where),
        "rope_scaling_factor": _setting(rope, "factor", float, where=where),
        "rope_original_max_len": (_setting(rope, "original_max_position_embeddings", int, 0,
                                           where)
                                  or _setting(hf, "max_position_embeddings", int)),
        "rope_beta_fast": _setting(rope, "beta_fast", float, 0.0, where) or 32.0,
        "rope_beta_slow": _setting(rope, "beta_slow", float, 0.0, where) or 1.0,
        "rope_mscale": _setting(rope, "mscale", float, 0.0, where),
        "rope_mscale_all_dim": _setting(rope, "mscale_all_dim", float, 0.0, where),
    }


def _check_supported(hf: dict) -> None:
    """Refuse configs whose architecture our Transformer does not compute."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"model_type '{kind}' is not supported ({', '.join(SUPPORTED_TYPES)} are)")
    if kind in DEEPSEEK_TYPES:
        _check_deepseek(hf)
    if kind in (*GEMMA_TYPES, "gpt_oss"):  # read by their own readers
        return
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act '{hf['hidden_act']}' is not supported (SwiGLU uses silu)")
    if hf.get("mlp_bias") or (kind != "qwen2" and hf.get("attention_bias")):
        raise ValueError("MLP and output-projection biases are not supported")
    if kind == "qwen3_moe" and (hf.get("mlp_only_layers") or
                                _setting(hf, "decoder_sparse_step", int, 1) != 1):
        raise ValueError("dense layers between the MoE layers (mlp_only_layers, "
                         "decoder_sparse_step) are not supported: every layer is MoE here")


# DeepSeek-V3 config.json keys (the DeepSeek remote code's) that must hold these values to
# compute what jaxtron does; absent keys are transformers' (which reads none of them)
DEEPSEEK_FIXED = {"topk_method": "noaux_tc", "scoring_func": "sigmoid", "moe_layer_freq": 1,
                  "attention_bias": False, "mlp_bias": False, "hidden_act": "silu"}
# DeepSeek-V2's: a softmax router, its top-k greedy or group-limited greedy (`V2_ROUTING`)
V2_FIXED = {"scoring_func": "softmax", "moe_layer_freq": 1, "attention_bias": False,
            "mlp_bias": False, "hidden_act": "silu"}
V2_ROUTING = ("greedy", "group_limited_greedy")


def _check_deepseek(hf: dict) -> None:
    """Refuse DeepSeek-V3 and -V2 configs our families of those names do not compute (one
    line)."""
    kind = hf["model_type"]
    for key, want in (DEEPSEEK_FIXED if kind == DEEPSEEK else V2_FIXED).items():
        if key in hf and hf[key] != want:
            raise ValueError(f"{key}={json.dumps(hf[key])} is not supported for {kind} "
                             f"(only {json.dumps(want)} is)")
    if kind != DEEPSEEK and hf.get("topk_method", "greedy") not in V2_ROUTING:
        raise ValueError(f"topk_method={json.dumps(hf['topk_method'])} is not supported for "
                         f"{kind} ({', '.join(V2_ROUTING)} are)")
    if hf.get("quantization_config"):
        method = hf["quantization_config"].get("quant_method", "?") if isinstance(
            hf["quantization_config"], dict) else "?"
        raise ValueError(f"quantized weights (quantization_config, {method}) are not supported; "
                         "convert the checkpoint to bfloat16 first")
    _setting(hf, "rope_interleave", bool, True)  # read by rope_interleave
    heads = _setting(hf, "num_attention_heads", int)
    if _setting(hf, "num_key_value_heads", int, heads) != heads:
        raise ValueError(f"num_key_value_heads={hf['num_key_value_heads']} is not supported for "
                         f"{kind}: latent attention has a key per head "
                         f"(num_attention_heads={heads})")
    if _setting(hf, "n_shared_experts", int, 1) < 1:
        raise ValueError(f"n_shared_experts=0 is not supported for {kind} (transformers "
                         "keeps empty shared-expert tensors, jaxtron none)")


def _sliding_window(hf: dict) -> int | None:
    """The attention window transformers applies for this config; None means full causal."""
    # HF Mistral and Mixtral slide whenever sliding_window is set: they have no
    # use_sliding_window switch and ignore one left in config.json. Qwen2 and Qwen3(-MoE) slide
    # only with use_sliding_window=true.
    if hf.get("model_type") in ("mistral", "mixtral", *GEMMA_TYPES) or hf.get(
            "use_sliding_window", False):
        return hf.get("sliding_window")
    return None


def _window_pattern(hf: dict) -> dict:
    """model.sliding_window and model.global_every of the layers transformers windows: its
    `layer_types` (written by transformers 5), else every layer, or for Qwen2 and Qwen3 the
    layers from max_window_layers on. ValueError for a pattern jaxtron does not run."""
    if not _sliding_window(hf):
        return {"sliding_window": 0}
    window, layers = _setting(hf, "sliding_window", int), _setting(hf, "num_hidden_layers", int)
    local = [True] * layers
    if hf["model_type"] in ("qwen2", "qwen3"):
        local = [i >= _setting(hf, "max_window_layers", int, 28) for i in range(layers)]
    if isinstance(hf.get("layer_types"), list):
        local = [kind == "sliding_attention" for kind in hf["layer_types"]]
    if not any(local):
        return {"sliding_window": 0}
    for every in (0, *range(2, layers + 1)):
        if local == [not every or (i + 1) % every != 0 for i in range(layers)]:
            return {"sliding_window": window, "global_every": every}
    raise ValueError(f"the windowed layers {[i for i, kind in enumerate(local) if kind]} of "
                     f"{layers} are not a pattern jaxtron runs (every layer, or all but every "
                     "n-th)")


_REQUIRED = object()
_KINDS = {int: "an integer", float: "a number", bool: "true or false"}


def _setting(hf: dict, key: str, kind: type, default: Any = _REQUIRED, where: str = "") -> Any:
    """config.json's `key` (in the `where` section) as `kind` (a float may be written as an
    integer); `default` when it is absent or null. ValueError naming the key, its value and the
    type it needs otherwise."""
    value = hf.get(key)
    key = where + key
    if value is None:
        if default is _REQUIRED:
            raise ValueError(f"{key} is missing; add it ({_KINDS[kind]})")
        return default
    wanted = (bool,) if kind is bool else (int,) if kind is int else (int, float)
    if isinstance(value, bool) != (kind is bool) or not isinstance(value, wanted):
        raise ValueError(f"{key} is {json.dumps(value)}, {_kind_of(value)}; it must be "
                         f"{_KINDS[kind]}")
    return kind(value)


def _kind_of(value: Any) -> str:
    """'a string', 'a list' ...: what a JSON value is, in words."""
    return {str: "a string", bool: "true or false", int: "an integer", float: "a number",
            list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def config_from_hf(hf_config: dict) -> dict:
    """HF config.json dict -> our `model.*` settings (ModelConfig field names; model.moe as a
    MoEConfig)."""
    hf = hf_config
    if hf.get("model_type") is None:
        raise ValueError(f"model_type is missing; add the family ({', '.join(SUPPORTED_TYPES)})")
    _check_supported(hf)
    if hf["model_type"] in DEEPSEEK_TYPES:
        return _deepseek_config(hf)
    if hf["model_type"] in GEMMA_TYPES:
        return _gemma_config(hf)
    if hf["model_type"] == "gpt_oss":
        return _gpt_oss_config(hf)
    heads = _setting(hf, "num_attention_heads", int)
    hidden = _setting(hf, "hidden_size", int)
    _setting(hf, "max_position_embeddings", int, 0)  # read by the callers
    return {
        "family": hf["model_type"],
        "vocab_size": _setting(hf, "vocab_size", int),
        "num_layers": _setting(hf, "num_hidden_layers", int),
        "d_model": hidden,
        "num_heads": heads,
        "num_kv_heads": _setting(hf, "num_key_value_heads", int, 0) or heads,
        "head_dim": _setting(hf, "head_dim", int, 0) or hidden // heads,
        "mlp_dim": _setting(hf, "intermediate_size", int),
        "norm_eps": _setting(hf, "rms_norm_eps", float, 1e-6),
        "tie_embeddings": _setting(hf, "tie_word_embeddings", bool, False),
        "qkv_bias": hf["model_type"] == "qwen2",
        "qk_norm": hf["model_type"] in ("qwen3", "qwen3_moe"),
        **_window_pattern(hf),
        **_rope_overrides(hf),
        **_experts(hf),
    }


def _experts(hf: dict) -> dict:
    """model.moe of a mixture of experts (Mixtral, Qwen3-MoE); {} for dense families. Mixtral's
    softmax over its top-k logits is ours with the top-k renormalized."""
    kind = hf["model_type"]
    if kind not in ("mixtral", "qwen3_moe"):
        return {}
    experts = _setting(hf, "num_local_experts", int, 0) or _setting(hf, "num_experts", int)
    return {"moe": MoEConfig(
        num_experts=experts,
        experts_per_token=_setting(hf, "num_experts_per_tok", int),
        mlp_dim=_setting(hf, "moe_intermediate_size", int) if kind == "qwen3_moe" else 0,
        norm_topk_prob=kind == "mixtral" or _setting(hf, "norm_topk_prob", bool, False),
        # transformers' default when the key is absent: MixtralConfig and Qwen3MoeConfig both
        # say router_aux_loss_coef: float = 0.001 (transformers 5.24)
        aux_coef=_setting(hf, "router_aux_loss_coef", float, 0.001),
    )}


def _deepseek_config(hf: dict) -> dict:
    """DeepSeek-V3's or -V2's config.json -> our model.* settings, absent keys taking
    DeepseekV3Config's or DeepseekV2Config's defaults (transformers 5.24), as transformers does.
    The router's balancing bias (V3) is a checkpoint tensor and is not moved in training
    (bias_update_speed 0), and transformers computes no auxiliary loss for either (aux_coef
    0). V2's router: softmax scores, never renormalised over the top k (transformers reads no
    norm_topk_prob), its groups ranked by their best score (`moe.within_groups`)."""
    v3 = hf["model_type"] == DEEPSEEK
    heads = _setting(hf, "num_attention_heads", int)
    nope = _setting(hf, "qk_nope_head_dim", int, 128)
    rope = _setting(hf, "qk_rope_head_dim", int, 64)
    experts = _setting(hf, "n_routed_experts", int, 0) or _setting(hf, "num_local_experts", int,
                                                                   256 if v3 else 64)
    # q_lora_rank: null is no compression; absent is the default 1536
    q_rank = _setting(hf, "q_lora_rank", int, 0) if "q_lora_rank" in hf else 1536
    if v3:
        routing = {"norm_topk_prob": _setting(hf, "norm_topk_prob", bool, True),
                   "scoring": "sigmoid",
                   "routed_scale": _setting(hf, "routed_scaling_factor", float, 2.5),
                   "groups": _setting(hf, "n_group", int, 8),
                   "topk_groups": _setting(hf, "topk_group", int, 4)}
    else:
        grouped = hf.get("topk_method", "greedy") == "group_limited_greedy"
        routing = {"norm_topk_prob": False, "scoring": "softmax",
                   "routed_scale": _setting(hf, "routed_scaling_factor", float, 1.0),
                   "groups": _setting(hf, "n_group", int) if grouped else 1,
                   "topk_groups": _setting(hf, "topk_group", int) if grouped else 1}
    return {
        "family": hf["model_type"],
        "vocab_size": _setting(hf, "vocab_size", int),
        "num_layers": _setting(hf, "num_hidden_layers", int),
        "d_model": _setting(hf, "hidden_size", int),
        "num_heads": heads,
        "num_kv_heads": heads,
        "head_dim": nope + rope,
        "mlp_dim": _setting(hf, "intermediate_size", int),
        "norm_eps": _setting(hf, "rms_norm_eps", float, 1e-6),
        "tie_embeddings": _setting(hf, "tie_word_embeddings", bool, False),
        **_rope_overrides(hf),
        "mla": MLAConfig(kv_lora_rank=_setting(hf, "kv_lora_rank", int, 512), q_lora_rank=q_rank,
                         qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                         v_head_dim=_setting(hf, "v_head_dim", int, 128)),
        "moe": MoEConfig(
            num_experts=experts,
            experts_per_token=_setting(hf, "num_experts_per_tok", int, 8),
            mlp_dim=_setting(hf, "moe_intermediate_size", int, 2048 if v3 else 1407),
            **routing,
            shared_experts=_setting(hf, "n_shared_experts", int, 1 if v3 else 2),
            first_dense=_setting(hf, "first_k_dense_replace", int, 3 if v3 else 0),
            bias_update_speed=0.0,
            aux_coef=0.0,
        ),
    }


_SHARED = {"hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
           "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
           "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-6,
           "tie_word_embeddings": True, "query_pre_attn_scalar": 256, "sliding_window": 4096,
           "attention_bias": False}
GEMMA_DEFAULTS = {
    "gemma2": {**_SHARED, "vocab_size": 256000, "max_position_embeddings": 8192,
               "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0},
    "gemma3_text": {**_SHARED, "vocab_size": 262208, "max_position_embeddings": 131072,
                    "final_logit_softcapping": None, "attn_logit_softcapping": None},
}
LOCAL, GLOBAL = "sliding_attention", "full_attention"


def _gemma_config(hf_config: dict) -> dict:
    """Gemma 2's or Gemma 3's config.json -> our model.* settings, absent keys taking
    transformers 5.24's Gemma2Config and Gemma3TextConfig defaults (GEMMA_DEFAULTS)."""
    kind = hf_config["model_type"]
    hf = {**GEMMA_DEFAULTS[kind], **{k: v for k, v in hf_config.items() if v is not None
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
        **_window_pattern({**hf, "use_sliding_window": True}),
        **_gemma_rope(hf, kind),
    }


def _gemma_rope(hf: dict, kind: str) -> dict:
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


# GptOssConfig's defaults (transformers 5.24), for keys a config.json leaves out
GPT_OSS_DEFAULTS = {"num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088,
            "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64,
            "num_attention_heads": 64, "num_key_value_heads": 8, "sliding_window": 128,
            "tie_word_embeddings": False, "hidden_act": "silu", "rms_norm_eps": 1e-5,
            "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
            "router_aux_loss_coef": 0.001, "attention_bias": True, "rope_theta": 150000.0,
            "max_position_embeddings": 131072}
GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": 4096}


def _gpt_oss_config(hf_config: dict) -> dict:
    """gpt-oss's config.json -> our model.* settings, absent keys taking GPT_OSS_DEFAULTS."""
    hf = {**GPT_OSS_DEFAULTS, **{k: v for k, v in hf_config.items() if v is not None}}
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
        hf["rope_parameters"] = {**GPT_OSS_ROPE, "rope_theta": hf["rope_theta"]}
    heads = _setting(hf, "num_attention_heads", int)
    return {
        "family": "gpt_oss",
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


def rope_interleave(hf: dict) -> bool:
    """Whether a DeepSeek-V3 config.json's RoPE dims come in interleaved pairs (transformers'
    rope_interleave, default true as DeepSeek's own checkpoints have them); DeepSeek-V2's
    always do (transformers rotates them as complex pairs); false elsewhere."""
    if hf.get("model_type") == "deepseek_v2":
        return True
    if hf.get("model_type") != DEEPSEEK:
        return False
    return _setting(hf, "rope_interleave", bool, True)
