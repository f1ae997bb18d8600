"""Hugging Face Llama-family checkpoints <-> jaxtron params, through one name-mapping table.

Covers `LlamaForCausalLM`, `MistralForCausalLM` (without sliding windows) and `Qwen2ForCausalLM`
(QKV bias). A directory in Hugging Face's layout (`config.json` and `*.safetensors`, sharded with
`model.safetensors.index.json` or not) reads with `from_pretrained` and writes with
`save_pretrained`; no PyTorch is needed (safetensors reads and writes numpy).

    cfg, params = jaxtron.hf.from_pretrained("~/Llama-3.2-1B")
    logits = jaxtron.hf.logits(cfg, params, tokens)  # numpy [B, T, V]

Our params are the pure nested dict of `nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs)))`, with
per-layer weights stacked on a leading L axis. HF `nn.Linear` weights are [out, in]; ours are
[in, out] with heads split out. Our RoPE rotates halves exactly as HF Llama does, so q/k need no
permutation (tests/test_hf_parity.py checks logits against transformers itself).
"""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.config import ConfigError, ModelConfig
from jaxtron.model import abstract_model

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
    (LAYER + "post_attention_layernorm.weight", ("layers", "mlp_norm", "scale"), COPY),
    (LAYER + "mlp.gate_proj.weight", ("layers", "mlp", "w_gate"), LINEAR),
    (LAYER + "mlp.up_proj.weight", ("layers", "mlp", "w_up"), LINEAR),
    (LAYER + "mlp.down_proj.weight", ("layers", "mlp", "w_down"), LINEAR),
    ("model.norm.weight", ("final_norm", "scale"), COPY),
    ("lm_head.weight", ("lm_head",), LINEAR),  # absent when embeddings are tied
)
# Non-parameter buffers some checkpoints carry; recomputed from the config, so dropped.
IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

SUPPORTED_TYPES = ("llama", "mistral", "qwen2")


def _hf_names(pattern: str, num_layers: int) -> list[str]:
    """The concrete HF names of one MAPPING row."""
    if "{i}" not in pattern:
        return [pattern]
    return [pattern.format(i=i) for i in range(num_layers)]


def expected_shapes(cfg: ModelConfig) -> dict[ParamPath, tuple[int, ...]]:
    """Our param paths and shapes for `cfg`, without allocating anything."""
    pure = nnx.to_pure_dict(nnx.state(abstract_model(cfg)))
    leaves = jax.tree_util.tree_flatten_with_path(pure)[0]
    return {tuple(k.key for k in path): tuple(leaf.shape) for path, leaf in leaves}


def _nest(flat: dict[ParamPath, Any]) -> dict:
    """{('a', 'b'): x} -> {'a': {'b': x}}."""
    tree: dict = {}
    for path, value in flat.items():
        node = tree
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = value
    return tree


def _drop_tied_head(tensors: dict[str, Any], cfg: ModelConfig) -> dict[str, Any]:
    """Tied models' HF state dicts still list `lm_head.weight`: accept it if it is the embedding."""
    if not cfg.tie_embeddings or "lm_head.weight" not in tensors:
        return tensors
    embed = tensors.get("model.embed_tokens.weight")
    if embed is not None and not np.array_equal(np.asarray(tensors["lm_head.weight"]), embed):
        raise ValueError("checkpoint has its own lm_head.weight but model.tie_embeddings=True; "
                         "set model.tie_embeddings=False")
    return {k: v for k, v in tensors.items() if k != "lm_head.weight"}


