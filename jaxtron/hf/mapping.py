"""Hugging Face tensors <-> jaxtron params, through one name-mapping table, by model.family.

Covers `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` (QKV bias), `Qwen3ForCausalLM`
(q/k norms), `MixtralForCausalLM` and `Qwen3MoeForCausalLM` (experts), each HF `model_type` a
jaxtron family (jaxtron/model/families.py) that an import records; an attention window is kept
as model.sliding_window, which bounds the sequence length (attention is full causal): adding a
family that computes the same function is adding rows or a config reading.
Conversions go one layer at a time (`layer_params`, `hf_layout`), so a converter never needs a
whole stacked weight in memory. Directories and the public API are in `jaxtron.hf`.

Our params are the pure nested dict of `nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs)))`, with
per-layer weights stacked on a leading L axis. HF `nn.Linear` weights are [out, in]; ours are
[in, out] with heads split out. Our RoPE rotates halves exactly as HF Llama does, so q/k need no
permutation (tests/test_hf_parity.py checks logits against transformers itself).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.config import ModelConfig, MoEConfig
from jaxtron.model import abstract_model, family_of

ParamPath = tuple[str, ...]  # keys into our nested param dict
# (HF [out, in]-style array, head size) -> ours, and back.
Transform = tuple[Callable[[np.ndarray, int], np.ndarray], Callable[[np.ndarray, int], np.ndarray]]

COPY: Transform = (lambda x, h: x, lambda y, h: y)
LINEAR: Transform = (lambda x, h: x.T, lambda y, h: y.T)  # [out, in] <-> [in, out]
QKV: Transform = (  # [N*H, D] <-> [D, N, H]
    lambda x, h: x.T.reshape(x.shape[1], -1, h),
    lambda y, h: y.reshape(y.shape[0], -1).T,
)
OUT: Transform = (  # [D, N*H] <-> [N, H, D]
    lambda x, h: x.T.reshape(-1, h, x.shape[0]),
    lambda y, h: y.reshape(-1, y.shape[-1]).T,
)
BIAS: Transform = (lambda x, h: x.reshape(-1, h), lambda y, h: y.reshape(-1))  # [N*H] <-> [N, H]

LAYER = "model.layers.{i}."
# One row per tensor: HF name ({i}: layer index, stacked on our L axis), our path, transform.
MAPPING: tuple[tuple[str, ParamPath, Transform], ...] = (
    ("model.embed_tokens.weight", ("embed",), COPY),
    (LAYER + "input_layernorm.weight", ("layers", "attn_norm", "scale"), COPY),
    (LAYER + "self_attn.q_proj.weight", ("layers", "attn", "wq"), QKV),
    (LAYER + "self_attn.k_proj.weight", ("layers", "attn", "wk"), QKV),
    (LAYER + "self_attn.v_proj.weight", ("layers", "attn", "wv"), QKV),
    (LAYER + "self_attn.q_proj.bias", ("layers", "attn", "bq"), BIAS),  # Qwen2
    (LAYER + "self_attn.k_proj.bias", ("layers", "attn", "bk"), BIAS),  # Qwen2
    (LAYER + "self_attn.v_proj.bias", ("layers", "attn", "bv"), BIAS),  # Qwen2
    (LAYER + "self_attn.o_proj.weight", ("layers", "attn", "wo"), OUT),
    (LAYER + "self_attn.q_norm.weight", ("layers", "attn", "q_norm", "scale"), COPY),  # Qwen3
    (LAYER + "self_attn.k_norm.weight", ("layers", "attn", "k_norm", "scale"), COPY),  # Qwen3
    (LAYER + "post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), COPY),
    ("model.norm.weight", ("final_norm", "scale"), COPY),
    ("lm_head.weight", ("lm_head",), LINEAR),  # absent when embeddings are tied
)
# The MLP, by family: dense, or the experts' tensors one per expert ({j}: stacked on our E axis,
# [L, E, D, F]: the down projection [D, F] as HF stores it, gate and up transposed) and the
# router. An MoE model with q/k norms is Qwen3-MoE's naming, without Mixtral's.
MLPS: dict[str, tuple[tuple[str, ParamPath, Transform], ...]] = {
    "dense": (
        (LAYER + "mlp.gate_proj.weight", ("layers", "mlp", "w_gate"), LINEAR),
        (LAYER + "mlp.up_proj.weight", ("layers", "mlp", "w_up"), LINEAR),
        (LAYER + "mlp.down_proj.weight", ("layers", "mlp", "w_down"), LINEAR),
    ),
    "mixtral": (
        (LAYER + "block_sparse_moe.gate.weight", ("layers", "mlp", "router"), LINEAR),
        (LAYER + "block_sparse_moe.experts.{j}.w1.weight", ("layers", "mlp", "w_gate"), LINEAR),
        (LAYER + "block_sparse_moe.experts.{j}.w3.weight", ("layers", "mlp", "w_up"), LINEAR),
        (LAYER + "block_sparse_moe.experts.{j}.w2.weight", ("layers", "mlp", "w_down"), COPY),
    ),
    "qwen3_moe": (
        (LAYER + "mlp.gate.weight", ("layers", "mlp", "router"), LINEAR),
        (LAYER + "mlp.experts.{j}.gate_proj.weight", ("layers", "mlp", "w_gate"), LINEAR),
        (LAYER + "mlp.experts.{j}.up_proj.weight", ("layers", "mlp", "w_up"), LINEAR),
        (LAYER + "mlp.experts.{j}.down_proj.weight", ("layers", "mlp", "w_down"), COPY),
    ),
}
# Non-parameter buffers some checkpoints carry; recomputed from the config, so dropped.
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe")


def mlp_family(cfg: ModelConfig) -> str:
    """Which MLPS naming `cfg` has: dense, or its family's experts (qwen3_moe, mixtral)."""
    return family_of(cfg) if cfg.moe.num_experts else "dense"


