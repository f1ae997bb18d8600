"""The experts of a mixture-of-experts layer, run over the mesh: SwiGLU experts as grouped
(ragged) matmuls, split over the `expert` mesh axis, and the kernels behind them.

The experts run inside one `shard_map` over the mesh: each device holds E/|expert| experts (their
D gathered over fsdp, F split over tensor) and its own rows of the batch. The tokens of an
`expert` group go round a ring of permutes (`_ring`); at each step a device sorts the
(token, choice) pairs that picked its own experts into contiguous groups, runs gate, up and down
as three grouped matmuls over those rows only, and adds the weighted results onto the partial
outputs travelling with the tokens; a sum over `tensor` closes the row-parallel down projection.
The backward is a ring of its own in the same direction (a custom VJP), so that its permutes too
run beside the kernels.
Static shapes: a step's sorted buffer has room for all n * k pairs, the kernels work on the rows
the group sizes cover. docs/parallelism.md says why a ring and not an all-to-all. The router, its
losses and statistics are the model's (jaxtron/model/moe.py).

Shape key: B batch, T sequence, D d_model, E experts, k experts per token, F expert width,
n tokens on a device, R sorted rows.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtron import parallel
from jaxtron.config import ConfigError, ModelConfig

KERNELS = ("auto", "xla", "mosaic", "triton")
# model.moe.kernel -> tokamax's name of its ragged_dot implementation
TOKAMAX = {"mosaic": "mosaic_gpu", "triton": "triton"}
EXPERT_AXIS = "expert"
_BATCH = ("data", "fsdp", EXPERT_AXIS)  # act_batch in parallel.RULES
# the dtypes tokamax's grouped kernels take (`check`)
KERNEL_DTYPES = ("bfloat16", "float16")

def check(cfg: ModelConfig) -> None:
    """The kernel name, and that tokamax has the kernel asked for here."""
    if cfg.moe.kernel not in KERNELS:
        raise ConfigError(f"model.moe.kernel={cfg.moe.kernel} is not one of {', '.join(KERNELS)}")
    if cfg.moe.num_experts and cfg.moe.kernel in TOKAMAX and not available(cfg.moe.kernel):
        raise ConfigError(f"model.moe.kernel={cfg.moe.kernel} needs {_NEEDS[cfg.moe.kernel]} "
                          f"(here jax {jax.__version__}, tokamax {_version()}); pip install -e "
                          "'.[gpu-aot]' installs the one for this Python, or model.moe.kernel=xla")
    if cfg.moe.num_experts and cfg.moe.kernel in TOKAMAX and cfg.dtype not in KERNEL_DTYPES:
        raise ConfigError(f"model.moe.kernel={cfg.moe.kernel} takes bfloat16 or float16 experts, "
                          f"not model.dtype={cfg.dtype}: model.dtype=bfloat16, or "
                          "model.moe.kernel=xla")


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
    """The grouped-matmul kernel model.moe.kernel means on `platform` (jax's default backend;
    --compile-for settles it for GPUs before tracing, jaxtron/program/aot.py): on GPUs tokamax's
    Mosaic GPU kernel where it is installed and takes the compute dtype (bf16, f16), else
    XLA's."""
    if cfg.moe.kernel != "auto":
        return cfg.moe.kernel
    platform = platform or jax.default_backend()
    gpu = platform in ("gpu", "cuda") and cfg.dtype in KERNEL_DTYPES
    return "mosaic" if gpu and available("mosaic") else "xla"


def configure(cfg, platform: str):
    """A Config with model.moe.kernel resolved for devices of `platform` (`kernel`)."""
    if not cfg.model.moe.num_experts or cfg.model.moe.kernel != "auto":
        return cfg
    moe = dataclasses.replace(cfg.model.moe, kernel=kernel(cfg.model, platform))
    model = dataclasses.replace(cfg.model, moe=moe)
    return dataclasses.replace(cfg, model=model)


