"""Mixture of experts: a top-k router and SwiGLU experts run as grouped (ragged) matmuls, dropless
unless model.capacity_factor says otherwise, split over the `expert` mesh axis.

Per layer: router logits [B, T, E] = x W_router in float32; probabilities the softmax over all E;
each token's top k of them (renormalized to sum to 1 when norm_topk_prob) weight its experts'
outputs. Mixtral's softmax over its top-k logits is the same numbers.

The experts run inside one `shard_map` over the mesh: each device holds E/|expert| experts (their
D gathered over fsdp, F split over tensor) and its own rows of the batch. The tokens of an
`expert` group go round a ring of permutes (`_local_experts`); at each step a device sorts the
(token, choice) pairs that picked its own experts into contiguous groups, runs gate, up and down
as three grouped matmuls over those rows only, and adds the weighted results onto the partial
outputs travelling with the tokens; a sum over `tensor` closes the row-parallel down projection.
Static shapes: a step's sorted buffer has room for all n * k pairs, the kernels work on the rows
the group sizes cover. docs/parallelism.md says why a ring and not an all-to-all.

Also here: the load-balancing loss (transformers' Mixtral form, per sequence), the router z-loss
and the load statistics. Each layer returns sums (per sequence where the loss needs it); the step
adds them over layers and microbatches and only then forms ratios, so that the objective and
every statistic are the same however the step is split (microbatches, mesh): `sequence_aux`.

Shape key: B batch, T sequence, D d_model, E experts, k experts per token, F expert width,
n tokens on a device, R sorted rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from jaxtron.config import ConfigError, ModelConfig
from jaxtron.model.layers import param

KERNELS = ("auto", "xla", "mosaic", "triton")
# model.moe_kernel -> tokamax's name of its ragged_dot implementation
TOKAMAX = {"mosaic": "mosaic_gpu", "triton": "triton"}
EXPERT_AXIS = "expert"
_BATCH = ("data", "fsdp", EXPERT_AXIS)  # act_batch in parallel.RULES
# what every layer returns (`_router_sums`): per sequence [B, E] the (token, choice) pairs that
# picked each expert and the sum of its router probabilities over real tokens; the sum of the
# squared router logsumexps; the routed pairs and those dropped over capacity
STAT_KEYS = ("picked", "probs", "z", "routed", "dropped")
# the dtypes tokamax's grouped kernels take (`check`)
KERNEL_DTYPES = ("bfloat16", "float16")


def check(cfg: ModelConfig) -> None:
    """The kernel name, and that tokamax has the kernel asked for here."""
    if cfg.moe_kernel not in KERNELS:
        raise ConfigError(f"model.moe_kernel={cfg.moe_kernel} is not one of {', '.join(KERNELS)}")
    if cfg.num_experts and cfg.moe_kernel in TOKAMAX and not available(cfg.moe_kernel):
        raise ConfigError(f"model.moe_kernel={cfg.moe_kernel} needs {_NEEDS[cfg.moe_kernel]} "
                          f"(here jax {jax.__version__}, tokamax {_version()}); pip install -e "
                          "'.[gpu-aot]' installs the one for this Python, or model.moe_kernel=xla")
    if cfg.num_experts and cfg.moe_kernel in TOKAMAX and cfg.dtype not in KERNEL_DTYPES:
        raise ConfigError(f"model.moe_kernel={cfg.moe_kernel} takes bfloat16 or float16 experts, "
                          f"not model.dtype={cfg.dtype}: model.dtype=bfloat16, or "
                          "model.moe_kernel=xla")


_NEEDS = {"mosaic": "tokamax (0.0.12 on jax 0.10, 0.0.17 on jax 0.11)",
          "triton": "tokamax 0.0.12 on jax 0.10"}


def _tokamax():
    try:
        import tokamax  # noqa: PLC0415 (optional: the GPU kernels)
    except ImportError:
        return None
    logging.getLogger("absl").addFilter(_quiet)
    return tokamax


def _version() -> str:
    tokamax = _tokamax()
    return getattr(tokamax, "__version__", "?") if tokamax else "not installed"


def _quiet(record: logging.LogRecord) -> bool:
    """Drop tokamax's warning per kernel call that no autotuned tiling is cached (it uses its
    heuristic one; nothing is autotuned ahead of a run)."""
    return not str(record.msg).startswith("Autotuning cache miss")


def available(kind: str) -> bool:
    """tokamax's ragged_dot implementation `kind` (a key of TOKAMAX) works here. Mosaic GPU (its
    sm90 kernel on H100s): tokamax 0.0.12 on jax 0.10, 0.0.17 on jax 0.11. Triton: tokamax 0.0.12
    on jax 0.10 only (its kernel calls `pallas.dot`, which jax 0.11 removed; later releases have
    no Triton ragged_dot)."""
    if _tokamax() is None or (kind == "triton" and jax.__version__ >= "0.11"):
        return False
    try:
        from tokamax._src.ops.ragged_dot import api  # noqa: PLC0415
    except ImportError:
        return False
    return TOKAMAX[kind] in api.IMPLEMENTATIONS


def kernel(cfg: ModelConfig, platform: str | None = None) -> str:
    """The grouped-matmul kernel model.moe_kernel means on `platform` (jax's default backend;
    --compile-for settles it for GPUs before tracing, jaxtron/plan/aot.py): on GPUs tokamax's
    Mosaic GPU kernel where it is installed and takes the compute dtype (bf16, f16), else
    XLA's."""
    if cfg.moe_kernel != "auto":
        return cfg.moe_kernel
    platform = platform or jax.default_backend()
    gpu = platform in ("gpu", "cuda") and cfg.dtype in KERNEL_DTYPES
    return "mosaic" if gpu and available("mosaic") else "xla"


