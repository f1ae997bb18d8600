"""The device mesh and the one table that maps logical axis names onto it.

Model code names logical axes only (`embed`, `heads`, `act_batch`, ...). RULES maps each onto
mesh axes; changing a parallelism strategy means editing this table or the mesh config, never the
model. Notation: `W_q[D_fsdp, N_tensor, H]` is a weight whose D dimension is split over `fsdp`,
N over `tensor`, and H replicated.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from jaxtron.config import Config, ConfigError, MeshConfig, TrainConfig
from jaxtron.parallel import features
from jaxtron.parallel.roles import AXIS_ROLES

MESH_AXES = tuple(AXIS_ROLES)  # outermost to innermost (roles.py)
OPTIONAL_AXES = ("context", "expert")  # left out of a layout's sizes where they do not split

RULES: tuple[tuple[str, Any], ...] = (
    # weights
    # W_emb[V_(tensor,stage), D_fsdp], W_head[D_fsdp, V_(tensor,stage)]: pipeline stages split the
    # tables too (every stage uses them), gathered over stage and fsdp before use like FSDP
    ("vocab", ("tensor", "stage")),
    # W_q[D_(fsdp,context,expert), N_tensor, H], W_gate[D_(fsdp,context,expert), F_tensor]: ZeRO-3
    # over D, over the context ranks (they hold other positions of the same sequences) and the
    # expert ranks too (they hold different experts, but the same attention)
    ("embed", ("fsdp", "context", "expert")),
    # latent attention's up projections W_q_b[Q_(fsdp,context), N_tensor, H]: their compressed
    # input dimension (V3's 1536 and 512) ZeRO-3 over fsdp and context, gathered before use; not
    # over expert, whose product with fsdp outgrows it (1,024 for DeepSeek-V3's cluster)
    ("latent", ("fsdp", "context")),
    # MoE experts W_gate[E_expert, D_fsdp, F_tensor]: each expert rank holds its own experts
    ("experts", "expert"),
    ("expert_embed", "fsdp"),
    ("heads", "tensor"),  # W_q[D, N_tensor, H], W_o[N_tensor, H, D]: Megatron column/row split
    ("kv_heads", "tensor"),  # W_k[D, K_tensor, H]: each tensor rank owns whole KV groups
    ("head_dim", None),  # H stays whole: RoPE rotates within it
    ("mlp", "tensor"),  # W_gate[D, F_tensor], W_down[F_tensor, D]
    ("norm", None),  # RMSNorm scales [D] are tiny: replicated
    ("layers", "stage"),  # stacked layers [L_stage, ...]: each pipeline stage holds its own
    # a stack that runs whole, outside the stages (DeepSeek's first dense layers, its
    # multi-token-prediction modules): split over stage, 1 or 3 layers would not divide
    ("stack", None),
    # activations
    # x[B_(data,fsdp,expert), T, D]: batch split over every DP-like axis
    ("act_batch", ("data", "fsdp", "expert")),
    # embedding, LM head and loss, outside the pipeline: the stages split the batch too instead
    # of each repeating the work (stage last, so it refines the (data, fsdp) split locally)
    ("act_batch_io", ("data", "fsdp", "expert", "stage")),
    # x[B, T_context, ...] everywhere: each context rank holds its own positions of every sequence
    # (two pieces of each, jaxtron/parallel/context.py); attention gathers K and V over it
    ("act_ctx", "context"),
    # x[B, T_(context,tensor), D] between blocks: Megatron sequence parallelism within a context
    # rank's positions; norms and residual adds run on T/(context*tensor) positions; all-gather
    # over tensor in, reduce-scatter out
    ("act_seq", ("context", "tensor")),
    ("act_embed", None),  # x[B, T, D]: D whole between blocks
    ("act_heads", "tensor"),  # q[B, T, N_tensor, H]: attention runs on local heads
    ("act_kv_heads", "tensor"),  # k[B, S, K_tensor, H]
    ("act_mlp", "tensor"),  # h[B, T, F_tensor]
    ("act_vocab", "tensor"),  # logits[B, T, V_tensor]; the gathered tables W_emb[V_tensor, D]
    ("act_stage", "stage"),  # pipeline buffers x[S_stage, b, T, D]: each stage's microbatch
)
_RULES = dict(RULES)


def spec(names: tuple[str | None, ...]) -> P:
    """Logical axis names -> a PartitionSpec over mesh axes, per RULES."""
    return P(*(None if name is None else _RULES[name] for name in names))


def constrain(x: jax.Array, names: tuple[str | None, ...]) -> jax.Array:
    """Pin an activation's sharding by logical names; a no-op outside a mesh context. Inside a
    `shard_map` the axes it made manual are left out: there x is already this device's part."""
    if jax.sharding.get_abstract_mesh().empty:
        return x
    return jax.lax.with_sharding_constraint(x, spec_here(names))


