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


FAMILIES = {
    "llama": Family("decoder"),
    "mistral": Family("decoder"),  # Llama's blocks with an attention window (model.sliding_window)
    "qwen2": Family("decoder", qkv_bias=True),
    "qwen3": Family("decoder", qk_norm=True),
    "mixtral": Family("decoder", experts=True),
    "qwen3_moe": Family("decoder", qk_norm=True, experts=True),
}


def family_of(cfg: ModelConfig) -> str:
    """cfg's family: model.family, or where it is not set the one its settings make (Qwen2:
    QKV biases; Qwen3: q/k norms; Qwen3-MoE: experts with q/k norms; Mixtral: experts;
    Mistral: an attention window; else Llama)."""
    if cfg.family:
        return cfg.family
    if cfg.moe.num_experts:
        return "qwen3_moe" if cfg.qk_norm else "mixtral"
    return ("qwen2" if cfg.qkv_bias else "qwen3" if cfg.qk_norm else
            "mistral" if cfg.sliding_window else "llama")


def check(cfg: ModelConfig) -> None:
    """model.family is a family, and the settings it fixes are cfg's (one line naming the
    setting otherwise)."""
    if not cfg.family:
        return
    if cfg.family not in FAMILIES:
        raise ConfigError(f"model.family={cfg.family} is not one of {', '.join(FAMILIES)}")
    family = FAMILIES[cfg.family]
    wrong = [f"model.{key}={str(want).lower()}" for key, want, have in (
        ("qkv_bias", family.qkv_bias, cfg.qkv_bias), ("qk_norm", family.qk_norm, cfg.qk_norm))
        if want != have]
    if family.experts != bool(cfg.moe.num_experts):
        wrong.append("model.moe.num_experts > 0" if family.experts else "model.moe.num_experts=0")
    if wrong:
        raise ConfigError(f"model.family={cfg.family} needs {' and '.join(wrong)}; set them, or "
                          f"the family these settings make (model.family={_made(cfg)})")


def _made(cfg: ModelConfig) -> str:
    return family_of(dataclasses.replace(cfg, family=""))


def build(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.Module:
    """The model of cfg's family, its weights drawn from `rngs`."""
    module = importlib.import_module(f"jaxtron.model.{FAMILIES[family_of(cfg)].module}")
    return module.Transformer(cfg, rngs)


def abstract_model(cfg: ModelConfig) -> nnx.Module:
    """The model's structure with ShapeDtypeStructs for weights: nothing allocated."""
    return nnx.eval_shape(lambda: build(cfg, nnx.Rngs(0)))