def experts(cfg: ModelConfig, x_BTD, expert_BTk, weight_BTk, w_gate, w_up, w_down,
            biases: tuple | None = None) -> jax.Array:
    """sum_j weight[j] * SwiGLU_{expert[j]}(x) per token [B, T, D], the pairs with expert E
    (routed nowhere) left out; across the mesh in one shard_map (the module docstring). The
    weights as stored, [E, D, F]; `biases` (gate, up [E, F], down [E, D]) where the experts
    have them (gpt-oss)."""
    mesh = jax.sharding.get_abstract_mesh()
    biases = tuple(biases or ())

    def local(x_BTD, expert_BTk, weight_BTk, w_gate, w_up, w_down, *biases):
        if biases and not mesh.empty and jax.lax.axis_size("tensor") > 1:
            # the down projection's partial sums add up over tensor: its bias on one rank
            first = (jax.lax.axis_index("tensor") == 0).astype(biases[2].dtype)
            biases = (*biases[:2], biases[2] * first)
        return _local_experts(cfg, kernel(cfg), x_BTD, expert_BTk, weight_BTk, w_gate,
                              w_up, w_down.transpose(0, 2, 1), *biases)

    if mesh.empty:
        return local(x_BTD, expert_BTk, weight_BTk, w_gate, w_up, w_down, *biases)
    # inside a pipeline's stages the batch's `data` split (and fsdp's, pipeline.grad_sum=whole)
    # is manual already: the rows here are the device's own
    split = tuple(a for a in _BATCH if a not in parallel.manual_axes())
    batch = P(split, None, None)
    column = row = P(EXPERT_AXIS, None, "tensor")
    bias_specs = (P(EXPERT_AXIS, "tensor"),) * 2 + (P(EXPERT_AXIS, None),) if biases else ()
    axes = set(split) | {"tensor"}
    run = jax.shard_map(local, in_specs=(batch, batch, batch, column, column, row, *bias_specs),
                        out_specs=batch, axis_names=axes, check_vma=False)
    return run(x_BTD, expert_BTk, weight_BTk, w_gate, w_up, w_down, *biases)


def _local_experts(cfg: ModelConfig, kind: str, x_BTD, expert_BTk, weight_BTk, w_gate, w_up,
                   w_down, *biases) -> jax.Array:
    """One device's part: its tokens [B', T, D], its experts [E', D, F'] (all of them off a
    mesh). Returns its tokens' outputs, summed over the expert and tensor axes.

    Over an expert group of |expert| = G devices the tokens go round a ring (`_ring`); off one,
    the device's experts run on its own tokens."""
    b, t, d = x_BTD.shape
    inside = not jax.sharding.get_abstract_mesh().empty
    groups = lambda name: jax.lax.axis_size(name) if inside else 1
    held = tuple(a.reshape(b * t, -1) for a in (x_BTD, expert_BTk, weight_BTk))
    if groups(EXPERT_AXIS) > 1:
        out_nD = _ring(cfg, kind, held, (w_gate, w_up, w_down, *biases))
    else:
        out_nD = _my_experts(cfg, kind, *held, 0, w_gate, w_up, w_down, *biases)
    if groups("tensor") > 1:
        out_nD = jax.lax.psum(out_nD, "tensor")
    return out_nD.reshape(b, t, d)


def _ring_steps(step_fn, travelling, own=None):
    """The expert ring: at step s a device holds what the device s places before it sent
    (`travelling`, a tuple of arrays), runs `step_fn(travelling) -> (partial, own_part)` on
    it, adds `partial` to the partial sums that travel with it and `own_part` to its `own`
    sum, which stays; after G steps and one last pass every device holds its own tokens'
    sums. Each step begins with one permute of the next travellers and the last partial sums
    together (XLA runs one collective permute at a time: two would leave one of them waiting
    with nothing to hide it) and a barrier ties it to the step's kernels, so that it runs
    beside them. The steps between the first (no sums to pass yet) and the last (no travellers
    left to pass) are one loop: its body's buffers are reused, so that one step's rows exist
    at a time at any ring length (unrolled, XLA's scheduler kept many steps' rows live: 31.7
    GiB of temporaries for one DeepSeek-V3 layer at 64 steps). Returns (partial sums, own)."""
    ring = jax.lax.axis_size(EXPERT_AXIS)
    onward = [(i, (i + 1) % ring) for i in range(ring)]
    pass_on = lambda tree: _unpack(jax.lax.ppermute(_pack(tree), EXPERT_AXIS, onward), tree)

    def turn(carry, last=False):
        travelling, summed, own = carry
        upcoming, moved = pass_on((None if last else travelling, summed))
        made, mine = step_fn(travelling)
        upcoming, moved, made, mine = jax.lax.optimization_barrier((upcoming, moved, made, mine))
        summed = made if moved is None else jax.tree.map(jnp.add, moved, made)
        own = mine if own is None else jax.tree.map(jnp.add, own, mine)
        return upcoming, summed, own

    carry = turn((travelling, None, own))
    if ring > 2:
        carry, _ = jax.lax.scan(lambda c, _: (turn(c), None), carry, length=ring - 2)
    _, summed, own = turn(carry, last=True)
    return pass_on(summed), own


def _pack(tree) -> jax.Array:
    """The arrays of `tree`, each [n, ...], as one [n, m] bfloat16 buffer, their bits as they
    are (a 4-byte element as two halves): one permute for all of them."""
    def view(a):
        halves = a if a.dtype == jnp.bfloat16 else jax.lax.bitcast_convert_type(a, jnp.bfloat16)
        return halves.reshape(a.shape[0], -1)

    return jnp.concatenate([view(a) for a in jax.tree.leaves(tree)], axis=1)


