"""Hugging Face model directories: read, run and write Llama-family weights, tensor by tensor.

A directory in Hugging Face's layout is `config.json` plus `*.safetensors` (sharded with
`model.safetensors.index.json` or not), usually with tokenizer files. No PyTorch is needed:
tensors are memory-mapped one at a time (jaxtron.hf.tensorfile), bfloat16 included. Pickled weights
(`.bin`, `.pt`) run code when loaded and are read only when the caller allows it (and has torch).

    cfg, params = jaxtron.hf.from_pretrained("~/Llama-3.2-1B")
    logits = jaxtron.hf.logits(cfg, params, tokens)  # numpy [B, T, V]
    jaxtron.hf.save_pretrained(cfg, params, "out/", model_type="llama")

The tensor names are jaxtron.hf.mapping's, the config reading jaxtron.hf.config_json's;
`jaxtron convert-hf` converts whole directories to and from jaxtron checkpoints.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.config import ConfigError, ModelConfig
from jaxtron.hf import deepseek, gemma, gpt_oss, tensorfile
from jaxtron.hf.config_json import config_from_hf, rope_interleave
from jaxtron.hf.mapping import (
    FLOAT32_TENSORS,
    ParamPath,
    check_names,
    check_tied,
    expected_shapes,
    hf_layout,
    hf_to_params,
)
from jaxtron.model import abstract_model, family_of, in_compute_dtype

INDEX = "model.safetensors.index.json"
GENERATION = "generation_config.json"  # what transformers' generate() reads before config.json
PICKLED = ("*.bin", "*.pt", "*.pth")
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                 "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                 "mixtral": "MixtralForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM",
                 **deepseek.ARCHITECTURES, **gemma.ARCHITECTURES, **gpt_oss.ARCHITECTURES}
SHARD_BYTES = 5 * 2**30  # safetensors shards written by save_pretrained, as transformers does
Getter = Callable[[str], np.ndarray]


def _weight_files(root: Path) -> list[str]:
    """The safetensors files of a directory, through its index when it has one."""
    if (root / INDEX).is_file():
        files = _indexed_files(root / INDEX)
        absent = [f for f in files if not (root / f).is_file()]
        if absent:
            raise ConfigError(f"{root / INDEX} names {', '.join(absent[:3])}, which is not in "
                              f"{root}; the download is incomplete")
        return files
    return sorted(p.name for p in root.glob("*.safetensors"))


def _indexed_files(index: Path) -> list[str]:
    """The shard files an index's weight_map names; a ConfigError naming the index when it is
    unreadable, not JSON (an interrupted download) or has no weight_map of names to files."""
    try:
        weight_map = json.loads(index.read_bytes())["weight_map"]
        files = sorted(set(weight_map.values()))
    except OSError as err:
        raise ConfigError(f"cannot read {index} ({err.strerror})") from None
    except (ValueError, UnicodeDecodeError) as err:
        raise ConfigError(f"{index} is not valid JSON ({err}); download it again") from None
    except (KeyError, TypeError, AttributeError):
        files = None
    if not files or not all(isinstance(f, str) and f for f in files):
        raise ConfigError(f"{index} has no weight_map naming each tensor's shard file; download "
                          "it again, or remove it to read every *.safetensors file of the "
                          "directory")
    return files


def _pickled(root: Path, files: list[str]) -> dict[str, np.ndarray]:
    """Every tensor of pickled PyTorch files (`torch.load(weights_only=True)`)."""
    try:
        import torch
    except ImportError:
        raise ConfigError("reading pickled (.bin/.pt) weights needs PyTorch: pip install torch, "
                          "or convert them to safetensors") from None
    tensors = {}
    for name in files:
        for key, t in torch.load(root / name, map_location="cpu", weights_only=True).items():
            t = t.detach().contiguous()
            tensors[key] = (t.view(torch.int16).numpy().view(tensorfile.DTYPES["BF16"])
                            if t.dtype == torch.bfloat16 else t.numpy())
    return tensors


def open_tensors(hf_dir: str | Path, allow_pickle: bool = False) -> tuple[list[str], Getter]:
    """(the tensor names of a directory, a function reading one of them). Safetensors files are
    memory-mapped; pickled ones are refused unless `allow_pickle` (loading them runs code)."""
    root = Path(hf_dir).expanduser()
    if not root.is_dir():
        raise ConfigError(f"{root} is not a directory")
    files = _weight_files(root)
    if files:
        where: dict[str, tuple[Path, dict, int]] = {}
        for name in files:
            try:
                entries, start = tensorfile.header(root / name)
            except tensorfile.TensorFileError as err:
                raise ConfigError(str(err)) from None
            where |= {key: (root / name, entries, start) for key in entries}
        return gpt_oss.dequantized(
            sorted(where), lambda key: tensorfile.read(where[key][0], key, *where[key][1:]))
    pickled = sorted(p.name for pattern in PICKLED for p in root.glob(pattern))
    if not pickled:
        raise ConfigError(f"{root} has no *.safetensors files")
    if not allow_pickle:
        raise ConfigError(f"{root} holds only pickled weights ({', '.join(pickled[:3])}), "
                          "which run code when loaded; pass --allow-pickle if you trust their "
                          "source")
    tensors = _pickled(root, pickled)
    return sorted(tensors), tensors.__getitem__


def read_tensors(hf_dir: str | Path, allow_pickle: bool = False) -> dict[str, np.ndarray]:
    """Every tensor of a directory by name (memory-mapped: read as they are used)."""
    names, get = open_tensors(hf_dir, allow_pickle)
    return {name: get(name) for name in names}


def read_hf_config(hf_dir: str | Path) -> dict:
    """A directory's config.json as a dict."""
    path = Path(hf_dir).expanduser() / "config.json"
    if not path.is_file():
        raise ConfigError(f"{path} not found: a Hugging Face model directory has a config.json")
    try:
        config = json.loads(path.read_text())
    except ValueError as err:
        raise ConfigError(f"{path}: not valid JSON ({err})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{path}: not a JSON object of settings")
    return config