def manual_axes() -> set[str]:
    """The mesh axes a `shard_map` has made manual at this point of the program (a pipeline's
    stage and data axes inside its stages)."""
    mesh = jax.sharding.get_abstract_mesh()
    return {a for a, kind in zip(mesh.axis_names, mesh.axis_types)
            if kind == jax.sharding.AxisType.Manual}


def spec_here(names: tuple[str | None, ...]) -> P:
    """`spec(names)` without the mesh axes that are manual at this point of the program."""
    manual = manual_axes()
    if not manual:
        return spec(names)

    def keep(entry):
        axes = tuple(a for a in ((entry,) if isinstance(entry, str) else entry or ())
                     if a not in manual)
        return None if not axes else axes[0] if len(axes) == 1 else axes

    return P(*(keep(entry) for entry in spec(names)))


def mesh_shape(cfg: MeshConfig, num_devices: int) -> dict[str, int]:
    """Resolve the one -1 entry and check the product equals the device count."""
    sizes = {axis: getattr(cfg, axis) for axis in MESH_AXES}
    free = [axis for axis, size in sizes.items() if size == -1]
    bad = [axis for axis, size in sizes.items() if size == 0 or size < -1]
    if bad:
        raise ConfigError(f"mesh.{bad[0]}={sizes[bad[0]]} must be a positive size or -1")
    if len(free) > 1:
        raise ConfigError("only one mesh axis may be -1, got "
                          f"{', '.join('mesh.' + a for a in free)} "
                          f"(one may come from the preset); give the others a size, e.g. "
                          f"mesh.{[a for a in free if a != 'data'][0]}=1")
    fixed = math.prod(size for size in sizes.values() if size != -1)
    if free:
        if num_devices % fixed:
            raise ConfigError(
                f"mesh axes other than {free[0]} multiply to {fixed}, which does not divide the "
                f"{num_devices} device{'' if num_devices == 1 else 's'}; change the mesh sizes so "
                f"that they divide {num_devices}"
            )
        sizes[free[0]] = num_devices // fixed
    product = math.prod(sizes.values())
    if product != num_devices:
        shown = describe(sizes)
        raise ConfigError(
            f"mesh ({shown}) has {product} device{'' if product == 1 else 's'} but {num_devices} "
            f"{'is' if num_devices == 1 else 'are'} available; "
            "make the product match or set one axis to -1"
        )
    for axis in OPTIONAL_AXES:  # a layout without them has the four axes it always had
        if sizes[axis] == 1:
            del sizes[axis]
    return sizes


def describe(sizes: dict[str, int]) -> str:
    """'data=1, stage=1, fsdp=8, tensor=1': the mesh's sizes, `context` and `expert` only where
    they split."""
    return ", ".join(f"{a}={s}" for a, s in sizes.items() if a not in OPTIONAL_AXES or s != 1)


