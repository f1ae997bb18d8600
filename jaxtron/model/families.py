"""Model families: which module builds each `model.family`, and the settings that make a config
that family. The family names are Hugging Face's `model_type`s, which the checkpoint conversion
reads and writes (jaxtron/hf/). Adding a family is its module (with a `Transformer(cfg, rngs)`)
and one row of FAMILIES; families that compute with the same blocks share a module.

A family's own settings are its typed section of the model config: the expert families take
`model.moe` (MoEConfig), which dense families leave at its defaults. A config without the key
(model.family="", as every config before it) is the family its settings make (`family_of`)."""

from __future__ import annotations

import dataclasses
import importlib

from flax import nnx

from jaxtron.config import ConfigError, ModelConfig


@dataclasses.dataclass(frozen=True)
class Family:
    """One family: its module under jaxtron.model, and the settings it fixes."""

    module: str
    qkv_bias: bool = False  # biases on q, k and v (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head's q and k (Qwen3)
    experts: bool = False  # a mixture of experts in place of the MLP
    latent: bool = False  # multi-head latent attention (model.mla) and DeepSeek-MoE's options
    scoring: str = ""  # the router's scores it fixes (model.moe.scoring), "" any
    post_norms: bool = False  # norms after attention and the MLP too, before the residual add
    sinks: bool = False  # a sink logit per head in the softmax (model.attn_sinks)


FAMILIES = {
    "llama": Family("decoder"),
    "mistral": Family("decoder"),  # Llama's blocks with an attention window (model.sliding_window)
    "qwen2": Family("decoder", qkv_bias=True),
    "qwen3": Family("decoder", qk_norm=True),
    "mixtral": Family("decoder", experts=True),
    "qwen3_moe": Family("decoder", qk_norm=True, experts=True),
    "deepseek_v3": Family("deepseek", experts=True, latent=True, scoring="sigmoid"),
    # DeepSeek-V2: V3's blocks with a softmax router, no balancing bias
    "deepseek_v2": Family("deepseek", experts=True, latent=True, scoring="softmax"),
    "gemma2": Family("gemma", post_norms=True),  # windows, soft caps, four norms a layer, GeGLU
    # Gemma 2's blocks with q/k norms, the windowed layers' own RoPE base, no caps
    "gemma3_text": Family("gemma", qk_norm=True, post_norms=True),
    # biased attention with sinks, biased experts with the clamped SwiGLU, YaRN
    "gpt_oss": Family("gpt_oss", qkv_bias=True, experts=True, sinks=True),
}
# DeepSeek-MoE's options (model.moe) at the values that leave the other families' experts as
# they are
DEEPSEEK_MOE = {"scoring": "softmax", "routed_scale": 1.0, "groups": 1, "topk_groups": 1,
                "shared_experts": 0, "first_dense": 0, "bias_update_speed": 0.0}


def family_of(cfg: ModelConfig) -> str:
    """cfg's family: model.family, or where it is not set the one its settings make (Qwen2:
    QKV biases; Qwen3: q/k norms; Qwen3-MoE: experts with q/k norms; Mixtral: experts;
    Mistral: an attention window; else Llama; gpt-oss: sinks)."""
    if cfg.family:
        return cfg.family
    if cfg.attn_sinks:
        return "gpt_oss"
    if cfg.mla.kv_lora_rank:
        return "deepseek_v2" if cfg.moe.scoring == "softmax" else "deepseek_v3"
    if cfg.moe.num_experts:
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    return ("qwen2" if cfg.qkv_bias else "qwen3" if cfg.qk_norm else
            "mistral" if cfg.sliding_window else "llama")


def check(cfg: ModelConfig) -> None:
    """model.family is a family, and the settings it fixes are cfg's (one line naming the
    setting otherwise)."""
    _check_deepseek(cfg)
    if not cfg.family and not cfg.attn_sinks:
        return
    if cfg.family and cfg.family not in FAMILIES:
        raise ConfigError(f"model.family={cfg.family} is not one of {', '.join(FAMILIES)}")
    family = FAMILIES[family_of(cfg)]
    wrong = [f"model.{key}={str(want).lower()}" for key, want, have in (
        ("qkv_bias", family.qkv_bias, cfg.qkv_bias), ("qk_norm", family.qk_norm, cfg.qk_norm),
        ("attn_sinks", family.sinks, cfg.attn_sinks)) if want != have]
    if family.experts != bool(cfg.moe.num_experts):
        wrong.append("model.moe.num_experts > 0" if family.experts else "model.moe.num_experts=0")
    if family.latent != bool(cfg.mla.kv_lora_rank):
        wrong.append("model.mla.kv_lora_rank > 0" if family.latent else "model.mla.kv_lora_rank=0")
    if family.scoring and cfg.moe.scoring != family.scoring:
        wrong.append(f"model.moe.scoring={family.scoring}")
    if wrong:
        raise ConfigError(f"model.family={family_of(cfg)} needs {' and '.join(wrong)}; set "
                          f"them, or the family these settings make (model.family="
                          f"{_made(cfg)})")


