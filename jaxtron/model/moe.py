"""Mixture of experts: a top-k router in front of SwiGLU experts, dropless unless
model.moe.capacity_factor says otherwise; the experts run over the mesh in jaxtron/ops/experts.py.

Per layer: router logits [B, T, E] = x W_router in float32; probabilities the softmax over all E;
each token's top k of them (renormalized to sum to 1 when norm_topk_prob) weight its experts'
outputs. Mixtral's softmax over its top-k logits is the same numbers.

Also here: the load-balancing loss (transformers' Mixtral form, per sequence), the router z-loss
and the load statistics. Each layer returns sums (per sequence where the loss needs it); the step
adds them over layers and microbatches and only then forms ratios, so that the objective and
every statistic are the same however the step is split (microbatches, mesh): `sequence_aux`.

Shape key: B batch, T sequence, D d_model, E experts, k experts per token, F expert width.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.model.layers import param
from jaxtron.ops import layer_ops

# what every layer returns (`_router_sums`): per sequence [B, E] the (token, choice) pairs that
# picked each expert and the sum of its router probabilities over real tokens; the sum of the
# squared router logsumexps; the routed pairs and those dropped over capacity
STAT_KEYS = ("picked", "probs", "z", "routed", "dropped")
PER_ROW = ("picked", "probs")  # [B, E] per sequence; the others summed over the batch


class MoE(nnx.Module):
    """E SwiGLU experts and a router [D, E] in place of the dense MLP. The experts' weights are
    [E, D, F], W_down too ([E, D, F], each expert's [F, D] transposed, as Hugging Face stores
    it: transposed per layer in the compute dtype): with [E, F, D] or [D, E, F], XLA kept
    transposed float32 copies of whole weight stacks through the step (docs/parallelism.md has
    the compiled peaks)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, e = cfg.d_model, cfg.moe.mlp_dim or cfg.mlp_dim, cfg.moe.num_experts
        self.cfg = cfg
        # With model.weights_ahead, whole on every device (D x E floats, 128 KiB for Mixtral):
        # split, its gather was one more collective at each layer's start, which each jax
        # combined with the carried gather its own way. Without, split over embed: whole, jax
        # 0.10.2 computed its gradient on the expert group's gathered tokens (Qwen3-30B-A3B
        # +1.6 TFLOP per GPU per step, docs/performance.md).
        self.router = param(rngs, cfg, (d, e), (None, None) if cfg.weights_ahead
                            else ("embed", None))
        if cfg.moe.scoring == "sigmoid":  # DeepSeek-V3's balancing bias, replicated (`rebalanced`)
            self.router_bias = param(rngs, cfg, (e,), (None,), value=0.0)
        for name in ("w_gate", "w_up", "w_down"):
            setattr(self, name, param(rngs, cfg, (e, d, f), ("experts", "expert_embed", "mlp")))

    def __call__(self, x_BTD: jax.Array, segment_ids_BT: jax.Array | None = None,
                 ops: layer_ops.LayerOps | None = None) -> tuple[jax.Array, dict]:
        """(outputs [B, T, D], this layer's router sums `STAT_KEYS`). Padding tokens (segment
        0) are routed nowhere: their output is 0 and they count in no statistic. `ops`: the
        operations set that runs the experts (none: the ambient mesh's)."""
        cfg = self.cfg
        ops = ops or layer_ops.here(cfg)
        real_BT = (jnp.ones(x_BTD.shape[:2], bool) if segment_ids_BT is None
                   else segment_ids_BT != 0)
        logits_BTE = self._logits(x_BTD)
        probs_BTE, weight_BTk, expert_BTk = self._route(logits_BTE)
        routed_BTk = jnp.broadcast_to(real_BT[..., None], expert_BTk.shape)
        stats = _router_sums(logits_BTE, probs_BTE, expert_BTk, real_BT, cfg.moe.num_experts)
        if cfg.moe.capacity_factor > 0:
            kept_BTk = within_capacity(expert_BTk, routed_BTk, cfg)
            stats["dropped"] = jnp.sum(routed_BTk & ~kept_BTk).astype(jnp.float32)
            routed_BTk = kept_BTk
        # a pair routed nowhere gets expert E: it sorts after every real group, and no kernel
        # reads it
        expert_BTk = jnp.where(routed_BTk, expert_BTk, cfg.moe.num_experts)
        weights, biases = self._experts()
        y_BTD = ops.experts(x_BTD, expert_BTk, weight_BTk.astype(cfg.dtype), *weights, biases)
        return y_BTD, stats

    def _logits(self, x_BTD) -> jax.Array:
        """The router's logits [B, T, E], in float32."""
        return jnp.einsum("btd,de->bte", x_BTD.astype(jnp.float32),
                          self.router[...].astype(jnp.float32))

    def _experts(self) -> tuple[tuple[jax.Array, ...], tuple | None]:
        """((gate, up, down) [E, D, F] each in the compute dtype, their biases or None)."""
        return tuple(_expert_weights(self.cfg, w) for w in (self.w_gate, self.w_up,
                                                            self.w_down)), None

    def _route(self, logits_BTE) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(the scores as probabilities over the experts [B, T, E], each token's expert weights
        [B, T, k] and experts [B, T, k]). softmax: the top k probabilities. sigmoid (DeepSeek-V3):
        the top k of the scores plus the balancing bias (for the choice only), within the
        topk_groups best groups; weighted by their scores. Normalised over the k with
        norm_topk_prob, then times routed_scale."""
        moe = self.cfg.moe
        if moe.scoring == "softmax":
            probs_BTE = scores_BTE = jax.nn.softmax(logits_BTE, axis=-1)
            choice_BTE = scores_BTE
        else:
            scores_BTE = jax.nn.sigmoid(logits_BTE)
            probs_BTE = scores_BTE / jnp.sum(scores_BTE, axis=-1, keepdims=True)
            choice_BTE = scores_BTE + jax.lax.stop_gradient(self.router_bias[...])
        if moe.groups > 1:
            choice_BTE = within_groups(choice_BTE, moe.groups, moe.topk_groups,
                                       best=2 if moe.scoring == "sigmoid" else 1)
        _, expert_BTk = jax.lax.top_k(choice_BTE, moe.experts_per_token)
        weight_BTk = jnp.take_along_axis(scores_BTE, expert_BTk, axis=-1)
        if moe.norm_topk_prob:
            tiny = 1e-20 if moe.scoring == "sigmoid" else 0.0  # transformers' DeepSeek-V3 adds it
            weight_BTk = weight_BTk / (jnp.sum(weight_BTk, axis=-1, keepdims=True) + tiny)
        return probs_BTE, weight_BTk * moe.routed_scale, expert_BTk


def within_groups(choice_BTE: jax.Array, groups: int, topk_groups: int,
                  best: int = 2) -> jax.Array:
    """Group-limited routing: the experts in `groups` equal groups ranked by the sum of their
    `best` best scores (DeepSeek-V3's sigmoid router: 2; V2's softmax router: 1, its group's
    largest); outside the topk_groups best, -inf, so no token's experts span more groups
    (DeepSeek puts a group on a node, bounding the dispatch's fan-out)."""
    *lead, experts = choice_BTE.shape
    grouped = choice_BTE.reshape(*lead, groups, experts // groups)
    rank_BTG = jnp.sum(jax.lax.top_k(grouped, best)[0], axis=-1)
    _, best = jax.lax.top_k(rank_BTG, topk_groups)
    kept_BTG = jnp.sum(jax.nn.one_hot(best, groups, dtype=jnp.int32), axis=-2) > 0
    kept_BTE = jnp.repeat(kept_BTG, experts // groups, axis=-1)
    return jnp.where(kept_BTE, choice_BTE, -jnp.inf)


# Where the balancing biases live, in the order of the step's router sums: the MoE layers',
# then the multi-token-prediction modules' (jaxtron/model/deepseek.py)
BIASES = (("layers", "mlp", "router_bias"), ("mtp", "block", "mlp", "router_bias"))


def rebalanced(params: dict, picked_LE: jax.Array, speed: float) -> dict:
    """`params` with each MoE layer's balancing bias (router_bias [L, E]) moved by `speed` times
    the sign of its expert's load error: up where an expert took fewer (token, choice) pairs
    than the layer's mean this step, down where more (DeepSeek-V3's auxiliary-loss-free
    balancing). `picked_LE`: the step's pairs per expert and layer (step_sums), the same on
    every rank, so the bias stays equal everywhere; its rows are BIASES' layers in order."""
    sign_LE = jnp.sign(jnp.mean(picked_LE, axis=-1, keepdims=True) - picked_LE)
    out, at = params, 0
    for path in BIASES:
        node = params
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if node is None:
            continue
        moved = node + speed * sign_LE[at:at + node.shape[0]].astype(node.dtype)
        out, at = _replaced(out, path, moved), at + node.shape[0]
    return out


def _replaced(tree: dict, path: tuple, value) -> dict:
    """`tree` with the leaf at `path` replaced (new dicts along the path, the rest shared)."""
    if len(path) == 1:
        return {**tree, path[0]: value}
    return {**tree, path[0]: _replaced(tree[path[0]], path[1:], value)}


def _expert_weights(cfg: ModelConfig, p: nnx.Param) -> jax.Array:
    """An expert weight [E, D, F] in the compute dtype (gathered over fsdp where the experts
    run; pinned here inside the layer instead, as the dense layers' are, the compiled Mixtral
    step was the same)."""
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


@dataclass(frozen=True)
class Router:
    """The router's objective as a 1F1B pipeline forms it (parallel/one_f_one_b.py): from each
    microbatch's statistics summed over all `layers` MoE layers, `rows` per sequence [b, E], the
    others scalars. The same objective and sums as `step_sums` and `objective` of the layers'
    statistics, which a pipeline's ticks never hold all at once."""

    layers: int
    aux_coef: float
    z_coef: float
    rows: tuple[str, ...] = PER_ROW

    @classmethod
    def of(cls, cfg: ModelConfig) -> Router:
        return cls(cfg.staged_layers, cfg.moe.aux_coef, cfg.moe.z_coef)

    def objective(self, sums: dict, tokens_b: jax.Array) -> tuple[jax.Array, dict]:
        """(what the router adds to the microbatch's summed loss, its parts `aux` and `z`)."""
        aux = sequence_aux(sums["picked"][None], sums["probs"][None], tokens_b) / self.layers ** 2
        z = sums["z"] / self.layers
        return self.aux_coef * aux + self.z_coef * z, {"aux": aux, "z": z}

    @staticmethod
    def sums(parts: dict, layers: dict) -> dict:
        """`step_sums` of the batch from the parts summed over microbatches and each layer's
        statistics [L, ...] (the pairs per expert summed over the rows)."""
        return {**parts, **{k: layers[k].astype(jnp.float32)
                            for k in ("picked", "routed", "dropped")}}


def within_capacity(expert_BTk: jax.Array, routed_BTk: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Which routed pairs an expert takes under model.moe.capacity_factor: from each sequence at
    most ceil(cf * T * k / E) pairs, first choices before second ones, tokens in order within a
    choice (Switch's priority; per sequence as MaxText's capacity). Per sequence, the same pairs
    are dropped however the step is split (microbatches, mesh)."""
    b, t, k = expert_BTk.shape
    capacity = math.ceil(cfg.moe.capacity_factor * t * k / cfg.moe.num_experts)
    onehot = (jax.nn.one_hot(expert_BTk, cfg.moe.num_experts, dtype=jnp.int32)
              * routed_BTk[..., None])  # [B, T, k, E]
    by_choice = onehot.transpose(0, 2, 1, 3).reshape(b, k * t, cfg.moe.num_experts)
    position = jnp.cumsum(by_choice, axis=1) - by_choice  # pairs before this one, per expert
    position = jnp.sum(position * by_choice, axis=-1).reshape(b, k, t).transpose(0, 2, 1)
    return routed_BTk & (position < capacity)


def describe_params(cfg: ModelConfig, total: int) -> str:
    """'46,702,792,704' for a dense model; for a mixture of experts the total and the active
    count: what one token runs, every weight less the num_experts - experts_per_token experts it
    skips in every MoE layer (all but model.moe.first_dense)."""
    if not cfg.moe.num_experts:
        return f"{total:,}"
    skipped = cfg.moe.num_experts - cfg.moe.experts_per_token
    expert = 3 * cfg.d_model * (cfg.moe.mlp_dim or cfg.mlp_dim)
    active = total - (cfg.num_layers - cfg.moe.first_dense) * skipped * expert
    return f"{total:,} ({active:,} active per token: {cfg.moe.experts_per_token} of " \
           f"{cfg.moe.num_experts} experts)"


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
    """What the router losses add to the summed cross-entropy: moe.aux_coef x the balancing loss
    and moe.z_coef x the z-loss, each summed over tokens (their means over the step's tokens
    are what the coefficients weigh, as transformers adds router_aux_loss_coef x aux_loss to
    its mean loss)."""
    return cfg.moe.aux_coef * sums["aux"] + cfg.moe.z_coef * sums["z"]


def zero_stats(params: dict) -> dict:
    """Zeros of `step_sums` for a model with MoE layers (a `router` weight [L, D, E] in
    `params`), {} for a dense one: where accumulation over microbatches starts."""
    paths = jax.tree_util.tree_flatten_with_path(params)[0]
    routers = [leaf for path, leaf in paths if getattr(path[-1], "key", None) == "router"]
    if not routers:
        return {}
    layers, experts = sum(r.shape[0] for r in routers), routers[0].shape[-1]
    zero = lambda *shape: jnp.zeros(shape, jnp.float32)
    sums = {"aux": zero(), "z": zero(), "picked": zero(layers, experts),
            "routed": zero(layers), "dropped": zero(layers)}
    if "mtp" in params:  # model.mtp_depth: its cross-entropy and tokens (train_step.loss_sums)
        sums |= {"mtp_entropy": zero(), "mtp_tokens": zero()}
    return sums


def metrics(sums: dict, tokens: jax.Array, capacity: bool, first: int = 0) -> dict:
    """The step's router statistics from its summed `step_sums` and real tokens, as logged
    (docs/metrics.md): moe_aux_loss and moe_z_loss (means over tokens), moe_load (the most
    loaded expert's pairs over the mean, the largest over layers) and each MoE layer's as
    moe_load/<layer> (`first`: the model layer of the first, after model.moe.first_dense dense
    ones), and with a capacity moe_dropped (the share of routed pairs dropped, the largest over
    layers); {} for a dense model."""
    if not sums:
        return {}
    tokens = jnp.maximum(tokens.astype(jnp.float32), 1.0)
    picked = sums["picked"]
    load_L = jnp.max(picked, axis=-1) / jnp.maximum(jnp.mean(picked, axis=-1), 1e-9)
    out = {"moe_aux_loss": sums["aux"] / tokens, "moe_z_loss": sums["z"] / tokens,
           "moe_load": jnp.max(load_L),
           **{f"moe_load/{first + i}": load_L[i] for i in range(load_L.shape[0])}}
    if capacity:
        out["moe_dropped"] = jnp.max(sums["dropped"] / jnp.maximum(sums["routed"], 1.0))
    if "mtp_entropy" in sums:  # model.mtp_depth: the modules' mean cross-entropy, logged apart
        out["mtp_loss"] = sums["mtp_entropy"] / jnp.maximum(sums["mtp_tokens"], 1.0)
    return out
