"""Hugging Face tensors <-> jaxtron params, through one name-mapping table, by model.family.

Covers `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` (QKV bias), `Qwen3ForCausalLM`
(q/k norms), `MixtralForCausalLM`, `Qwen3MoeForCausalLM` (experts) and `DeepseekV3ForCausalLM`
(latent attention, shared experts, dense first layers), each HF `model_type` a jaxtron family
(jaxtron/model/families.py) that an import records; an attention window is kept as
model.sliding_window, which bounds the sequence length (attention is full causal): adding a
family that computes the same function is adding rows or a config reading.
Conversions go one layer at a time (`layer_params`, `hf_layout`), so a converter never needs a
whole stacked weight in memory. Directories and the public API are in `jaxtron.hf`.

Our params are the pure nested dict of `nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs)))`, with
per-layer weights stacked on a leading L axis, in one stack (`layers`) or, for DeepSeek-V3, two
(`dense_layers`, then `layers`: `layer_slot`). HF `nn.Linear` weights are [out, in]; ours are
[in, out] with heads split out. Our RoPE rotates halves exactly as HF Llama does, so q/k need no
permutation, except DeepSeek's interleaved pairs (`rope_interleave`), whose columns an import
reorders (tests/test_hf_parity.py, tests/test_hf_deepseek.py check logits against transformers).
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
from jaxtron.config.schema import MLAConfig
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
# One row per tensor: HF name ({i}: layer index, stacked on our L axis), our path (a layer's
# starting with its stack, `layers` here), transform.
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
# DeepSeek-V3's multi-token-prediction modules: layers past num_hidden_layers (model.layers.61 of
# DeepSeek-V3), known by their eh_proj; transformers drops them on load, and so do we.
MTP_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Tensors written in float32 whatever the weights' dtype (transformers keeps them in float32,
# _keep_in_fp32_modules_strict, and DeepSeek-V3's own files store the bias so).
FLOAT32_TENSORS = re.compile(r"\.e_score_correction_bias$")

SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen3_moe", "deepseek_v3",
                   "deepseek_v2")
DEEPSEEK = "deepseek_v3"
DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v2")  # latent attention and DeepSeek-MoE


def mlp_family(cfg: ModelConfig) -> str:
    """Which MLPS naming `cfg` has: dense, or its family's experts (qwen3_moe, mixtral)."""
    return family_of(cfg) if cfg.moe.num_experts else "dense"


def layer_slot(cfg: ModelConfig, layer: int) -> tuple[str, int]:
    """HF layer `layer`'s stack in our params and its index there: DeepSeek-V3's first
    model.moe.first_dense layers are `dense_layers`, the others (every layer elsewhere) `layers`."""
    dense = cfg.moe.first_dense
    return ("dense_layers", layer) if layer < dense else ("layers", layer - dense)


def _sized(transform: Transform, h: int) -> Transform:
    """`transform` with head size `h` (a latent-attention tensor's own, not cfg.head_size)."""
    to_ours, to_hf = transform
    return (lambda x, _: to_ours(x, h), lambda y, _: to_hf(y, h))


def _rope_deinterleaved(transform: Transform, start: int, rope: int, interleave: bool
                        ) -> Transform:
    """`transform`, then its last axis's `rope` columns from `start` on reordered from HF's
    interleaved pairs (x0, x1), (x2, x3) ... to halves (x0, x2, ... | x1, x3, ...), the layout
    our apply_rope rotates (and back for HF): the same rotation, the same dot products."""
    if not interleave:
        return transform
    order = np.concatenate([np.arange(start), start + np.arange(0, rope, 2),
                            start + np.arange(1, rope, 2)])
    back = np.argsort(order)
    to_ours, to_hf = transform
    return (lambda x, h: to_ours(x, h)[..., order], lambda y, h: to_hf(y[..., back], h))


def _on(stack: str, table: Iterable[tuple[str, ParamPath, Transform]]
        ) -> tuple[tuple[str, ParamPath, Transform], ...]:
    """Layer rows (paths relative to a layer) put on `stack`."""
    return tuple((pattern, (stack, *path), t) for pattern, path, t in table)


