"""Show what a jaxtron checkpoint holds, without loading its arrays.

    jaxtron inspect-ckpt runs/tiny                  # list the checkpoints, show the latest
    jaxtron inspect-ckpt runs/tiny/checkpoints      # the same
    jaxtron inspect-ckpt runs/tiny/checkpoints/200  # one checkpoint

Prints the step, the saved metadata (loss, tokens seen, save time, or where an import came from;
the model section of the config, with experts, FP8 and q/k norms where set),
every array of the `state` item with its shape, dtype and bytes (from Orbax's metadata: nothing is
read but the small metadata files) and totals. Each listed checkpoint's files are checked against
the sizes its OCDBT tree records: a truncated or missing one marks it damaged, as do metadata
files missing or garbled and a step directory left empty (jaxtron/checkpoint/damage.py); a damaged
checkpoint shown (a listing shows the newest) ends in one line on stderr, exit status 1. A path
that is not a checkpoint: one line on stderr, exit status 2. Only files and Orbax are used, not
jaxtron's config schema, so checkpoints written under older or newer schemas still read.
"""

from __future__ import annotations

import datetime
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from jaxtron import cli, lifecycle
from jaxtron.checkpoint.damage import damage, meta_damage, step_dirs, survey
from jaxtron.checkpoint.weights import locate, read_meta
from jaxtron.config import ConfigError, nested
from jaxtron.lifecycle import one_line_errors

MODEL_KEYS = ("num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
              "vocab_size", "tie_embeddings", "dtype", "param_dtype", "remat")
# Shown only where they change the model from the plain dense one: experts (with their top-k and
# width), FP8 matmuls, q/k norms, QKV biases, an attention window.
SET_KEYS = {"moe.num_experts": lambda m: m.get("moe.num_experts"),
            "moe.experts_per_token": lambda m: m.get("moe.num_experts"),
            "moe.mlp_dim": lambda m: m.get("moe.num_experts") and m.get("moe.mlp_dim"),
            "fp8": lambda m: m.get("fp8", "none") != "none",
            "qk_norm": lambda m: m.get("qk_norm"), "qkv_bias": lambda m: m.get("qkv_bias"),
            "sliding_window": lambda m: m.get("sliding_window")}


def read_arrays(step_dir: Path) -> tuple[list[tuple[str, tuple, np.dtype]], Any]:
    """(dotted name, shape, dtype) of every array in the `state` item, and the first array's
    saved sharding; from Orbax's tree metadata, no array data read."""
    # Imported here so that a bad path is reported at once, without jax's start-up.
    import jax
    import orbax.checkpoint as ocp

    # Orbax describes the saved shardings with this machine's devices, which the metadata read
    # needs no more of than the CPU's: not a GPU's memory a run may be using, nor a backend
    # JAX_PLATFORMS names that cannot start here (seen as damage, AssertionError, before).
    jax.config.update("jax_platforms", "cpu")  # read when the first backend starts
    try:
        tree = ocp.PyTreeCheckpointHandler().metadata(step_dir.absolute() / "state").tree
    except Exception as e:  # noqa: BLE001 - any Orbax failure means an unreadable checkpoint
        first = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
        raise ConfigError(f"{step_dir}: unreadable state metadata ({first})") from None
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]  # empty optax states (None) drop out
    arrays = [(jax.tree_util.keystr(path, simple=True, separator="."), tuple(leaf.shape),
               np.dtype(leaf.dtype)) for path, leaf in leaves]
    return arrays, getattr(leaves[0][1], "sharding", None) if leaves else None