def configure(cfg, platform: str):
    """A Config with model.moe_kernel resolved for devices of `platform` (`kernel`)."""
    if not cfg.model.num_experts or cfg.model.moe_kernel != "auto":
        return cfg
    model = dataclasses.replace(cfg.model, moe_kernel=kernel(cfg.model, platform))
    return dataclasses.replace(cfg, model=model)


class MoE(nnx.Module):
    """E SwiGLU experts and a router [D, E] in place of the dense MLP. The experts' weights are
    [E, D, F], W_down too ([E, D, F], each expert's [F, D] transposed, as Hugging Face stores
    it: transposed per layer in the compute dtype). Measured on the H100 compile against
    [E, F, D] for W_down (Qwen3-30B-A3B on 8: 67.1 against 70.6 GiB) and against D first,
    [D, E, F] (67.1 against 75.1 GiB; Mixtral 8x7B on 16: 62.8 against 63.3): XLA kept
    transposed float32 copies of whole weight stacks through the step otherwise."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, e = cfg.d_model, cfg.moe_mlp_dim or cfg.mlp_dim, cfg.num_experts
        self.cfg = cfg
        self.router = param(rngs, cfg, (d, e), ("embed", None))
        for name in ("w_gate", "w_up", "w_down"):
            setattr(self, name, param(rngs, cfg, (e, d, f), ("experts", "expert_embed", "mlp")))

    def __call__(self, x_BTD: jax.Array, segment_ids_BT: jax.Array | None = None
                 ) -> tuple[jax.Array, dict]:
        """(outputs [B, T, D], this layer's router sums `STAT_KEYS`). Padding tokens (segment
        0) are routed nowhere: their output is 0 and they count in no statistic."""
        cfg = self.cfg
        real_BT = (jnp.ones(x_BTD.shape[:2], bool) if segment_ids_BT is None
                   else segment_ids_BT != 0)
        logits_BTE = jnp.einsum("btd,de->bte", x_BTD.astype(jnp.float32),
                                self.router[...].astype(jnp.float32))
        probs_BTE = jax.nn.softmax(logits_BTE, axis=-1)
        weight_BTk, expert_BTk = jax.lax.top_k(probs_BTE, cfg.experts_per_token)
        if cfg.norm_topk_prob:
            weight_BTk = weight_BTk / jnp.sum(weight_BTk, axis=-1, keepdims=True)
        routed_BTk = jnp.broadcast_to(real_BT[..., None], expert_BTk.shape)
        stats = _router_sums(logits_BTE, probs_BTE, expert_BTk, real_BT, cfg.num_experts)
        if cfg.capacity_factor > 0:
            kept_BTk = within_capacity(expert_BTk, routed_BTk, cfg)
            stats["dropped"] = jnp.sum(routed_BTk & ~kept_BTk).astype(jnp.float32)
            routed_BTk = kept_BTk
        # a pair routed nowhere gets expert E: it sorts after every real group, and no kernel
        # reads it
        expert_BTk = jnp.where(routed_BTk, expert_BTk, cfg.num_experts)
        weights = [_expert_weights(self.cfg, w) for w in (self.w_gate, self.w_up, self.w_down)]
        y_BTD = experts(cfg, x_BTD, expert_BTk, weight_BTk.astype(cfg.dtype), *weights)
        return y_BTD, stats


def _expert_weights(cfg: ModelConfig, p: nnx.Param) -> jax.Array:
    """An expert weight [D, E, F] in the compute dtype (gathered over fsdp at the shard_map:
    pinned here inside the layer instead, as `_gathered` does for the dense layers, the compiled
    Mixtral step was the same, its gathers as exposed)."""
    return p[...].astype(cfg.dtype)


def _router_sums(logits_BTE, probs_BTE, expert_BTk, real_BT, num_experts: int) -> dict:
    """One layer's router sums over real tokens (`STAT_KEYS`): per sequence the pairs that
    picked each expert [B, E] and the router probabilities [B, E], the squared logsumexps, the
    routed pairs (dropped: 0, `MoE` sets it under a capacity). Sums, never ratios: the step adds
    them over layers and microbatches before forming any (`sequence_aux`, `metrics`)."""
    real = real_BT.astype(jnp.float32)
    picked_BE = jnp.sum(jax.nn.one_hot(expert_BTk, num_experts, dtype=jnp.float32)
                        * real[..., None, None], axis=(1, 2))
    probs_BE = jnp.sum(probs_BTE * real[..., None], axis=1)
    z = jnp.sum(jax.nn.logsumexp(logits_BTE, axis=-1) ** 2 * real)
    routed = jnp.sum(real) * expert_BTk.shape[-1]
    return {"picked": jax.lax.stop_gradient(picked_BE), "probs": probs_BE, "z": z,
            "routed": routed, "dropped": jnp.zeros((), jnp.float32)}


def sequence_aux(picked_LBE: jax.Array, probs_LBE: jax.Array, tokens_B: jax.Array) -> jax.Array:
    """The load-balancing loss of each sequence, times its real tokens, summed over sequences
    (the objective adds coef x this; divided by the step's tokens it is the logged
    moe_aux_loss).

    Per sequence b it is transformers' Mixtral / Qwen3-MoE loss (`load_balancing_loss_func`
    with `output_router_logits=True`) of that sequence alone: E * sum_e f_e P_e with f_e the
    share of its (token, choice) pairs over all L layers that picked e and P_e e's mean router
    probability over its tokens and all layers; k when balanced. transformers pools f and P
    over its whole batch instead; pooled over a step, f would need every microbatch's routing
    before any backward, so the loss would change with the microbatch count (which auto
    chooses) or cost a second forward. Per sequence, the objective is the same whatever the
    split, as DeepSeek-V3's sequence-wise balance loss is."""
    layers, _, experts = picked_LBE.shape
    picked_BE, probs_BE = jnp.sum(picked_LBE, axis=0), jnp.sum(probs_LBE, axis=0)
    tokens_B = tokens_B.astype(jnp.float32)
    per_token_B = experts * jnp.sum(picked_BE * probs_BE, axis=-1) / layers ** 2
    return jnp.sum(per_token_B / jnp.maximum(tokens_B, 1.0))