def host_split(sizes: dict[str, int], per_host: int) -> dict[str, tuple[int, int]]:
    """Each axis's (devices within a host, hosts across) when devices are laid out host-major
    with MESH_AXES outermost to innermost: tensor fills a host's devices first, then fsdp, stage,
    data, as a hybrid mesh (mesh_utils.create_hybrid_device_mesh) places them."""
    room, split = per_host, {}
    for axis in reversed(MESH_AXES):  # a layout without `expert` has it at 1
        within = math.gcd(sizes.get(axis, 1), room)
        split[axis] = (within, sizes.get(axis, 1) // within)
        room //= within
    return split


def crossing_axes(sizes: dict[str, int], per_host: int) -> list[str]:
    """The mesh axes whose device groups span more than one host (their collectives leave
    NVLink for the inter-node network)."""
    split = host_split(sizes, per_host)
    return [axis for axis in MESH_AXES if split[axis][1] > 1]


def describe_hosts(sizes: dict[str, int], per_host: int,
                   need: Callable[[dict[str, int]], str | None] | None = None) -> list[str]:
    """Log lines: which axes cross hosts, and a warning with the HSDP layout when fsdp or tensor
    does (their all-gathers and reduce-scatters run every layer, at network speed). `need(mesh)`:
    None when that layout fits, else what it needs in words; a layout that does not fit is not
    proposed (the line says that fsdp must cross hosts at this size)."""
    num_devices = math.prod(sizes.values())
    if num_devices <= per_host:
        return []
    sizes = {"context": 1, "expert": 1, **sizes}
    split = host_split(sizes, per_host)
    crossing = [f"{a} ({split[a][1]} hosts)" for a in crossing_axes(sizes, per_host)]
    lines = [f"mesh across {num_devices // per_host} hosts of {per_host} devices: "
             f"{', '.join(crossing) or 'no axis'} crosses hosts"]
    for axis in ("tensor", "fsdp"):
        within, across = split[axis]
        if across > 1:
            hint = (f"mesh.data={sizes['data'] * across} mesh.fsdp={within}" if axis == "fsdp"
                    else f"mesh.tensor<={per_host} (tensor parallelism within a node)")
            hsdp = {**sizes, "data": sizes["data"] * across, "fsdp": within}
            if axis == "fsdp" and need is not None and (needs := need(hsdp)):
                lines.append(f"note: mesh.fsdp={sizes[axis]} spans {across} hosts (its "
                             f"collectives leave NVLink every layer), and must: within a node "
                             f"({hint}) it {needs} (jaxtron plan ranks the layouts that fit)")
                continue
            lines.append(f"warning: mesh.{axis}={sizes[axis]} spans {across} hosts, so its "
                         f"collectives leave NVLink every layer; keep it within a node, e.g. "
                         f"{hint} (HSDP: shard within a node, replicate across nodes)")
    return lines


def _host_major(devices: list) -> list:
    """Devices ordered by host (process), then by id within it."""
    return sorted(devices, key=lambda d: (d.process_index, d.id))


def devices_per_host(devices: list) -> int:
    """How many of `devices` the first one's host (process) holds."""
    return sum(d.process_index == devices[0].process_index for d in devices)


def make_mesh(cfg: MeshConfig, devices: list | None = None, per_host: int | None = None) -> Mesh:
    """A Mesh over all devices with axes MESH_AXES, automatic (compiler-propagated) sharding.
    With several hosts, devices are laid out host-major, so the inner axes (tensor, fsdp) stay
    within a host when they fit and data and stage cross hosts (host_split says how)."""
    devices = jax.devices() if devices is None else devices
    sizes = mesh_shape(cfg, len(devices))
    shape = tuple(sizes.get(a, 1) for a in MESH_AXES)
    auto = (jax.sharding.AxisType.Auto,) * len(MESH_AXES)
    per_host = per_host or devices_per_host(devices)
    if per_host >= len(devices) and len(devices) == len(jax.devices()):
        return jax.make_mesh(shape, MESH_AXES, axis_types=auto, devices=devices)
    return Mesh(np.asarray(_host_major(devices)).reshape(shape), MESH_AXES, axis_types=auto)


def _is_spec(x: Any) -> bool:
    return isinstance(x, P)


def logical_specs(abstract_state: nnx.State) -> dict:
    """Each variable's logical PartitionSpec, as a pure dict matching `nnx.to_pure_dict(state)`."""
    return nnx.to_pure_dict(nnx.get_partition_spec(abstract_state))


def mesh_specs(logical_tree: Any) -> Any:
    """RULES applied to a tree of logical PartitionSpecs."""
    return jax.tree.map(lambda s: spec(tuple(s)), logical_tree, is_leaf=_is_spec)


def named(spec_tree: Any, mesh: Mesh) -> Any:
    """A tree of mesh PartitionSpecs -> NamedShardings on `mesh`."""
    return jax.tree.map(lambda s: NamedSharding(mesh, s), spec_tree, is_leaf=_is_spec)


def _split(entry: Any, sizes: dict[str, int]) -> int:
    axes = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(sizes.get(a, 1) for a in axes if a is not None)


def check_divisible(abstract_tree: Any, spec_tree: Any, sizes: dict[str, int],
                    model: Any = None) -> None:
    """Every sharded dimension must split evenly over its mesh axes; the refusal names the
    `model` setting (a ModelConfig) of that size, with the next value that splits."""
    paths = jax.tree_util.tree_flatten_with_path(abstract_tree)[0]
    specs = jax.tree.leaves(spec_tree, is_leaf=_is_spec)
    for (path, leaf), pspec in zip(paths, specs):
        for dim, entry in zip(leaf.shape, pspec):
            parts = _split(entry, sizes)
            if dim % parts:
                name = ".".join(str(getattr(k, "key", k)) for k in path)
                keys = [k for k, v in vars(model or object()).items()
                        if type(v) is int and v == dim]
                fix = (" or ".join(f"model.{k}={(dim // parts + 1) * parts}" for k in keys)
                       if keys else "the model width")
                raise ConfigError(
                    f"parameter {name} {tuple(leaf.shape)}: dimension {dim} does not split over "
                    f"mesh {entry} of size {parts}; change the mesh or {fix}")


def bytes_per_device(abstract_tree: Any, spec_tree: Any, sizes: dict[str, int]) -> int:
    """Bytes one device holds of a sharded pytree (shapes and specs only, nothing allocated)."""
    total = 0
    leaves = jax.tree.leaves(abstract_tree)
    specs = jax.tree.leaves(spec_tree, is_leaf=_is_spec)
    for leaf, pspec in zip(leaves, specs):
        parts = math.prod(_split(entry, sizes) for entry in pspec)
        total += leaf.size * leaf.dtype.itemsize // parts
    return total


def check_layout(cfg: Config, sizes: dict[str, int]) -> None:
    """Checks that need the mesh: the features it turns on against the others (features.py),
    batch, heads and layers against the axes that split them."""
    features.check(cfg, sizes)
    m, t = cfg.model, cfg.train
    for key, value in (("model.num_heads", m.num_heads), ("model.num_kv_heads", m.num_kv_heads)):
        if value % sizes["tensor"]:
            raise ConfigError(f"{key}={value} is not divisible by mesh.tensor={sizes['tensor']}")
    experts, split = m.moe.num_experts, sizes.get("expert", 1)
    if split > 1 and not experts:
        raise ConfigError(f"mesh.expert={split} splits the experts, and this model has none "
                          "(model.moe.num_experts=0); use mesh.fsdp or mesh.data instead")
    if experts and experts % split:
        raise ConfigError(f"model.moe.num_experts={experts} is not divisible by "
                          f"mesh.expert={split}")
    if t.seq_len % sizes["tensor"]:
        raise ConfigError(f"train.seq_len={t.seq_len} is not divisible by mesh.tensor="
                          f"{sizes['tensor']} (sequence parallelism splits it between blocks)")
    if (context := sizes.get("context", 1)) > 1:
        pieces = 2 * context * sizes["tensor"]  # two pieces per context rank, each split by SP
        if t.seq_len % pieces:
            raise ConfigError(
                f"train.seq_len={t.seq_len} is not divisible by 2*mesh.context*mesh.tensor="
                f"{pieces} (each context rank holds two equal pieces of every sequence); use "
                + multiples_near("train.seq_len", t.seq_len, pieces))
    if wrong := batch_split(t, _split(_RULES["act_batch"], sizes)):
        raise ConfigError(wrong)
    io_ways = _split(_RULES["act_batch_io"], sizes)
    per_pass = t.batch_size // cfg.pipeline.passes
    if sizes["stage"] > 1 and per_pass % io_ways:
        raise ConfigError(
            f"train.batch_size={t.batch_size} / pipeline.passes={cfg.pipeline.passes} = {per_pass} "
            f"sequences per pass is not divisible by data*fsdp*stage={io_ways} (the stages share "
            "the embedding and LM head work); use "
            + multiples_near("train.batch_size", t.batch_size, cfg.pipeline.passes * io_ways))


def batch_split(t: TrainConfig, ways: int) -> str | None:
    """What keeps train.batch_size from splitting into train.microbatches of `ways` (data x fsdp)
    shards each, with values that work; None when it splits."""
    if t.batch_size % (t.microbatches * ways) == 0:
        return None
    if t.batch_size % t.microbatches:
        what = f"is not divisible by train.microbatches={t.microbatches}"
    else:
        what = (f"/ train.microbatches={t.microbatches} = {t.batch_size // t.microbatches} "
                f"sequences per microbatch is not divisible by data*fsdp*expert={ways}")
    fewer = [d for d in range(1, t.microbatches) if t.batch_size % (d * ways) == 0]
    return (f"train.batch_size={t.batch_size} {what}; use "
            f"{multiples_near('train.batch_size', t.batch_size, t.microbatches * ways)}"
            + (f", or train.microbatches={max(fewer)}" if fewer else ""))


def multiples_near(key: str, value: int, of: int) -> str:
    """`key=A or B`: the multiples of `of` either side of `value` (A left out when it is 0)."""
    low = value // of * of
    return f"{key}={low} or {low + of}" if low else f"{key}={of}"


def batch_spec() -> P:
    """The sharding of a [batch, seq] input array."""
    return spec(("act_batch", None))