# ---------------------------------------------------------------- printing
def human(num_bytes: int) -> str:
    """1536 -> '1.5 KiB'."""
    if num_bytes < 1024:
        return f"{num_bytes} B"
    power = min((num_bytes.bit_length() - 1) // 10, 4)  # 1024**power <= num_bytes
    return f"{num_bytes / 1024**power:.1f} {('KiB', 'MiB', 'GiB', 'TiB')[power - 1]}"


def model_summary(config_yaml: str) -> str:
    """The config's model section on one line: the keys of MODEL_KEYS that it has, then those of
    SET_KEYS that are set."""
    try:
        model = (yaml.safe_load(config_yaml) or {}).get("model", {})
    except yaml.YAMLError:
        return "(config unreadable)"
    if not isinstance(model, dict):
        return "(no model section)"
    model = nested(model)  # a checkpoint of before model.moe: its keys moved
    moe = model.pop("moe", None)
    model.update({f"moe.{k}": v for k, v in moe.items()} if isinstance(moe, dict) else {})
    keys = [k for k in MODEL_KEYS if k in model]
    keys += [k for k, is_set in SET_KEYS.items() if k in model and is_set(model)]
    return ", ".join(f"{k}={model[k]}" for k in keys) or "(no model section)"


def mesh_summary(sharding: Any) -> str | None:
    """'data=1 stage=1 fsdp=8 tensor=1' from a saved NamedSharding's metadata, if it is one."""
    names, shape = getattr(sharding, "axis_names", None), getattr(sharding, "shape", None)
    if names is None or shape is None:
        return None
    return " ".join(f"{n}={int(s)}" for n, s in zip(names, np.asarray(shape).ravel())
                    if n not in ("context", "expert") or int(s) != 1)  # where they split


def print_listing(checkpoints_dir: Path) -> dict[Path, str]:
    """Every checkpoint (every step directory) with its loss, or why it cannot be restored (its
    metadata or array files); returns the damaged ones with that reason."""
    steps = step_dirs(checkpoints_dir)
    damaged = survey(checkpoints_dir)[1]
    note = f", {len(damaged)} of them damaged" if damaged else ""
    print(f"{checkpoints_dir.absolute()}: {cli.plural(len(steps), 'complete checkpoint')}{note}")
    for step_dir in steps:
        meta = {} if step_dir in damaged else read_meta(step_dir)
        status = (f"damaged ({damaged[step_dir]})" if step_dir in damaged
                  else f"imported from {meta['source']}" if "source" in meta  # never trained
                  else f"loss {meta.get('loss')!r}")
        print(f"  step {int(step_dir.name):>8}  {status}")
    print()
    return damaged


def print_checkpoint(step_dir: Path) -> None:
    """Metadata, the array tree and the totals of one checkpoint."""
    meta = read_meta(step_dir)
    arrays, sharding = read_arrays(step_dir)
    saved = meta.get("time")
    when = "unknown"
    if isinstance(saved, (int, float)):
        local = datetime.datetime.fromtimestamp(saved).astimezone()
        when = local.isoformat(sep=" ", timespec="seconds")
    tokens = meta.get("tokens_seen")
    print(f"checkpoint:  {step_dir.absolute()}")
    print(f"step:        {meta.get('step', step_dir.name)}")
    if "source" in meta:  # jaxtron convert-hf import's: weights only, never trained here
        print(f"imported:    from {meta['source']} (weights only; no loss, no optimizer state)")
    else:
        print(f"loss:        {meta.get('loss')!r}")
        print(f"tokens seen: {tokens:,}" if isinstance(tokens, int) else f"tokens seen: {tokens}")
        print(f"saved at:    {when}")
    print(f"model:       {model_summary(meta.get('config', ''))}")
    mesh = mesh_summary(sharding)
    if mesh:
        print(f"saved mesh:  {mesh}")
    print("state:")
    width = max((len(name) for name, _, _ in arrays), default=0)
    totals: dict[str, list[int]] = {}
    for name, shape, dtype in arrays:
        size = math.prod(shape)
        num_bytes = size * dtype.itemsize
        print(f"  {name:<{width}}  {str(shape):<18} {dtype.name:<9} {num_bytes:>13,} B")
        part = totals.setdefault(name.split(".")[0], [0, 0])
        part[0], part[1] = part[0] + size, part[1] + num_bytes
    params, opt = totals.get("params", [0, 0]), totals.get("opt_state", [0, 0])
    print(f"parameters:      {params[0]:,}")
    print(f"params bytes:    {params[1]:,} ({human(params[1])})")
    print(f"optimizer bytes: {opt[1]:,} ({human(opt[1])})")
    print(f"total bytes:     {sum(b for _, b in totals.values()):,} "
          f"({human(sum(b for _, b in totals.values()))})")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = cli.Parser(command="tools/inspect_ckpt.py", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, help="a checkpoint (.../checkpoints/<step>), "
                        "a checkpoints directory or a run directory")
    args = parser.parse_args(argv)
    return one_line_errors(lambda: inspect(args.path))


def inspect(path: Path) -> int:
    """Print the listing (for a run or checkpoints directory), then the checkpoint itself; exit
    status 1 when that checkpoint's files are damaged (a restore would fail on it)."""
    from jaxtron.checkpoint import DAMAGED_DIR

    moved = path.parent.name == DAMAGED_DIR and path.is_dir()  # <step>-<time>
    listing, step_dir = (None, path.absolute()) if moved else locate(path)
    if listing is not None:  # the newest, damaged or not: the one a resume tries first
        damaged, step_dir = print_listing(listing), step_dirs(listing)[-1].absolute()
    else:
        damaged = {step_dir: why} if (why := damage(step_dir)) else {}
    why = damaged.get(step_dir)
    readable = not meta_damage(step_dir) and (step_dir / "state" / "manifest.ocdbt").is_file()
    if not why or readable:  # else there is nothing to show but the damage
        print_checkpoint(step_dir)
    if not why:
        return 0
    older = [] if moved else [p for p in survey(step_dir.parent)[0]
                              if int(p.name) < int(step_dir.name)]
    fallback = (f"a resume moves it aside and starts from step {older[-1].name}" if older
                else "a resume moved it aside (the run goes on from its other checkpoints)"
                if moved else "no older undamaged checkpoint is left")
    print(f"{lifecycle.script_name()}: error: checkpoint {step_dir} is damaged ({why}); {fallback}",
          file=sys.stderr)
    return 1

