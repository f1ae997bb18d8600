"""Model weights in checkpoints, outside the training loop: found from any path a user gives, read
one layer at a time, and written one layer at a time for imported models.

A training checkpoint stores each weight stacked over layers, in the pipeline's storage order
(meta "layer_order"). A stacked weight of a large model does not fit a host (one 70B MLP matrix
in float32 is 75 GB), so weights are read here straight from the checkpoint's arrays with
TensorStore, one layer's slice at a time. An imported checkpoint (`jaxtron convert-hf import`)
is written with Orbax's partial saves one layer at a time, so it stores each layer separately
(meta "layout": "layers": params/layer/<model layer>/<path inside the layer>); restoring it stacks
the layers on the devices, one weight at a time (`restore_layers`), each into its stack of the
params (`layer_slots`: DeepSeek-V3's first layers are `dense_layers`, the others `layers`).

jax, Orbax and TensorStore are imported inside the functions that read arrays, so that finding a
checkpoint answers at once, without their start-up.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import shlex
import tempfile
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from jaxtron import config as config_lib
from jaxtron.checkpoint import damage
from jaxtron.config import ConfigError

LAYERED = "layers"  # meta["layout"] of a checkpoint that stores each layer separately
# (param path, its stack first; index in that stack, None for an unstacked weight) -> array
Getter = Callable[[tuple[str, ...], "int | None"], np.ndarray]


def layer_slots(model: config_lib.ModelConfig) -> list[tuple[str, int]]:
    """Each model layer's stack in the params and its index there, in model order, as the
    families' Transformer.stacks build them (and jaxtron.hf.mapping.layer_slot names HF layers):
    DeepSeek-V3's first model.moe.first_dense layers are `dense_layers`, the others `layers`;
    every layer of the other families is in `layers`."""
    dense = model.moe.first_dense
    return [("dense_layers", i) if i < dense else ("layers", i - dense)
            for i in range(model.num_layers)]


def is_complete(step_dir: Path) -> bool:
    """A finalized checkpoint: a step-named directory whose state and meta items were written.
    Orbax writes to `<step>.orbax-checkpoint-tmp-*` and renames, so unfinished ones never match."""
    return (step_dir.name.isdigit() and (step_dir / "state" / "_METADATA").is_file()
            and (step_dir / "meta" / "metadata").is_file())


def complete_steps(checkpoints_dir: Path) -> list[Path]:
    """The complete checkpoints under `checkpoints_dir`, oldest first."""
    found = [p for p in checkpoints_dir.iterdir() if p.is_dir() and is_complete(p)]
    return sorted(found, key=lambda p: int(p.name))


def run_checkpoints(run_dir: Path) -> list[Path]:
    """A run directory's checkpoints a resume could start from, oldest first: a damaged one
    (jaxtron/checkpoint/damage.py) is left out, every one by its metadata, and the newest left by
    the files its OCDBT tree points into too (a resume reads no other). Metadata with no array files
    beside it is taken as it reads: the start-up checks need no arrays."""
    sound, _ = damage.survey(run_dir / "checkpoints", damage.meta_damage)
    while sound and damage.files_damage(sound[-1]):
        sound.pop()
    return sound


def checkpoints_holding(path: Path) -> Path | None:
    """The checkpoints directory of a run or import that `path` is, or is inside (a checkpoint of
    it included), else None: that run's rotation deletes old checkpoints with what is in them,
    and its start moves an unreadable step directory aside."""
    target = path.expanduser().resolve()
    for place in (target, *target.parents):
        if is_complete(place):
            return place.parent
        if place.name == "checkpoints" and ((place.parent / "config.yaml").is_file()
                                            or run_checkpoints(place.parent)):
            return place
    return None


def imported_only(restore: str) -> str:
    """checkpoint.restore naming an import (jaxtron convert-hf) as a whole state to resume."""
    return (f"checkpoint.restore={restore} holds imported weights only (no optimizer state or "
            "data position); add checkpoint.weights_only=true")


def locate(path: str | Path) -> tuple[Path | None, Path]:
    """(the checkpoints directory `path` names, None for a single checkpoint; the checkpoint it
    means: itself, or the newest complete one of a checkpoints or run directory)."""
    path = Path(path).expanduser()
    if not path.exists():
        raise ConfigError(f"{path}: no such file or directory")
    if path.name.isdigit() and (path / "state").is_dir():
        if not is_complete(path):
            raise ConfigError(f"{path}: an incomplete checkpoint (state/_METADATA or "
                              "meta/metadata is missing)")
        return None, path.absolute()
    checkpoints_dir = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    steps = complete_steps(checkpoints_dir) if checkpoints_dir.is_dir() else []
    if not steps and (path / "config.yaml").is_file():
        raise ConfigError(f"{path} is a run with no complete checkpoint yet "
                          f"({_saves(path / 'config.yaml')}); inspect it after the first save")
    if not steps and (hint := import_hint(path)):
        raise ConfigError(f"{path} is a Hugging Face model, not a jaxtron checkpoint; {hint}")
    if not steps:
        raise ConfigError(f"{path}: not a checkpoint (.../checkpoints/<step>), nor a run, import "
                          "or checkpoints directory holding a complete one")
    return checkpoints_dir.absolute(), steps[-1].absolute()


def import_hint(path: str | Path) -> str | None:
    """How to use `path` if it is a Hugging Face model directory (config.json and weights)."""
    path = Path(path).expanduser()
    weights = [*path.glob("*.safetensors"), *path.glob("*.bin"), *path.glob("*.pt")]
    if not ((path / "config.json").is_file() and weights):
        return None
    return (f"import it first (jaxtron convert-hf import {shlex.quote(str(path))} OUT), "
            "then restore OUT with checkpoint.weights_only=true")


def restore_error(path: str) -> str:
    """Why checkpoint.restore=`path` names no checkpoint, and what to do."""
    if hint := import_hint(path):
        return (f"checkpoint.restore={path} is a Hugging Face model, not a jaxtron checkpoint; "
                f"{hint}")
    return (f"checkpoint.restore={path} is not a checkpoint (.../checkpoints/<step>), nor a run or "
            "import directory holding a complete one")


def _saves(config_yaml: Path) -> str:
    """When the run of `config_yaml` saves: 'checkpoint.every=500', or why that is not known."""
    try:
        every = config_lib.load([str(config_yaml)]).checkpoint.every
    except (ConfigError, OSError):
        return f"its {config_yaml.name} does not load"
    return f"checkpoint.every={every}" + (": it saves only at the end" if every == 0 else "")


def read_meta(step_dir: Path) -> dict:
    """The `meta` item: step, tokens_seen, config (YAML text), layer_order, and more."""
    try:
        return json.loads((step_dir / "meta" / "metadata").read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{step_dir}: unreadable meta item ({e})") from None


# What a start may not change of the model its checkpoints hold, per ModelConfig field. Any other
# field may change on resume: an implementation of the same function (scan_layers, remat,
# attention, attention_check, collective_matmul, weights_ahead, moe.kernel), the compute
# precision (dtype; fp8 between none and tensorwise, which keep no state), the init (init_std:
# read at step 0 only), and the training objective's knobs, which the weights' meaning does not
# depend on, as optim.* may change: moe.aux_coef, moe.z_coef and moe.capacity_factor (a compute
# budget per sequence: the pairs over it are dropped, the router and experts stay those of the
# same dropless model).
ARRAYS = ("vocab_size", "num_layers", "d_model", "num_heads", "num_kv_heads", "head_size",
          "mlp_dim", "tie_embeddings", "qkv_bias", "qk_norm", "param_dtype",
          "moe.num_experts", "mla.kv_lora_rank", "mla.q_lora_rank", "mla.qk_nope_head_dim",
          "mla.qk_rope_head_dim", "mla.v_head_dim", "mtp_depth"
          )  # the saved arrays' shapes and dtypes: a restore into others fails
# the experts' width (0: mlp_dim) and DeepSeek-MoE's arrays, where both have experts
MOE_ARRAYS = ("moe.mlp_dim", "moe.shared_experts", "moe.first_dense", "moe.scoring")
# The same arrays, another function: a resume in run.dir that changed one would go on training
# (and save as the run's) another model than its steps so far trained, with no error. A new run
# that starts from the checkpoint (checkpoint.restore, e.g. fine-tuning with a longer RoPE) may.
FUNCTION = ("rope_theta", "rope_scaling_factor", "rope_low_freq_factor", "rope_high_freq_factor",
            "rope_original_max_len", "rope_scaling_type", "rope_beta_fast", "rope_beta_slow",
            "rope_mscale", "rope_mscale_all_dim", "norm_eps", "sliding_window", "global_every")
MOE_FUNCTION = ("moe.experts_per_token", "moe.norm_topk_prob", "moe.routed_scale", "moe.groups",
                "moe.topk_groups")  # where both have experts


def model_changes(meta: dict, model: config_lib.ModelConfig, resume: bool = False) -> list[str]:
    """The model fields that give this config other arrays than the checkpoint's, and with
    `resume` (run.dir's own checkpoints) also another function of them (FUNCTION), each as
    `model.key=saved -> now`; empty when the model is the checkpoint's (an older or foreign meta
    is left to the restore)."""
    try:
        saved = config_lib.model_config(yaml.safe_load(meta["config"])["model"])
    except (KeyError, TypeError, ValueError, AttributeError):
        return []  # an older or foreign meta: the restore itself decides
    keys = [*ARRAYS, *(FUNCTION if resume else ())]
    if saved.moe.num_experts and model.moe.num_experts:  # a dense model reads none of these
        keys += [*MOE_ARRAYS, *(MOE_FUNCTION if resume else ())]
    changed = [_change(k, saved, model) for k in keys if _differs(k, saved, model)]
    if _histories(saved) != _histories(model):  # model.fp8=delayed's amax histories
        changed += [_change(k, saved, model)
                    for k in ("fp8", "fp8_history") if _value(saved, k) != _value(model, k)]
    return changed


def _differs(key: str, saved: config_lib.ModelConfig, model: config_lib.ModelConfig) -> bool:
    """Field `key` differs as the checkpoint depends on it: moe.mlp_dim as the experts' width
    (0 and mlp_dim's value are the same width)."""
    if _value(saved, key) == _value(model, key):
        return False
    width = lambda m: m.moe.mlp_dim or m.mlp_dim
    return key != "moe.mlp_dim" or width(saved) != width(model)


def _value(model: config_lib.ModelConfig, key: str) -> Any:
    """The field `key` names, dotted into a section (moe.num_experts)."""
    return functools.reduce(getattr, key.split("."), model)


def _change(key: str, saved: config_lib.ModelConfig, model: config_lib.ModelConfig) -> str:
    """`model.key=saved -> now`, as the key and values are written in an override."""
    shown = lambda v: str(v).lower() if isinstance(v, bool) else str(v)
    name = "head_dim" if key == "head_size" else key
    return f"model.{name}={shown(_value(saved, key))} -> {shown(_value(model, key))}"


def _histories(model: config_lib.ModelConfig) -> int:
    """The FP8 amax history length a checkpoint of this model holds (0: none)."""
    return model.fp8_history if model.fp8 == "delayed" else 0


def config_of(meta: dict) -> config_lib.Config:
    """The run config a checkpoint was saved with (its meta's YAML, read through the schema);
    keys the schema no longer has (a checkpoint of an older version) are left out."""
    tree = yaml.safe_load(meta["config"]) or {}
    if isinstance(tree.get("model"), dict):  # a checkpoint of before model.moe: its keys moved
        tree = {**tree, "model": config_lib.nested(tree["model"])}
    tree = _known(tree, config_lib.Config)
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(yaml.safe_dump(tree))
        f.flush()
        try:
            return config_lib.load([f.name])
        except ConfigError as e:
            raise ConfigError(str(e).replace(f.name, "the checkpoint's config")) from None


def _known(tree: Any, schema: type) -> Any:
    """`tree` without the keys `schema` (a config dataclass) has not."""
    if not isinstance(tree, dict):
        return tree
    hints = typing.get_type_hints(schema)
    return {k: _known(v, hints[k]) if dataclasses.is_dataclass(hints[k]) else v
            for k, v in tree.items() if k in hints}


def _open_leaf(step_dir: Path) -> Callable[[tuple[str, ...]], Any]:
    """A function opening one array of the `state` item (by its key path) with TensorStore."""
    import tensorstore as ts

    state = step_dir / "state"
    flags = json.loads((state / "_METADATA").read_text())
    driver = "zarr3" if flags.get("use_zarr3") else "zarr"

    def open_leaf(keys: tuple[str, ...]) -> Any:
        name = ".".join(keys)
        store = ({"driver": "ocdbt", "base": f"file://{state}", "path": name}
                 if flags.get("use_ocdbt", True) else {"driver": "file", "path": str(state / name)})
        try:
            return ts.open({"driver": driver, "kvstore": store}, open=True).result()
        except ValueError:
            raise ConfigError(f"{step_dir} has no array {name}") from None

    return open_leaf


def reader(path: str | Path) -> tuple[config_lib.Config, dict, Getter]:
    """(run config, meta, get) for the checkpoint `path` names; get(param path, layer) reads one
    weight (layer None), or one layer of a stacked one: the param path starts with its stack
    (`layers`, or DeepSeek-V3's `dense_layers`) and `layer` is the index in that stack in model
    order (layer_slots; the model layer itself where `layers` is the only stack), as
    jaxtron.hf.hf_layout and write_pretrained give them."""
    _, step_dir = locate(path)
    meta = read_meta(step_dir)
    cfg, open_leaf = config_of(meta), _open_leaf(step_dir)
    order = list(meta.get("layer_order", range(cfg.model.num_layers)))
    model_layer = {slot: i for i, slot in enumerate(layer_slots(cfg.model))}

    def get(param_path: tuple[str, ...], layer: int | None) -> np.ndarray:
        if layer is None:
            return _read(open_leaf(("params", *param_path)), step_dir)
        if meta.get("layout") == LAYERED:
            i = model_layer[param_path[0], layer]
            return _read(open_leaf(("params", "layer", str(i), *param_path[1:])), step_dir)
        # a pipeline stores `layers` in its stage order; other stacks stay in model order
        stored = order.index(layer) if param_path[0] == "layers" else layer
        return _read(open_leaf(("params", *param_path))[stored], step_dir)

    return cfg, meta, get


def _read(array: Any, step_dir: Path) -> np.ndarray:
    """One TensorStore array into memory; a damaged file (truncated, missing) is one line."""
    try:
        return np.asarray(array.read().result())
    except ValueError as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"checkpoint {step_dir} is damaged ({why}); name an older one "
                          f"(.../checkpoints/<step>)") from None