def hf_to_params(hf_tensors: dict[str, np.ndarray], cfg: ModelConfig) -> dict:
    """HF state dict (name -> array) -> our pure nested param dict, numpy, in cfg.param_dtype."""
    shapes, h = expected_shapes(cfg), cfg.head_size
    dtype = jnp.dtype(cfg.param_dtype)
    tensors = {k: v for k, v in hf_tensors.items() if not IGNORED.search(k)}
    tensors = _drop_tied_head(tensors, cfg)
    flat, used, missing = {}, set(), []
    for pattern, path, (to_ours, _) in MAPPING:
        if path not in shapes:
            continue
        names = _hf_names(pattern, cfg.num_layers)
        absent = [n for n in names if n not in tensors]
        if absent:
            missing += absent
            continue
        arrays = [to_ours(np.asarray(tensors[n]), h) for n in names]
        value = np.stack(arrays) if "{i}" in pattern else arrays[0]
        if value.shape != shapes[path]:
            raise ValueError(f"{pattern} gives {'/'.join(path)} shape {value.shape}, "
                             f"the config expects {shapes[path]}; check the model.* sizes")
        flat[path] = value.astype(dtype)
        used.update(names)
    if missing:
        raise ValueError(f"checkpoint lacks {len(missing)} tensors the config needs: "
                         f"{', '.join(missing[:8])}{' ...' if len(missing) > 8 else ''}")
    unknown = sorted(set(tensors) - used)
    if unknown:
        raise ValueError(f"checkpoint has {len(unknown)} tensors with no place in the model "
                         f"(check model.* against its config.json): {', '.join(unknown[:8])}"
                         f"{' ...' if len(unknown) > 8 else ''}")
    return _nest(flat)


def params_to_hf(params: dict, cfg: ModelConfig) -> dict[str, np.ndarray]:
    """Our pure nested param dict -> HF state dict (tied models omit lm_head.weight)."""
    leaves = jax.tree_util.tree_flatten_with_path(params)[0]
    flat = {tuple(k.key for k in path): np.asarray(leaf) for path, leaf in leaves}
    rows = {path: (pattern, to_hf) for pattern, path, (_, to_hf) in MAPPING}
    unknown = sorted("/".join(p) for p in set(flat) - set(rows))
    if unknown:
        raise ValueError(f"params with no HF name: {', '.join(unknown)}")
    out = {}
    for path, value in flat.items():
        pattern, to_hf = rows[path]
        if "{i}" not in pattern:
            out[pattern] = to_hf(value, cfg.head_size)
            continue
        for i, name in enumerate(_hf_names(pattern, value.shape[0])):
            out[name] = to_hf(value[i], cfg.head_size)
    return out


def _rope_overrides(hf: dict) -> dict:
    """RoPE fields from `rope_parameters` (transformers 5) or `rope_scaling` + `rope_theta` (4)."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    if any(isinstance(v, dict) for v in rope.values()):
        raise ValueError("per-layer-type RoPE parameters are not supported")
    if rope.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    out = {"rope_theta": float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))}
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "llama3":
        out |= {
            "rope_scaling_factor": float(rope["factor"]),
            "rope_low_freq_factor": float(rope["low_freq_factor"]),
            "rope_high_freq_factor": float(rope["high_freq_factor"]),
            "rope_original_max_len": int(rope.get("original_max_position_embeddings",
                                                  hf["max_position_embeddings"])),
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
    window = _sliding_window(hf)
    if window is not None:  # HF tests `is None` too
        raise ValueError(f"sliding-window attention (sliding_window={window}) is not supported: "
                         "our attention is full causal, so only sliding_window=null converts")


def _sliding_window(hf: dict) -> int | None:
    """The attention window transformers applies for this config; None means full causal."""
    # HF Mistral slides whenever sliding_window is set: it has no use_sliding_window switch and
    # ignores one left in config.json. Qwen2 slides only with use_sliding_window=true.
    if hf.get("model_type") == "mistral" or hf.get("use_sliding_window", False):
        return hf.get("sliding_window")
    return None


def config_from_hf(hf_config: dict) -> dict:
    """HF config.json dict -> our `model.*` overrides (ModelConfig field names)."""
    hf = hf_config
    _check_supported(hf)
    heads = hf["num_attention_heads"]
    return {
        "vocab_size": hf["vocab_size"],
        "num_layers": hf["num_hidden_layers"],
        "d_model": hf["hidden_size"],
        "num_heads": heads,
        "num_kv_heads": hf.get("num_key_value_heads") or heads,
        "head_dim": hf.get("head_dim") or hf["hidden_size"] // heads,
        "mlp_dim": hf["intermediate_size"],
        "norm_eps": float(hf.get("rms_norm_eps", 1e-6)),
        "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "qkv_bias": hf["model_type"] == "qwen2",
        **_rope_overrides(hf),
    }


# ------------------------------------------------------------------------------------------------
# Directories in Hugging Face's layout.

INDEX = "model.safetensors.index.json"
PICKLED = ("*.bin", "*.pt", "*.pth")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM"}
SHARD_BYTES = 5 * 2**30  # safetensors shards written by save_pretrained, as transformers does


def read_tensors(hf_dir: str | Path) -> dict[str, np.ndarray]:
    """Every tensor of a directory's safetensors files (through the index when there is one).
    Pickled checkpoints (.bin, .pt) are refused: loading them runs code from the file."""
    from safetensors.numpy import load_file

    root = Path(hf_dir).expanduser()
    if (root / INDEX).is_file():
        files = sorted(set(json.loads((root / INDEX).read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in root.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for pattern in PICKLED for p in root.glob(pattern))
        if pickled:
            raise ConfigError(f"{root} holds only pickled weights ({', '.join(pickled[:3])}), "
                              "which run code when loaded; convert them to safetensors first")
        raise ConfigError(f"{root} has no *.safetensors files")
    tensors: dict[str, np.ndarray] = {}
    for name in files:
        tensors.update(load_file(str(root / name)))
    return tensors


def read_config(hf_dir: str | Path, dtype: str = "float32") -> ModelConfig:
    """The ModelConfig of a directory's config.json, computing and storing in `dtype`."""
    path = Path(hf_dir).expanduser() / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: a Hugging Face model directory has a config.json")
    try:
        overrides = config_from_hf(json.loads(path.read_text()))
    except ValueError as err:
        raise ConfigError(f"{path}: {err}") from None
    return ModelConfig(**overrides, dtype=dtype, param_dtype=dtype)