def read_config(hf_dir: str | Path, dtype: str = "float32") -> ModelConfig:
    """The ModelConfig of a directory's config.json, computing and storing in `dtype`."""
    try:
        overrides = config_from_hf(read_hf_config(hf_dir))
    except (ValueError, KeyError) as err:
        raise ConfigError(f"{Path(hf_dir).expanduser() / 'config.json'}: {err}") from None
    return ModelConfig(**overrides, dtype=dtype, param_dtype=dtype)


def check_tensors(hf_dir: str | Path, cfg: ModelConfig, allow_pickle: bool = False) -> Getter:
    """The directory's reader, once its tensor names fit `cfg` (ConfigError naming any that
    are missing or have no place)."""
    names, get = open_tensors(hf_dir, allow_pickle)
    try:
        check_names(names, cfg)
        check_tied(names, get, cfg)
    except ValueError as err:
        raise ConfigError(f"{Path(hf_dir).expanduser()}: {err}") from None
    return get


def from_pretrained(hf_dir: str | Path, dtype: str = "float32",
                    allow_pickle: bool = False) -> tuple[ModelConfig, dict]:
    """(model config, params as a pure nested dict of numpy arrays) of a Hugging Face directory."""
    cfg = read_config(hf_dir, dtype)
    check_tensors(hf_dir, cfg, allow_pickle)
    try:
        return cfg, hf_to_params(read_tensors(hf_dir, allow_pickle), cfg,
                                 rope_interleave=rope_interleave(read_hf_config(hf_dir)))
    except ValueError as err:
        raise ConfigError(f"{Path(hf_dir).expanduser()}: {err}") from None


