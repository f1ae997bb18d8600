"""Hugging Face tensors <-> jaxtron params, through one name-mapping table, by model.family
(config.json <-> model settings: jaxtron/hf/config_json.py).

Covers `LlamaForCausalLM`, `MistralForCausalLM`, `Qwen2ForCausalLM` (QKV bias), `Qwen3ForCausalLM`
(q/k norms), `MixtralForCausalLM`, `Qwen3MoeForCausalLM` (experts), `DeepseekV3ForCausalLM` and
`DeepseekV2ForCausalLM` (latent attention, shared experts, dense first layers), each HF
`model_type` a jaxtron family
(jaxtron/model/families.py) that an import records; an attention window is kept as
model.sliding_window (and model.global_every): adding a family that computes the same function is
adding rows or a config reading.
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
import re
from collections.abc import Callable, Iterable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.hf.config_json import DEEPSEEK_TYPES, GEMMA_TYPES
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
EXPERTS_DOWN: Transform = (lambda x, h: x.transpose(0, 2, 1),  # [E, F, D] <-> [E, D, F]
                           lambda y, h: y.transpose(0, 2, 1))

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
    (LAYER + "self_attn.o_proj.bias", ("layers", "attn", "bo"), COPY),  # gpt-oss
    (LAYER + "self_attn.sinks", ("layers", "attn", "sinks"), COPY),  # gpt-oss
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
    # every expert in one tensor per layer: gate and up interleaved [E, D, 2F] as ours, the
    # down projection [E, F, D] (ours [E, D, F]); router weight and bias
    "gpt_oss": (
        (LAYER + "mlp.router.weight", ("layers", "mlp", "router"), LINEAR),
        (LAYER + "mlp.router.bias", ("layers", "mlp", "b_router"), COPY),
        (LAYER + "mlp.experts.gate_up_proj", ("layers", "mlp", "w_gate_up"), COPY),
        (LAYER + "mlp.experts.gate_up_proj_bias", ("layers", "mlp", "b_gate_up"), COPY),
        (LAYER + "mlp.experts.down_proj", ("layers", "mlp", "w_down"), EXPERTS_DOWN),
        (LAYER + "mlp.experts.down_proj_bias", ("layers", "mlp", "b_down"), COPY),
    ),
}
# Gemma's four norms a layer: after attention, before and after the MLP (Llama's
# post_attention_layernorm is the norm before the MLP; Gemma's is after attention)
GEMMA_NORMS = (
    (LAYER + "post_attention_layernorm.weight", ("layers", "post_attn_norm", "scale"), COPY),
    (LAYER + "pre_feedforward_layernorm.weight", ("layers", "mlp_norm", "scale"), COPY),
    (LAYER + "post_feedforward_layernorm.weight", ("layers", "post_mlp_norm", "scale"), COPY),
)
# Non-parameter buffers some checkpoints carry; recomputed from the config, so dropped.
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")
# DeepSeek-V3's multi-token-prediction modules: layers past num_hidden_layers (model.layers.61 of
# DeepSeek-V3), known by their eh_proj; transformers drops them on load, and so do we.
MTP_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# Tensors written in float32 whatever the weights' dtype (transformers keeps them in float32,
# _keep_in_fp32_modules_strict, and DeepSeek-V3's own files store the bias so).
FLOAT32_TENSORS = re.compile(r"\.e_score_correction_bias$")



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
    family = family_of(cfg)
    if family in DEEPSEEK_TYPES:
        table = _deepseek_rows(cfg, rope_interleave)
    elif family in GEMMA_TYPES:
        table = tuple(row for row in MAPPING if "post_attention" not in row[0]) + GEMMA_NORMS \
            + MLPS["dense"]
    else:
        table = MAPPING + MLPS[mlp_family(cfg)]
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