def from_pretrained(hf_dir: str | Path, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """(model config, params as a pure nested dict of numpy arrays) of a Hugging Face directory."""
    cfg = read_config(hf_dir, dtype)
    try:
        return cfg, hf_to_params(read_tensors(hf_dir), cfg)
    except ValueError as err:
        raise ConfigError(f"{Path(hf_dir).expanduser()}: {err}") from None


def logits(cfg: ModelConfig, params: dict, tokens) -> np.ndarray:
    """float32 logits [B, T, V] of int tokens [B, T] (one document per row, positions 0..T-1)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(_forward(cfg, params, tokens, positions, jnp.ones_like(tokens)))


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg: ModelConfig, params, tokens, positions, segment_ids):
    graphdef = nnx.graphdef(abstract_model(cfg))
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, segment_ids)


def hf_config(cfg: ModelConfig, model_type: str = "llama") -> dict:
    """A config.json for `cfg` (the inverse of `config_from_hf`)."""
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"model_type '{model_type}' is not one of {', '.join(ARCHITECTURES)}")
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling_factor > 0:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta,
                "factor": cfg.rope_scaling_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_len}
    return {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": cfg.mlp_dim, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_size, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "rope_parameters": rope,
        "rope_theta": cfg.rope_theta, "max_position_embeddings": max(cfg.rope_original_max_len, 2048),
        "attention_bias": cfg.qkv_bias and model_type == "qwen2", "mlp_bias": False,
        "torch_dtype": cfg.param_dtype,
        **({"sliding_window": None} if model_type == "mistral" else {}),
    }


def save_pretrained(cfg: ModelConfig, params: dict, out_dir: str | Path,
                    model_type: str = "llama") -> Path:
    """Write config.json and the weights as safetensors shards of at most SHARD_BYTES, with
    an index when there is more than one, in the param dtype."""
    from safetensors.numpy import save_file

    if cfg.qkv_bias != (model_type == "qwen2"):
        raise ConfigError(f"model.qkv_bias={cfg.qkv_bias} does not fit model_type '{model_type}'"
                          " (QKV biases are Qwen2's)")
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: np.ascontiguousarray(v) for k, v in params_to_hf(params, cfg).items()}
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, value in tensors.items():
        if shards[-1] and size + value.nbytes > SHARD_BYTES:
            shards.append({})
            size = 0
        shards[-1][name] = value
        size += value.nbytes
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for name, shard in zip(names, shards):
        save_file(shard, str(out / name), metadata={"format": "pt"})
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(v.nbytes for v in tensors.values())},
                 "weight_map": {k: n for n, shard in zip(names, shards) for k in shard}}
        (out / INDEX).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(hf_config(cfg, model_type), indent=2))
    return out