def logits(cfg: ModelConfig, params: dict, tokens) -> np.ndarray:
    """float32 logits [B, T, V] of int tokens [B, T] (one document per row, positions 0..T-1)."""
    tokens = jnp.asarray(tokens, jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(_forward(cfg, params, tokens, positions, jnp.ones_like(tokens)))


@functools.partial(jax.jit, static_argnums=0)
def _forward(cfg: ModelConfig, params, tokens, positions, segment_ids):
    graphdef = nnx.graphdef(abstract_model(in_compute_dtype(cfg)))
    model = nnx.merge(graphdef, params)
    return model(tokens, positions, segment_ids)


def hf_config(cfg: ModelConfig, model_type: str = "llama", context: int | None = None) -> dict:
    """A config.json for `cfg` (the inverse of `config_from_hf`). `context`: its
    max_position_embeddings, the longest sequence the model is meant for (the length it was
    trained at); by default the Llama 3 scaling's original length, else 2048."""
    if model_type not in ARCHITECTURES:
        raise ConfigError(f"model_type '{model_type}' is not one of {', '.join(ARCHITECTURES)}")
    if model_type in deepseek.TYPES:
        return deepseek.hf_config(cfg, model_type, context)
    if model_type in gemma.TYPES:
        return gemma.hf_config(cfg, model_type, context)
    if model_type == gpt_oss.TYPE:
        return gpt_oss.hf_config(cfg, context)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling_factor > 0:
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta,
                "factor": cfg.rope_scaling_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_len}
    return {
        "architectures": [ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.d_model,
        "intermediate_size": _intermediate_size(cfg, model_type),
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_size, "hidden_act": "silu", "rms_norm_eps": cfg.norm_eps,
        "tie_word_embeddings": cfg.tie_embeddings, "rope_parameters": rope,
        "rope_theta": cfg.rope_theta,
        "max_position_embeddings": context or (cfg.rope_original_max_len
                                               if cfg.rope_scaling_factor > 0 else 2048),
        "attention_bias": cfg.qkv_bias and model_type == "qwen2", "mlp_bias": False,
        "torch_dtype": cfg.param_dtype,
        **_window(cfg, model_type),
        **_experts(cfg, model_type),
    }


def _experts(cfg: ModelConfig, model_type: str) -> dict:
    """The config.json keys of a mixture of experts (the inverse of mapping._experts)."""
    if not cfg.moe.num_experts:
        return {}
    out = {"num_local_experts": cfg.moe.num_experts, "num_experts": cfg.moe.num_experts,
           "num_experts_per_tok": cfg.moe.experts_per_token,
           "router_aux_loss_coef": cfg.moe.aux_coef, "output_router_logits": False}
    if model_type == "qwen3_moe":
        out |= {"moe_intermediate_size": cfg.moe.mlp_dim or cfg.mlp_dim,
                "norm_topk_prob": cfg.moe.norm_topk_prob, "decoder_sparse_step": 1,
                "mlp_only_layers": []}
    return out


def _intermediate_size(cfg: ModelConfig, model_type: str) -> int:
    """config.json's intermediate_size: Mixtral's experts are that wide (it has no
    moe_intermediate_size); elsewhere the dense MLP's width (Qwen3-MoE's experts are
    moe_intermediate_size wide, and its intermediate_size is for dense layers, of which jaxtron
    makes none)."""
    if model_type == "mixtral":
        return cfg.moe.mlp_dim or cfg.mlp_dim
    return cfg.mlp_dim


def model_type_of(cfg: ModelConfig) -> str:
    """The Hugging Face model_type of `cfg`: its family (model.family, or the one its settings
    make, jaxtron/model/families.py)."""
    return family_of(cfg)


def _check_family(cfg: ModelConfig, model_type: str) -> None:
    """`model_type` computes what `cfg` does (one line naming what differs otherwise)."""
    needed = model_type_of(cfg)
    if needed == "llama" and model_type == "mistral":
        return
    if needed == "mistral" and model_type == "llama":
        raise ConfigError(f"model_type 'llama' has no attention window, and this model has one "
                          f"(model.sliding_window={cfg.sliding_window}); write it as 'mistral'")
    if needed != model_type:
        raise ConfigError(f"model_type '{model_type}' does not compute this model (QKV biases "
                          f"{cfg.qkv_bias}, q/k norms {cfg.qk_norm}, experts "
                          f"{cfg.moe.num_experts}); write it as '{needed}'")
    if model_type == "mixtral" and not cfg.moe.norm_topk_prob:
        raise ConfigError("Mixtral renormalizes its top-k router weights; model.moe.norm_topk_prob="
                          "false has no Mixtral equivalent")
    if model_type in deepseek.TYPES:
        deepseek.check(cfg, model_type)


def _window(cfg: ModelConfig, model_type: str) -> dict:
    """The config.json keys of the attention window. Mistral and Mixtral slide whenever
    sliding_window is set; the Qwen families only with use_sliding_window, Qwen2 and Qwen3 on the
    layers from max_window_layers on (0: every layer, as model.sliding_window means), Qwen3-MoE
    on every layer."""
    window = cfg.sliding_window or None
    if cfg.global_every:
        raise ConfigError(f"model_type '{model_type}' windows every layer alike; model."
                          f"global_every={cfg.global_every} has no {model_type} equivalent")
    if model_type in ("mistral", "mixtral"):
        return {"sliding_window": window}
    if model_type in ("qwen2", "qwen3") and window:
        return {"use_sliding_window": True, "sliding_window": window, "max_window_layers": 0}
    if model_type == "qwen3_moe" and window:
        return {"use_sliding_window": True, "sliding_window": window}
    return {}


def _hf_specs(cfg: ModelConfig, dtype) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    """Each HF tensor's shape and dtype (FLOAT32_TENSORS in float32), computed without any
    data."""
    shapes, by_path = expected_shapes(cfg), {}
    for _, path, layer, to_hf in hf_layout(cfg):
        if path not in by_path:
            ours = shapes[path] if layer is None else shapes[path][1:]
            by_path[path] = tuple(jax.eval_shape(lambda y, f=to_hf: f(y, cfg.head_size),
                                                 jax.ShapeDtypeStruct(ours, np.float32)).shape)
    return {name: (by_path[path], np.dtype(np.float32 if FLOAT32_TENSORS.search(name) else dtype))
            for name, path, _, _ in hf_layout(cfg)}


def write_pretrained(cfg: ModelConfig, get: Callable[[ParamPath, int | None], np.ndarray],
                     out_dir: str | Path, model_type: str = "llama", dtype: Any = None,
                     context: int | None = None, *, token_ids: dict | None = None) -> Path:
    """Write config.json and safetensors shards of at most SHARD_BYTES (with an index when there
    are several), asking `get(our path, layer or None)` for one tensor at a time, so that only
    one is in memory. `dtype`: the files' dtype (default cfg.param_dtype); `context`: see
    hf_config; `token_ids`: the tokenizer's bos_token_id, eos_token_id (an id or a list) and
    pad_token_id if any, put into config.json and written as generation_config.json (without
    them transformers assumes bos 1 and eos 2)."""
    _check_family(cfg, model_type)
    config = hf_config(cfg, model_type, context)
    dtype = np.dtype(jnp.dtype(dtype or cfg.param_dtype))
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    layout = {name: (path, layer, to_hf) for name, path, layer, to_hf in hf_layout(cfg)}
    specs = _hf_specs(cfg, dtype)
    sizes = [(n, specs[n][1].itemsize * int(np.prod(specs[n][0], dtype=np.int64)))
             for n in layout]
    shards = tensorfile.plan_shards(sizes, SHARD_BYTES)
    files = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])

    def produce(name: str) -> np.ndarray:
        path, layer, to_hf = layout[name]
        return np.asarray(to_hf(np.asarray(get(path, layer)), cfg.head_size)).astype(
            specs[name][1])

    for file, names in zip(files, shards):
        tensorfile.write(out / file, names, specs, produce)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(size for _, size in sizes)},
                 "weight_map": {n: file for file, names in zip(files, shards) for n in names}}
        (out / INDEX).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps({**config, "torch_dtype": dtype.name,
                                                 **(token_ids or {})}, indent=2))
    if token_ids:
        write_generation_config(out, token_ids)
    return out