def _hf_names(pattern: str, num_layers: int, num_experts: int = 0) -> list[str]:
    """The concrete HF names of one MAPPING row."""
    if "{i}" not in pattern:
        return [pattern]
    return [pattern.format(i=i, j=j) for i in range(num_layers)
            for j in (range(num_experts) if "{j}" in pattern else [0])]


@functools.lru_cache(maxsize=8)
def expected_shapes(cfg: ModelConfig) -> dict[ParamPath, tuple[int, ...]]:
    """Our param paths and shapes for `cfg` (layers stacked), without allocating anything."""
    pure = nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))
    leaves = jax.tree_util.tree_flatten_with_path(pure)[0]
    return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in leaves}


def rows(cfg: ModelConfig) -> list[tuple[str, ParamPath, Transform]]:
    """The MAPPING rows this config has (no biases without qkv_bias, no head when tied)."""
    shapes = expected_shapes(cfg)
    return [row for row in MAPPING + MLPS[mlp_family(cfg)] if row[1] in shapes]


def nest(flat: dict[ParamPath, Any]) -> dict:
    """{('a', 'b'): x} -> {'a': {'b': x}}."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def check_names(names: Iterable[str], cfg: ModelConfig) -> None:
    """The checkpoint holds every tensor `cfg` needs and nothing else (ValueError naming them)."""
    present = {n for n in names if not IGNORED.search(n)}
    if cfg.tie_embeddings:
        present.discard("lm_head.weight")  # tied checkpoints may still list it: see check_tied
    wanted = [n for pattern, _, _ in rows(cfg)
              for n in _hf_names(pattern, cfg.num_layers, cfg.moe.num_experts)]
    missing = [n for n in wanted if n not in present]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors the config needs: "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    unknown = sorted(present - set(wanted))
    if unknown:
        raise ValueError(f"checkpoint has {len(unknown)} tensors with no place in the model "
                         f"(check model.* against its config.json): {', '.join(unknown[:8])}"
                         f"{' ...' if len(unknown) > 8 else ''}")


def check_tied(names: Iterable[str], get: Callable[[str], np.ndarray], cfg: ModelConfig) -> None:
    """A tied model's `lm_head.weight`, when listed, must be the embedding itself."""
    tied = cfg.tie_embeddings and "lm_head.weight" in set(names)
    if tied and not np.array_equal(get("lm_head.weight"), get("model.embed_tokens.weight")):
        raise ValueError("checkpoint has an lm_head.weight other than its embedding, but its "
                         "config ties them (tie_word_embeddings); set tie_word_embeddings to "
                         "false in config.json")


def _ours(name: str, path: ParamPath, to_ours, get, cfg: ModelConfig, shape) -> np.ndarray:
    value = to_ours(np.asarray(get(name)), cfg.head_size)
    if value.shape != tuple(shape):
        raise ValueError(f"{name} gives {'/'.join(path)} shape {value.shape}, the config "
                         f"expects {tuple(shape)}; check the model.* sizes")
    return value.astype(jnp.dtype(cfg.param_dtype))


def top_params(get: Callable[[str], np.ndarray], cfg: ModelConfig) -> dict[ParamPath, np.ndarray]:
    """The tensors outside the layers (embedding, final norm, head), in our shapes and dtype."""
    shapes = expected_shapes(cfg)
    return {path: _ours(pattern, path, to_ours, get, cfg, shapes[path])
            for pattern, path, (to_ours, _) in rows(cfg) if "{i}" not in pattern}