def read_params(path: str | Path) -> tuple[config_lib.Config, dict]:
    """(run config, params as our pure nested dict of numpy arrays, layers in model order) of
    the checkpoint `path` names: the whole model in host memory, for small models and tools."""
    import jax
    from flax import nnx

    from jaxtron.model import abstract_model

    cfg, _, get = reader(path)
    abstract = nnx.to_pure_dict(nnx.state(abstract_model(cfg.model), nnx.Param))
    stacks = {stack for stack, _ in layer_slots(cfg.model)}

    def read(keys, leaf) -> np.ndarray:
        path = tuple(k.key for k in keys)
        if path[0] not in stacks:
            return get(path, None)
        return np.stack([get(path, i) for i in range(leaf.shape[0])])

    return cfg, jax.tree_util.tree_map_with_path(read, abstract)


def write_layers(step_dir: Path, top: dict, layers: Iterable[dict], meta: dict) -> None:
    """Write a checkpoint holding `top` (params outside the layers, nested) and each of
    `layers` (one nested dict per layer, in model order, its paths inside the layer: without
    its stack's name, which layer_slots gives on restore) with one Orbax partial save per layer,
    so that only one layer is in memory; the meta item last, which completes it."""
    import orbax.checkpoint as ocp
    from orbax.checkpoint import v1

    if step_dir.exists():
        raise ConfigError(f"{step_dir} already exists; choose a new output directory")
    step_dir.parent.mkdir(parents=True, exist_ok=True)
    v1.partial.save(step_dir, {"params": top})
    for i, layer in enumerate(layers):
        v1.partial.save(step_dir, {"params": {"layer": {str(i): layer}}})
    v1.partial.finalize(step_dir)
    ocp.Checkpointer(ocp.JsonCheckpointHandler()).save(step_dir / "meta",
                                                       {**meta, "layout": LAYERED})