def write_generation_config(out_dir: Path, token_ids: dict) -> None:
    """out_dir/generation_config.json holding `token_ids`: written by transformers'
    GenerationConfig where transformers is installed (it adds its version), else the same JSON
    by hand (transformers is not a dependency of export)."""
    try:
        from transformers import GenerationConfig
    except ImportError:
        (out_dir / GENERATION).write_text(json.dumps(token_ids, indent=2, sort_keys=True) + "\n")
        return
    GenerationConfig(**token_ids).save_pretrained(out_dir)


def eos_ids(path: Path, config: dict) -> list[int]:
    """The end-of-sequence ids of the Hugging Face directory `path` whose config.json is
    `config`: generation_config.json's eos_token_id (what transformers' generate() reads first),
    else config.json's, as a list (an id, a list of ids or null there). A Llama 3.1 instruct
    lists one no tokenizer file names (<|eom_id|>); a broken file or value is one line."""
    generation = path / GENERATION
    try:
        settings = json.loads(generation.read_text()) if generation.is_file() else config
    except ValueError as err:
        raise ConfigError(f"{generation}: not valid JSON ({err})") from None
    if not isinstance(settings, dict):
        raise ConfigError(f"{generation}: not a JSON object of settings")
    value = settings.get("eos_token_id", config.get("eos_token_id"))
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in ids):
        raise ConfigError(f"{path}: eos_token_id {value!r} is not a token id or a list of them")
    return ids


def save_pretrained(cfg: ModelConfig, params: dict, out_dir: str | Path,
                    model_type: str = "llama", dtype: Any = None,
                    context: int | None = None, *, token_ids: dict | None = None) -> Path:
    """Write `params` (our pure nested dict) as a Hugging Face directory (see write_pretrained)."""
    def get(path: ParamPath, layer: int | None) -> np.ndarray:
        value = functools.reduce(lambda node, key: node[key], path, params)
        return value if layer is None else value[layer]

    return write_pretrained(cfg, get, out_dir, model_type, dtype, context, token_ids=token_ids)