def layer_params(get: Callable[[str], np.ndarray], cfg: ModelConfig,
                 layer: int) -> dict[ParamPath, np.ndarray]:
    """One layer's tensors in our per-layer shapes (the stacked ones less the L axis) and dtype."""
    shapes = expected_shapes(cfg)
    out = {}
    for pattern, path, (to_ours, _) in rows(cfg):
        if "{j}" in pattern:  # [E, D, F]: one HF tensor per expert
            out[path] = np.stack([_ours(pattern.format(i=layer, j=j), path, to_ours, get, cfg,
                                        shapes[path][2:]) for j in range(cfg.moe.num_experts)])
        elif "{i}" in pattern:
            out[path] = _ours(pattern.format(i=layer), path, to_ours, get, cfg, shapes[path][1:])
    return out


def hf_to_params(hf_tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """HF state dict (name -> array) -> our pure nested param dict, numpy, in cfg.param_dtype."""
    check_names(hf_tensors, cfg)
    check_tied(hf_tensors, hf_tensors.__getitem__, cfg)
    flat = top_params(hf_tensors.__getitem__, cfg)
    layers = [layer_params(hf_tensors.__getitem__, cfg, i) for i in range(cfg.num_layers)]
    flat |= {path: np.stack([layer[path] for layer in layers]) for path in layers[0]}
    return nest(flat)


def hf_layout(cfg: ModelConfig) -> list[tuple[str, ParamPath, int | None, Callable]]:
    """Every HF tensor of `cfg` in checkpoint order: (name, our path, layer index or None for
    unstacked, our array -> HF's). Tied models have no lm_head.weight. An expert's tensor
    takes its layer's [E, D, F] array and picks expert j itself."""
    out = []
    for pattern, path, (_, to_hf) in rows(cfg):
        if "{i}" not in pattern:
            out.append((pattern, path, None, to_hf))
    for i in range(cfg.num_layers):
        for pattern, path, (_, to_hf) in rows(cfg):
            if "{j}" in pattern:
                out += [(pattern.format(i=i, j=j), path, i,
                         lambda y, h, j=j, to_hf=to_hf: to_hf(y[j], h))
                        for j in range(cfg.moe.num_experts)]
            elif "{i}" in pattern:
                out.append((pattern.format(i=i), path, i, to_hf))
    return out


def params_to_hf(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our pure nested param dict -> HF state dict (tied models omit lm_head.weight)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    flat = {tuple(k.key for k in path): np.asarray(leaf) for path, leaf in leaves}
    unknown = sorted("/".join(p) for p in set(flat) - {row[1] for row in rows(cfg)})
    if unknown:
        raise ValueError(f"params with no HF name: {', '.join(unknown)}")
    return {name: to_hf(flat[path] if layer is None else flat[path][layer], cfg.head_size)
            for name, path, layer, to_hf in hf_layout(cfg)}


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
    if kind == "llama3":
        out |= {
            "rope_scaling_factor": _setting(rope, "factor", float, where=where),
            "rope_low_freq_factor": _setting(rope, "low_freq_factor", float, where=where),
            "rope_high_freq_factor": _setting(rope, "high_freq_factor", float, where=where),
            "rope_original_max_len": (_setting(rope, "original_max_position_embeddings", int, 0,
                                               where)
                                      or _setting(hf, "max_position_embeddings", int)),
        }
    elif kind != "default":
        raise ValueError(f"RoPE scaling type '{kind}' is not supported (default and llama3 are)")
    return out


def _check_supported(hf: dict) -> None:
    """Refuse configs whose architecture our Transformer does not compute."""
    kind = hf.get("model_type")
    if kind not in SUPPORTED_TYPES:
        raise ValueError(f"model_type '{kind}' is not supported ({', '.join(SUPPORTED_TYPES)} are)")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act '{hf['hidden_act']}' is not supported (SwiGLU uses silu)")
    if hf.get("mlp_bias") or (kind != "qwen2" and hf.get("attention_bias")):
        raise ValueError("MLP and output-projection biases are not supported")
    if kind == "qwen3_moe" and (hf.get("mlp_only_layers") or
                                _setting(hf, "decoder_sparse_step", int, 1) != 1):
        raise ValueError("dense layers between the MoE layers (mlp_only_layers, "
                         "decoder_sparse_step) are not supported: every layer is MoE here")


def _sliding_window(hf: dict) -> int | None:
    """The attention window transformers applies for this config; None means full causal."""
    # HF Mistral and Mixtral slide whenever sliding_window is set: they have no
    # use_sliding_window switch and ignore one left in config.json. Qwen2 and Qwen3(-MoE) slide
    # only with use_sliding_window=true.
    if hf.get("model_type") in ("mistral", "mixtral") or hf.get("use_sliding_window", False):
        return hf.get("sliding_window")
    return None


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
        "sliding_window": _setting(hf, "sliding_window", int, 0) if _sliding_window(hf) else 0,
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