def _check_deepseek(cfg: ModelConfig) -> None:
    """DeepSeek-MoE's options only with latent attention (the deepseek_v3 and deepseek_v2
    families), and within their ranges."""
    moe, m = cfg.moe, cfg.mla
    if cfg.mtp_depth < 0 or cfg.mtp_coef < 0:
        raise ConfigError(f"model.mtp_depth={cfg.mtp_depth} and model.mtp_coef={cfg.mtp_coef} "
                          "must be 0 or more")
    if not m.kv_lora_rank:
        changed = [f"model.moe.{k}={getattr(moe, k)}" for k, v in DEEPSEEK_MOE.items()
                   if getattr(moe, k) != v]
        if cfg.mtp_depth:
            changed.append(f"model.mtp_depth={cfg.mtp_depth}")
        if changed:
            raise ConfigError(f"{changed[0]} is a DeepSeek-V3 option, for model.family="
                              "deepseek_v3 (model.mla.kv_lora_rank > 0); leave it at its default")
        return
    if not moe.num_experts:
        raise ConfigError("model.mla.kv_lora_rank > 0 makes a deepseek_v3 model, which has "
                          "experts: set model.moe.num_experts")
    if m.qk_rope_head_dim % 2 or m.qk_rope_head_dim <= 0:
        raise ConfigError(f"model.mla.qk_rope_head_dim={m.qk_rope_head_dim} must be a positive "
                          "even number (RoPE rotates pairs)")
    if moe.scoring not in ("softmax", "sigmoid"):
        raise ConfigError(f"model.moe.scoring={moe.scoring} is not one of softmax, sigmoid")
    if moe.groups < 1 or moe.num_experts % moe.groups:
        raise ConfigError(f"model.moe.groups={moe.groups} must divide model.moe.num_experts="
                          f"{moe.num_experts}")
    if not 1 <= moe.topk_groups <= moe.groups:
        raise ConfigError(f"model.moe.topk_groups={moe.topk_groups} must be 1 to model.moe."
                          f"groups={moe.groups}")
    if moe.groups > 1 and moe.scoring == "sigmoid" and moe.num_experts // moe.groups < 2:
        raise ConfigError("group-limited routing ranks a group by its two best experts: "
                          f"model.moe.groups={moe.groups} leaves fewer than 2 per group")
    if moe.topk_groups * (moe.num_experts // moe.groups) < moe.experts_per_token:
        raise ConfigError(f"model.moe.topk_groups={moe.topk_groups} groups of "
                          f"{moe.num_experts // moe.groups} experts hold fewer than "
                          f"experts_per_token={moe.experts_per_token}")
    if not 0 <= moe.first_dense < cfg.num_layers:
        raise ConfigError(f"model.moe.first_dense={moe.first_dense} must be 0 to num_layers-1 "
                          f"({cfg.num_layers - 1}): the last layers are the MoE stack")
    if moe.bias_update_speed and moe.scoring != "sigmoid":
        raise ConfigError("model.moe.bias_update_speed > 0 moves the sigmoid router's bias: "
                          "set model.moe.scoring=sigmoid")


def _made(cfg: ModelConfig) -> str:
    return family_of(dataclasses.replace(cfg, family=""))


def model_class(cfg: ModelConfig) -> type:
    """The Transformer class of cfg's family."""
    return importlib.import_module(f"jaxtron.model.{FAMILIES[family_of(cfg)].module}").Transformer


def head_sizes(cfg: ModelConfig) -> tuple[int, int]:
    """The query/key and value head sizes attention runs at (latent attention's differ)."""
    return model_class(cfg).cache_heads(cfg)[1:]


def build(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The model of cfg's family, its weights drawn from `rngs`."""
    return model_class(cfg)(cfg, rngs)


def abstract_model(cfg: ModelConfig) -> nnx.Module:
    """The model's structure with ShapeDtypeStructs for weights: nothing allocated."""
    return nnx.eval_shape(lambda: build(cfg, nnx.Rngs(0)))