def _deepseek_rows(cfg: ModelConfig, interleave: bool) -> tuple[tuple[str, ParamPath, Transform],
                                                                ...]:
    """DeepSeek-V3's rows: latent attention on every layer, the dense MLP on `dense_layers`,
    router, balancing bias, routed experts (qwen3_moe's naming) and shared experts on `layers`.
    `interleave`: the checkpoint's rope_interleave."""
    m = cfg.mla
    qk = m.qk_nope_head_dim + m.qk_rope_head_dim
    q_rows = _rope_deinterleaved(_sized(QKV, qk), m.qk_nope_head_dim, m.qk_rope_head_dim,
                                 interleave)
    attn = (
        (LAYER + "input_layernorm.weight", ("attn_norm", "scale"), COPY),
        (LAYER + "self_attn.q_proj.weight", ("attn", "wq"), q_rows),  # q_lora_rank null
        (LAYER + "self_attn.q_a_proj.weight", ("attn", "wq_a"), LINEAR),
        (LAYER + "self_attn.q_a_layernorm.weight", ("attn", "q_norm", "scale"), COPY),
        (LAYER + "self_attn.q_b_proj.weight", ("attn", "wq_b"), q_rows),
        (LAYER + "self_attn.kv_a_proj_with_mqa.weight", ("attn", "wkv_a"),
         _rope_deinterleaved(LINEAR, m.kv_lora_rank, m.qk_rope_head_dim, interleave)),
        (LAYER + "self_attn.kv_a_layernorm.weight", ("attn", "kv_norm", "scale"), COPY),
        (LAYER + "self_attn.kv_b_proj.weight", ("attn", "wkv_b"),
         _sized(QKV, m.qk_nope_head_dim + m.v_head_dim)),
        (LAYER + "self_attn.o_proj.weight", ("attn", "wo"), _sized(OUT, m.v_head_dim)),
        (LAYER + "post_attention_layernorm.weight", ("mlp_norm", "scale"), COPY),
    )
    experts = (
        (LAYER + "mlp.gate.weight", ("mlp", "router"), LINEAR),
        *(((LAYER + "mlp.gate.e_score_correction_bias", ("mlp", "router_bias"), COPY),)
          if cfg.moe.scoring == "sigmoid" else ()),  # V3's balancing bias; V2 has none
        *((p, path[1:], t) for p, path, t in MLPS["qwen3_moe"][1:]),
        (LAYER + "mlp.shared_experts.gate_proj.weight", ("mlp", "shared", "w_gate"), LINEAR),
        (LAYER + "mlp.shared_experts.up_proj.weight", ("mlp", "shared", "w_up"), LINEAR),
        (LAYER + "mlp.shared_experts.down_proj.weight", ("mlp", "shared", "w_down"), LINEAR),
    )
    dense = tuple((p, path[1:], t) for p, path, t in MLPS["dense"])
    top = tuple(row for row in MAPPING if "{i}" not in row[0])
    return top[:1] + _on("dense_layers", attn + dense) + _on("layers", attn + experts) + top[1:]


@functools.lru_cache(maxsize=8)
def expected_shapes(cfg: ModelConfig) -> dict[ParamPath, tuple[int, ...]]:
    """Our param paths and shapes for `cfg` (layers stacked), without allocating anything."""
    pure = nnx.to_pure_dict(nnx.state(abstract_model(cfg), nnx.Param))
    leaves = jax.tree_util.tree_flatten_with_path(pure)[0]
    return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in leaves}


def rows(cfg: ModelConfig, rope_interleave: bool = True
         ) -> list[tuple[str, ParamPath, Transform]]:
    """The MAPPING rows this config has (no biases without qkv_bias, no head when tied).
    `rope_interleave`: DeepSeek-V3's (transformers' rope_interleave, its default true)."""
    shapes = expected_shapes(cfg)
    table = (_deepseek_rows(cfg, rope_interleave) if family_of(cfg) in DEEPSEEK_TYPES
             else MAPPING + MLPS[mlp_family(cfg)])
    return [row for row in table if row[1] in shapes]


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
    present -= _mtp_names(present, cfg)
    wanted = [name for name, _, _, _ in hf_layout(cfg)]
    missing = [n for n in wanted if n not in present]
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors the config needs: "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    unknown = sorted(present - set(wanted))
    if unknown:
        raise ValueError(f"checkpoint has {len(unknown)} tensors with no place in the model "
                         f"(check model.* against its config.json): {', '.join(unknown[:8])}"
                         f"{' ...' if len(unknown) > 8 else ''}")


def _mtp_names(names: set[str], cfg: ModelConfig) -> set[str]:
    """The tensors of DeepSeek-V3's multi-token-prediction layers among `names` (a layer past
    the model's with an eh_proj), which the model does not run."""
    if family_of(cfg) not in DEEPSEEK_TYPES:
        return set()
    layers = {int(hit[1]) for n in names if (hit := MTP_LAYER.match(n))}
    mtp = {i for i in layers if i >= cfg.num_layers and f"model.layers.{i}.eh_proj.weight" in names}
    return {n for n in names if (hit := MTP_LAYER.match(n)) and int(hit[1]) in mtp}


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


def layer_params(get: Callable[[str], np.ndarray], cfg: ModelConfig, layer: int, *,
                 rope_interleave: bool = True) -> dict[ParamPath, np.ndarray]:
    """HF layer `layer`'s tensors in our per-layer shapes (the stacked ones less the L axis) and
    dtype, by our path (its stack first: layer_slot)."""
    shapes = expected_shapes(cfg)
    stack = layer_slot(cfg, layer)[0]
    out = {}
    for pattern, path, (to_ours, _) in rows(cfg, rope_interleave):
        if path[0] != stack:
            continue
        if "{j}" in pattern:  # [E, D, F]: one HF tensor per expert
            out[path] = np.stack([_ours(pattern.format(i=layer, j=j), path, to_ours, get, cfg,
                                        shapes[path][2:]) for j in range(cfg.moe.num_experts)])
        elif "{i}" in pattern:
            out[path] = _ours(pattern.format(i=layer), path, to_ours, get, cfg, shapes[path][1:])
    return out