def within_capacity(expert_BTk: jax.Array, routed_BTk: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Which routed pairs an expert takes under model.capacity_factor: from each sequence at most
    ceil(cf * T * k / E) pairs, first choices before second ones, tokens in order within a
    choice (Switch's priority; per sequence as MaxText's capacity). Per sequence, the same pairs
    are dropped however the step is split (microbatches, mesh)."""
    b, t, k = expert_BTk.shape
    capacity = math.ceil(cfg.capacity_factor * t * k / cfg.num_experts)
    onehot = (jax.nn.one_hot(expert_BTk, cfg.num_experts, dtype=jnp.int32)
              * routed_BTk[..., None])  # [B, T, k, E]
    by_choice = onehot.transpose(0, 2, 1, 3).reshape(b, k * t, cfg.num_experts)
    position = jnp.cumsum(by_choice, axis=1) - by_choice  # pairs before this one, per expert
    position = jnp.sum(position * by_choice, axis=-1).reshape(b, k, t).transpose(0, 2, 1)
    return routed_BTk & (position < capacity)


def experts(cfg: ModelConfig, x_BTD, expert_BTk, weight_BTk, w_gate, w_up, w_down) -> jax.Array:
    """sum_j weight[j] * SwiGLU_{expert[j]}(x) per token [B, T, D], the pairs with expert E
    (routed nowhere) left out; across the mesh in one shard_map (the module docstring). The
    weights as stored, [E, D, F]."""
    mesh = jax.sharding.get_abstract_mesh()

    def local(x_BTD, expert_BTk, weight_BTk, w_gate, w_up, w_down):
        return _local_experts(cfg, kernel(cfg), x_BTD, expert_BTk, weight_BTk, w_gate,
                              w_up, w_down.transpose(0, 2, 1))

    if mesh.empty:
        return local(x_BTD, expert_BTk, weight_BTk, w_gate, w_up, w_down)
    batch = P(_BATCH, None, None)
    column = row = P(EXPERT_AXIS, None, "tensor")
    axes = set(_BATCH) | {"tensor"}
    run = jax.shard_map(local, in_specs=(batch, batch, batch, column, column, row),
                        out_specs=batch, axis_names=axes, check_vma=False)
    return run(x_BTD, expert_BTk, weight_BTk, w_gate, w_up, w_down)


def _local_experts(cfg: ModelConfig, kind: str, x_BTD, expert_BTk, weight_BTk, w_gate, w_up,
                   w_down) -> jax.Array:
    """One device's part: its tokens [B', T, D], its experts [E', D, F'] (all of them off a
    mesh). Returns its tokens' outputs, summed over the expert and tensor axes.

    Over an expert group of |expert| = G devices the tokens go round a ring: at step s a
    device holds the tokens of the device s places before it, adds what its own experts make of
    them to the partial outputs that travel with them, and passes both on; after G steps and one
    last pass every device holds its own tokens' outputs from all G devices' experts. Each
    step's permutes carry data the step's kernels do not wait for (the next tokens, the partial
    sums of the last ones), so the scheduler can overlap them; and each step runs on its own
    n * k rows, checkpointed (recomputed in its own backward), so that one step's buffers exist
    at a time, not G steps'."""
    b, t, d = x_BTD.shape
    inside = not jax.sharding.get_abstract_mesh().empty
    groups = lambda name: jax.lax.axis_size(name) if inside else 1
    ring = groups(EXPERT_AXIS)
    first = jax.lax.axis_index(EXPERT_AXIS) * w_gate.shape[0] if ring > 1 else 0
    held = tuple(a.reshape(b * t, -1) for a in (x_BTD, expert_BTk, weight_BTk))

    def mine(x_nD, expert_nk, weight_nk, w_gate, w_up, w_down):
        return _my_experts(cfg, kind, x_nD, expert_nk, weight_nk, first, w_gate, w_up, w_down)

    if ring > 1:
        mine = jax.checkpoint(mine, policy=jax.checkpoint_policies.nothing_saveable)
    out_nD = mine(*held, w_gate, w_up, w_down)
    if ring > 1:
        onward = [(i, (i + 1) % ring) for i in range(ring)]
        pass_on = lambda a: jax.lax.ppermute(a, EXPERT_AXIS, onward)
        for _ in range(ring - 1):
            held = tuple(pass_on(a) for a in held)
            out_nD = pass_on(out_nD) + mine(*held, w_gate, w_up, w_down)
        out_nD = pass_on(out_nD)
    if groups("tensor") > 1:
        out_nD = jax.lax.psum(out_nD, "tensor")
    return out_nD.reshape(b, t, d)