def _unpack(buffer: jax.Array, like):
    """The inverse of `_pack`: arrays shaped and typed as those of `like`."""
    leaves, tree = jax.tree.flatten(like)
    out, at = [], 0
    for a in leaves:
        width = a.size // a.shape[0] * a.dtype.itemsize // 2
        piece = buffer[:, at:at + width]
        at += width
        halves = [a.dtype.itemsize // 2] if a.dtype.itemsize > 2 else []
        piece = piece.reshape(*a.shape, *halves)
        same = a.dtype == jnp.bfloat16
        out.append(piece if same else jax.lax.bitcast_convert_type(piece, a.dtype))
    return jax.tree.unflatten(tree, out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _ring(cfg: ModelConfig, kind: str, held: tuple, weights: tuple) -> jax.Array:
    """The tokens `held` (x [n, D], expert [n, k], weight [n, k]) round the expert ring through
    this device's experts `weights` (gate, up [E', D, F'], down [E', F', D]): their outputs
    [n, D] summed over the ring's devices (`_ring_steps`).

    Its backward is a ring of its own, forward in the same direction: the tokens travel with
    their outputs' gradient (a token's output gradient lives where the token does), each step
    recomputes its experts' part and takes its gradient (`_ring_bwd`), the tokens' gradients
    travel home as the outputs did, the experts' gradients stay. The backward autodiff would
    write needs each step's tokens in reverse order, rebuilt by a chain of permutes before
    any kernel can run: nothing to overlap them with."""
    return _ring_fwd(cfg, kind, held, weights)[0]


def _step(cfg, kind, first, held, weights):
    return _my_experts(cfg, kind, *held, first, *weights)


def _first(weights) -> jax.Array:
    return jax.lax.axis_index(EXPERT_AXIS) * weights[0].shape[0]


def _ring_fwd(cfg, kind, held, weights):
    first = _first(weights)
    out, _ = _ring_steps(lambda h: (_step(cfg, kind, first, h, weights), ()), held, ())
    return out, (held, weights)


def _ring_bwd(cfg, kind, residuals, g_nD):
    held, weights = residuals
    first = _first(weights)
    x_nD, expert_nk, weight_nk = held

    def step(travelling):
        x, expert, weight, g = travelling
        fn = lambda x, weight, *ws: _step(cfg, kind, first, (x, expert, weight), ws)
        _, vjp = jax.vjp(fn, x, weight, *weights)
        dx, dweight, *dws = vjp(g)
        return (dx, dweight), tuple(dws)

    (dx, dweight), dws = _ring_steps(step, (x_nD, expert_nk, weight_nk, g_nD))
    return (dx, np.zeros(expert_nk.shape, jax.dtypes.float0), dweight), dws


_ring.defvjp(_ring_fwd, _ring_bwd)


def _my_experts(cfg: ModelConfig, kind: str, x_nD, expert_nk, weight_nk, first, w_gate, w_up,
                w_down, *biases) -> jax.Array:
    """What experts first .. first+E'-1 (this device's) add to tokens x [n, D] that chose
    experts [n, k] with weights [n, k]: [n, D]. Their pairs are sorted into one group per
    expert, run through the grouped kernels, and brought back to their tokens. The router's
    weight scales the hidden activations before the down projection (the same sum, by
    linearity), so that the backward never needs the experts' outputs: nothing recomputes
    the down projection. `biases` (gate, up [E', F'], down [E', D]): each row's expert's,
    the down one times the router's weight too."""
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
    gate_RF, up_RF = dot(x_RD, w_gate, sizes), dot(x_RD, w_up, sizes)
    if biases:
        # each sorted row's expert (rows past the groups: the last, never read)
        expert_R = jnp.minimum(group_R[order_R], local - 1)
        gate_RF, up_RF = (y + b.astype(y.dtype)[expert_R] for y, b in zip((gate_RF, up_RF),
                                                                            biases))
    h_RF = activation(cfg, gate_RF, up_RF)
    y_RD = dot(h_RF * scale_R[:, None].astype(h_RF.dtype), w_down, sizes)
    if biases:
        y_RD = y_RD + biases[2].astype(y_RD.dtype)[expert_R] * scale_R[:, None].astype(
            y_RD.dtype)
    y_nkD = permute(y_RD, inverse_R, order_R).reshape(n, k, -1)  # (token, choice) order
    return jnp.sum(jnp.where(mine_nk[..., None], y_nkD, 0), axis=1)


def activation(cfg: ModelConfig, gate: jax.Array, up: jax.Array) -> jax.Array:
    """SwiGLU silu(gate) * up; with model.moe.swiglu_limit > 0 gpt-oss's clamped form: gate
    clipped above and up on both sides at the limit, then (up + 1) * gate *
    sigmoid(swiglu_alpha * gate)."""
    limit = cfg.moe.swiglu_limit
    if not limit:
        return jax.nn.silu(gate) * up
    gate, up = jnp.minimum(gate, limit), jnp.clip(up, -limit, limit)
    return (up + 1) * gate * jax.nn.sigmoid(cfg.moe.swiglu_alpha * gate)


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