def hf_to_params(hf_tensors: dict[str, np.ndarray], cfg: ModelConfig, *,
                 rope_interleave: bool = True) -> dict:
    """HF checkpoint tensors (name -> array) -> our pure nested param dict, numpy, in
    cfg.param_dtype. `rope_interleave`: config.json's (`rope_interleave`), for DeepSeek-V3."""
    check_names(hf_tensors, cfg)
    check_tied(hf_tensors, hf_tensors.__getitem__, cfg)
    flat = top_params(hf_tensors.__getitem__, cfg)
    stacked: dict[ParamPath, list[np.ndarray]] = {}
    for i in range(cfg.num_layers):  # each stack's layers in order
        for path, value in layer_params(hf_tensors.__getitem__, cfg, i,
                                        rope_interleave=rope_interleave).items():
            stacked.setdefault(path, []).append(value)
    flat |= {path: np.stack(values) for path, values in stacked.items()}
    return nest(flat)


def hf_layout(cfg: ModelConfig, rope_interleave: bool = True
              ) -> list[tuple[str, ParamPath, int | None, Callable]]:
    """Every HF tensor of `cfg` in checkpoint order: (name, our path, index in the path's stack
    or None for unstacked, our array -> HF's). Tied models have no lm_head.weight. An expert's
    tensor takes its layer's [E, D, F] array and picks expert j itself."""
    table = rows(cfg, rope_interleave)
    out = []
    for pattern, path, (_, to_hf) in table:
        if "{i}" not in pattern:
            out.append((pattern, path, None, to_hf))
    for i in range(cfg.num_layers):
        stack, index = layer_slot(cfg, i)
        for pattern, path, (_, to_hf) in table:
            if "{i}" not in pattern or path[0] != stack:
                continue
            if "{j}" in pattern:
                out += [(pattern.format(i=i, j=j), path, index,
                         lambda y, h, j=j, to_hf=to_hf: to_hf(y[j], h))
                        for j in range(cfg.moe.num_experts)]
            else:
                out.append((pattern.format(i=i), path, index, to_hf))
    return out


def params_to_hf(params: dict, cfg: ModelConfig, *,
                 rope_interleave: bool = True) -> dict[str, np.ndarray]:
    """Our pure nested param dict -> HF checkpoint tensors (tied models omit lm_head.weight;
    DeepSeek's multi-token-prediction modules, model.mtp_depth, are training's only: left
    out, as transformers leaves them out)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    flat = {tuple(k.key for k in path): np.asarray(leaf) for path, leaf in leaves
            if path[0].key != "mtp"}
    table = rows(cfg, rope_interleave)
    unknown = sorted("/".join(p) for p in set(flat) - {row[1] for row in table})
    if unknown:
        raise ValueError(f"params with no HF name: {', '.join(unknown)}")
    return {name: to_hf(flat[path] if layer is None else flat[path][layer], cfg.head_size)
            for name, path, layer, to_hf in hf_layout(cfg, rope_interleave)}


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
    elif kind == "yarn" and deepseek:
        out |= _yarn(rope, hf, where)
    elif kind != "default":
        raise ValueError(f"RoPE scaling type '{kind}' is not supported (default and llama3 are; "
                         "yarn for deepseek_v3 and deepseek_v2 only)")
    return out


def _yarn(rope: dict, hf: dict, where: str) -> dict:
    """YaRN's fields as transformers' _compute_yarn_parameters reads them (beta_fast 32 and
    beta_slow 1 when absent or 0; mscale and mscale_all_dim count only when set, so absent is
    0 here), for DeepSeek-V3 (whose softmax scale takes mscale_all_dim too)."""
    if rope.get("attention_factor") is not None:
        raise ValueError(f"{where}attention_factor is not supported (the factor is computed "
                         "from factor, mscale and mscale_all_dim)")
    if rope.get("truncate", True) is not True:
        raise ValueError(f"{where}truncate={json.dumps(rope['truncate'])} is not supported "
                         "(YaRN's correction range is truncated here)")
    return {
        "rope_scaling_type": "yarn",
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
    if hf["model_type"] in DEEPSEEK_TYPES:
        return _deepseek_config(hf)
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


def rope_interleave(hf: dict) -> bool:
    """Whether a DeepSeek-V3 config.json's RoPE dims come in interleaved pairs (transformers'
    rope_interleave, default true as DeepSeek's own checkpoints have them); DeepSeek-V2's
    always do (transformers rotates them as complex pairs); false elsewhere."""
    if hf.get("model_type") == "deepseek_v2":
        return True
    if hf.get("model_type") != DEEPSEEK:
        return False
    return _setting(hf, "rope_interleave", bool, True)