def restore_layers(step_dir: Path, abstract_params: dict, shardings: dict) -> dict:
    """The params of a checkpoint written by write_layers, stacked in model order straight into
    `shardings`: one weight at a time (its layers read sharded like one slice of the stack,
    then stacked on the devices), so at most one weight is held twice. Each stack takes its
    model layers (layer_slots of the checkpoint's model: DeepSeek-V3's `dense_layers` the first
    ones, `layers` the rest)."""
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    handler = ocp.PyTreeCheckpointHandler()
    flat_abs = jax.tree_util.tree_flatten_with_path(abstract_params)[0]
    flat_sh = jax.tree.leaves(shardings)
    slots = layer_slots(config_of(read_meta(step_dir)).model)
    model_layer = {slot: str(i) for i, slot in enumerate(slots)}

    def restore(target: dict) -> dict:
        args = ocp.args.PyTreeRestore(
            target, restore_args=ocp.checkpoint_utils.construct_restore_args(target),
            partial_restore=True)
        return ocp.Checkpointer(handler).restore(step_dir / "state", args=args)

    out = []
    for (keys, leaf), sharding in zip(flat_abs, flat_sh):
        path = tuple(k.key for k in keys)
        if (path[0], 0) not in model_layer:  # not a stack of layers
            sds = jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
            out.append(_at(restore({"params": _nest_one(path, sds)})["params"], path))
            continue
        one = NamedSharding(sharding.mesh, P(*sharding.spec[1:]))
        sds = jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=one)
        names = [model_layer[path[0], i] for i in range(leaf.shape[0])]  # its model layers
        target = {"params": {"layer": {name: _nest_one(path[1:], sds) for name in names}}}
        layers = restore(target)["params"]["layer"]
        parts = [_at(layers[name], path[1:]) for name in names]
        out.append(jax.jit(jnp.stack, out_shardings=sharding)(parts))
        for part in parts:
            part.delete()
    return jax.tree.unflatten(jax.tree.structure(abstract_params), out)


def _nest_one(path: tuple[str, ...], value: Any) -> dict:
    for key in reversed(path):
        value = {key: value}
    return value


def _at(tree: dict, path: tuple[str, ...]) -> Any:
    for key in path:
        tree = tree[key]
    return tree