def _my_experts(cfg: ModelConfig, kind: str, x_nD, expert_nk, weight_nk, first, w_gate, w_up,
                w_down) -> jax.Array:
    """What experts first .. first+E'-1 (this device's) add to tokens x [n, D] that chose
    experts [n, k] with weights [n, k]: [n, D]. Their pairs are sorted into one group per
    expert, run through the grouped kernels, and brought back to their tokens. The router's
    weight scales the hidden activations before the down projection (the same sum, by
    linearity), so that the backward never needs the experts' outputs: nothing recomputes
    the down projection."""
    n, k = expert_nk.shape
    local = w_gate.shape[0]
    mine_nk = (expert_nk >= first) & (expert_nk < first + local)
    group_R = jnp.where(mine_nk, expert_nk - first, local).reshape(-1)
    order_R = jnp.argsort(group_R, stable=True)
    inverse_R = jnp.argsort(order_R)
    sizes = jnp.bincount(group_R, length=local + 1)[:local].astype(jnp.int32)
    # each token once per choice, in (token, choice) order, then grouped by expert; pairs of
    # other devices' experts last, where no kernel reads or writes
    x_RD = permute(jnp.repeat(x_nD, k, axis=0), order_R, inverse_R)
    scale_R = permute(jnp.where(mine_nk, weight_nk, 0).reshape(-1), order_R, inverse_R)
    dot = _past_groups_zero(_grouped(kind))  # whatever kernel: nothing trusted past the groups
    h_RF = jax.nn.silu(dot(x_RD, w_gate, sizes)) * dot(x_RD, w_up, sizes)
    y_RD = dot(h_RF * scale_R[:, None].astype(h_RF.dtype), w_down, sizes)
    y_nkD = permute(y_RD, inverse_R, order_R).reshape(n, k, -1)  # (token, choice) order
    return jnp.sum(jnp.where(mine_nk[..., None], y_nkD, 0), axis=1)


@jax.custom_vjp
def permute(x: jax.Array, order: jax.Array, inverse: jax.Array) -> jax.Array:
    """x[order] for a permutation `order` whose inverse is `inverse`: a gather both ways (the
    gradient is g[inverse]), where autodiff would scatter-add, which GPUs run in float32
    atomics over copies of the whole buffer."""
    return x[order]


def _permute_fwd(x, order, inverse):
    return x[order], (order, inverse)


def _permute_bwd(res, g):
    order, inverse = res
    return g[inverse], None, None


permute.defvjp(_permute_fwd, _permute_bwd)


def _grouped(kind: str):
    """dot(x [R, K], w [G, K, N], sizes [G]) -> [R, N]: row r times the weight of its group;
    rows past sum(sizes) as the kernel leaves them (`_past_groups_zero` makes them zero). `xla`:
    jax.lax.ragged_dot; `mosaic`, `triton`: tokamax's kernels."""
    if kind in TOKAMAX:
        tokamax = _tokamax()
        return lambda x, w, sizes: tokamax.ragged_dot(x, w, sizes, implementation=TOKAMAX[kind])
    return jax.lax.ragged_dot


def _past_groups_zero(dot):
    """A grouped kernel whose rows past sum(sizes) are zero in the result and in x's gradient.
    tokamax's kernels write only each group's own rows, forward and backward (its tests read
    `out[:sum(sizes)]`), and XLA does not zero a custom call's buffer: what is there is whatever
    the buffer held, NaN included. `_my_experts` parks other devices' and unrouted pairs there,
    and permute's transpose would add those rows of x's gradient into their tokens'. A select
    (not a product: 0 * NaN is NaN) on both sides keeps them out; the weights' gradient reads
    only the groups' rows of x and of the output's gradient, both clean."""
    def safe(x_RK, w_GKN, sizes_G):
        inside_R = jnp.arange(x_RK.shape[0]) < jnp.sum(sizes_G)
        x_RK = jnp.where(inside_R[:, None], x_RK, 0)
        return jnp.where(inside_R[:, None], dot(x_RK, w_GKN, sizes_G), 0)

    return safe


@contextlib.contextmanager
def cross_compiling(device):
    """A context in which tokamax lowers its GPU kernels for `device`, a GPU this host lacks (the
    compile-only H100s of --compile-for): tokamax's cross-compile option, and the device as jax's
    default, where tokamax reads the compute capability that picks its kernel (sm90 on H100s)."""
    tokamax = _tokamax()
    if tokamax is None:
        yield
        return
    from absl import flags  # noqa: PLC0415 (tokamax's options are absl flags)

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()  # never parse this program's own argv as absl flags
    with tokamax.config.cross_compile(True), jax.default_device(device):
        yield


def describe_params(cfg: ModelConfig, total: int) -> str:
    """'46,702,792,704' for a dense model; for a mixture of experts the total and the active
    count: what one token runs, every weight less the num_experts - experts_per_token experts it
    skips in every layer."""
    if not cfg.num_experts:
        return f"{total:,}"
    skipped = cfg.num_experts - cfg.experts_per_token
    expert = 3 * cfg.d_model * (cfg.moe_mlp_dim or cfg.mlp_dim)
    active = total - cfg.num_layers * skipped * expert
    return f"{total:,} ({active:,} active per token: {cfg.experts_per_token} of " \
           f"{cfg.num_experts} experts)"


def step_sums(layer_stats: dict, tokens_B: jax.Array) -> dict:
    """A batch's router sums from its layers' (`STAT_KEYS`, stacked [L, ...]): the balancing
    loss times tokens (`sequence_aux`), the z-loss summed over tokens (mean over layers), and
    per layer the pairs per expert [L, E], routed [L] and dropped [L]. All of them add up over
    microbatches to the whole step's (`zero_stats`); `metrics` forms the ratios."""
    return {"aux": sequence_aux(layer_stats["picked"], layer_stats["probs"], tokens_B),
            "z": jnp.mean(layer_stats["z"]),
            "picked": jnp.sum(layer_stats["picked"], axis=1),
            "routed": layer_stats["routed"].astype(jnp.float32),
            "dropped": layer_stats["dropped"].astype(jnp.float32)}


def objective(sums: dict, cfg: ModelConfig) -> jax.Array:
    """What the router losses add to the summed cross-entropy: moe_aux_coef x the balancing loss
    and moe_z_coef x the z-loss, each summed over tokens (their means over the step's tokens
    are what the coefficients weigh, as transformers adds router_aux_loss_coef x aux_loss to
    its mean loss)."""
    return cfg.moe_aux_coef * sums["aux"] + cfg.moe_z_coef * sums["z"]


def zero_stats(params: dict) -> dict:
    """Zeros of `step_sums` for a model with MoE layers (a `router` weight [L, D, E] in
    `params`), {} for a dense one: where accumulation over microbatches starts."""
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    routers = [leaf for path, leaf in paths if "router" in jax.tree_util.keystr(path)]
    if not routers:
        return {}
    layers, _, experts = routers[0].shape
    zero = lambda *shape: jnp.zeros(shape, jnp.float32)
    return {"aux": zero(), "z": zero(), "picked": zero(layers, experts),
            "routed": zero(layers), "dropped": zero(layers)}


def metrics(sums: dict, tokens: jax.Array, capacity: bool) -> dict:
    """The step's router statistics from its summed `step_sums` and real tokens, as logged
    (docs/metrics.md): moe_aux_loss and moe_z_loss (means over tokens), moe_load (the most
    loaded expert's pairs over the mean, the largest over layers), and with a capacity
    moe_dropped (the share of routed pairs dropped, the largest over layers); {} for a dense
    model."""
    if not sums:
        return {}
    tokens = jnp.maximum(tokens.astype(jnp.float32), 1.0)
    picked = sums["picked"]
    load = jnp.max(jnp.max(picked, axis=-1) / jnp.maximum(jnp.mean(picked, axis=-1), 1e-9))
    out = {"moe_aux_loss": sums["aux"] / tokens, "moe_z_loss": sums["z"] / tokens,
           "moe_load": load}
    if capacity:
        out["moe_dropped"] = jnp.max(sums["dropped"] / jnp.maximum(sums["routed"], 1.0))
    return out
