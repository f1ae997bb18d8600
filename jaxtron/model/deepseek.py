"""DeepSeek-V3 family (DeepSeek-V3/R1, Moonlight, Kimi K2): multi-head latent attention and
DeepSeek-MoE, on the decoder's blocks, stacks and operations set (decoder.py, jaxtron/ops/).

Latent attention (model.mla): each token's keys and values come from one compressed vector of
kv_lora_rank dims (RMS-normed), its queries from another of q_lora_rank (0: projected directly).
Each head's query and key have qk_nope_head_dim dims without RoPE and qk_rope_head_dim with it,
the key's rotated part shared by every head; values have v_head_dim. The down projections read
the whole sequence and are not split over `tensor` (as Megatron-Core runs them); the up
projections and the output are split over heads like grouped-query attention's.

DeepSeek-MoE (model.moe): routed experts chosen by sigmoid scores within the best groups, a
balancing bias for the choice (moe.MoE), and always-on shared experts beside them. The first
model.moe.first_dense layers keep a dense MLP of model.mlp_dim: they are a stack of their own,
run before `layers`.

Shape key: B batch, T sequence, D d_model, N heads, R kv_lora_rank, Q q_lora_rank, Hn, Hr, Hv the
nope, rope and value head sizes, S cache slots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtron.config import ModelConfig
from jaxtron.model import decoder, moe
from jaxtron.model.layers import (
    RMSNorm,
    apply_rope,
    param,
    rope_attention_factor,
    rope_frequencies,
    softmax_scale_factor,
)
from jaxtron.model.settings import REMAT_POLICIES
from jaxtron.ops import fp8, layer_ops
from jaxtron.ops.layer_ops import LayerOps
from jaxtron.parallel import constrain

LATENT_NORM_EPS = 1e-6  # transformers' DeepSeek norms of the compressed vectors: not rms_norm_eps


class LatentAttention(decoder.Attention):
    """Multi-head latent attention: decoder.Attention's calls (attend, decode over a cache that
    holds each head's whole key and value, the output projection) on its own projections."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        m, d, n = cfg.mla, cfg.d_model, cfg.num_heads
        self.cfg = cfg
        qk = m.qk_nope_head_dim + m.qk_rope_head_dim
        if m.q_lora_rank:
            self.wq_a = param(rngs, cfg, (d, m.q_lora_rank), ("embed", None))
            self.q_norm = _latent_norm(cfg, rngs, m.q_lora_rank)
            self.wq_b = param(rngs, cfg, (m.q_lora_rank, n, qk), ("latent", "heads", "head_dim"))
        else:
            self.wq = param(rngs, cfg, (d, n, qk), ("embed", "heads", "head_dim"))
        self.wkv_a = param(rngs, cfg, (d, m.kv_lora_rank + m.qk_rope_head_dim), ("embed", None))
        self.kv_norm = _latent_norm(cfg, rngs, m.kv_lora_rank)
        self.wkv_b = param(rngs, cfg, (m.kv_lora_rank, n, m.qk_nope_head_dim + m.v_head_dim),
                           ("latent", "heads", "head_dim"))
        self.wo = param(rngs, cfg, (n, m.v_head_dim, d), ("heads", "head_dim", "embed"))
        rows = self._input_rows()
        for name, value in fp8.histories(cfg.fp8, cfg.fp8_history, rows, rows + 1).items():
            setattr(self, name, value)

    def _input_rows(self) -> int:
        """The FP8 input histories' rows: h, (q's latent,) kv's latent, the heads' output; the
        weights' are one more: wq or wq_a, wkv_a, (wq_b,) wkv_b, wo."""
        return 4 if self.cfg.mla.q_lora_rank else 3

    def _output_sites(self) -> fp8.Sites | None:
        rows = self._input_rows()
        return fp8.sites(self, rows - 1, range(rows, rows + 1))

    def _rotated(self, x_BTD, positions_BT, inv_freq, ops: LayerOps
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q and k [B, T, N, Hn + Hr], v [B, T, N, Hv], RoPE on the rope dimensions at
        `positions`, heads split over tensor; q carries YaRN's softmax factor."""
        m, cfg = self.cfg.mla, self.cfg
        h_BTD = constrain(x_BTD, (*decoder.BATCH_WHOLE_SEQ, "act_embed"))
        if m.q_lora_rank:  # FP8 sites as __init__ lists them
            q_BTQ, kv_BTX = ops.project(h_BTD, (self.wq_a, self.wkv_a), fp8.sites(self, 0,
                                                                                 range(2)))
            (q_BTNH,) = ops.project(self.q_norm(q_BTQ), (self.wq_b,), fp8.sites(self, 1,
                                                                                  range(2, 3)))
        else:
            q_BTNH, kv_BTX = ops.project(h_BTD, (self.wq, self.wkv_a), fp8.sites(self, 0,
                                                                                range(2)))
        latent_BTR, k_rope_BTr = jnp.split(kv_BTX, [m.kv_lora_rank], axis=-1)
        rows = self._input_rows()
        (kv_BTNH,) = ops.project(self.kv_norm(latent_BTR), (self.wkv_b,),
                                 fp8.sites(self, rows - 2, range(rows - 1, rows)))
        k_nope_BTNH, v_BTNH = jnp.split(kv_BTNH, [m.qk_nope_head_dim], axis=-1)
        q_nope_BTNH, q_rope_BTNH = jnp.split(q_BTNH, [m.qk_nope_head_dim], axis=-1)
        factor = rope_attention_factor(cfg)
        q_rope_BTNH = apply_rope(q_rope_BTNH, positions_BT, inv_freq) * factor
        k_rope_BT1H = apply_rope(k_rope_BTr[:, :, None], positions_BT, inv_freq) * factor
        q_BTNH = jnp.concatenate([q_nope_BTNH, q_rope_BTNH], axis=-1)
        q_BTNH = q_BTNH * jnp.asarray(softmax_scale_factor(cfg), q_BTNH.dtype)
        k_BTNH = jnp.concatenate(
            [k_nope_BTNH, jnp.broadcast_to(k_rope_BT1H, (*k_nope_BTNH.shape[:3],
                                                         m.qk_rope_head_dim))], axis=-1)
        q_BTNH = constrain(q_BTNH, (*decoder.BATCH_WHOLE_SEQ, "act_heads", None))
        k_BTNH = constrain(k_BTNH, (*decoder.BATCH_WHOLE_SEQ, "act_kv_heads", None))
        v_BTNH = constrain(v_BTNH, (*decoder.BATCH_WHOLE_SEQ, "act_kv_heads", None))
        return (checkpoint_name(q_BTNH, "query_proj"), checkpoint_name(k_BTNH, "key_proj"),
                checkpoint_name(v_BTNH, "value_proj"))


def _latent_norm(cfg: ModelConfig, rngs: nnx.Rngs, width: int) -> RMSNorm:
    norm = RMSNorm(cfg, rngs, width)
    norm.eps = LATENT_NORM_EPS
    return norm


class SharedExpertMoE(moe.MoE):
    """The routed experts (moe.MoE) plus model.moe.shared_experts always-on ones, computed as
    one SwiGLU of shared_experts x the experts' width."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        if cfg.moe.shared_experts:
            width = cfg.moe.shared_experts * (cfg.moe.mlp_dim or cfg.mlp_dim)
            self.shared = decoder.MLP(cfg, rngs, width)

    def __call__(self, x_BTD, segment_ids_BT=None, ops: LayerOps | None = None):
        y_BTD, stats = super().__call__(x_BTD, segment_ids_BT, ops)
        if self.cfg.moe.shared_experts:
            y_BTD = y_BTD + self.shared(x_BTD, ops or layer_ops.here(self.cfg))
        return y_BTD, stats


class DenseBlock(decoder.Block):
    attention = LatentAttention
    mixer = decoder.MLP


class MoEBlock(decoder.Block):
    attention = LatentAttention
    mixer = SharedExpertMoE


class MTPModule(nnx.Module):
    """One multi-token-prediction depth (DeepSeek-V3): the hidden state of the depth before
    (the main model's last layer for the first) and the next input token's embedding, each
    RMS-normed, projected together back to the model width, through one MoE layer, then its
    own final norm before the shared LM head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d = cfg.d_model
        self.hnorm, self.enorm = RMSNorm(cfg, rngs), RMSNorm(cfg, rngs)
        self.w_h = param(rngs, cfg, (d, d), ("embed", None))
        self.w_e = param(rngs, cfg, (d, d), ("embed", None))
        self.block = MoEBlock(cfg, rngs)
        self.norm = RMSNorm(cfg, rngs)


class Transformer(decoder.Transformer):
    """DeepSeek-V3: model.moe.first_dense dense layers (`dense_layers`), then MoE `layers`, and
    with model.mtp_depth its multi-token-prediction modules (`mtp`, stacked over depth), which
    only training runs."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        if cfg.mtp_depth:
            self.mtp = decoder.stacked(MTPModule, cfg, cfg.mtp_depth, rngs)

    def _after_layers(self, x_BTD, batch: dict, stats: dict, ops: LayerOps) -> dict:
        """With model.mtp_depth and a training batch (`mtp_batch`'s keys): the MTP modules'
        final-normed hidden states [D, B, T, D] under stats["mtp"], their MoE layers' router
        sums after the main layers' (so that balancing and its bias cover them too)."""
        if not self.cfg.mtp_depth or "mtp_inputs/0" not in batch:
            return stats
        cfg = self.cfg
        graphdef, stacked = nnx.split(self.mtp)
        inv_freq = rope_frequencies(cfg)
        h_BTD, outputs, extra = x_BTD, [], []
        for k in range(cfg.mtp_depth):
            module = nnx.merge(graphdef, jax.tree.map(lambda a, k=k: a[k], stacked))
            e_BTD = self._embed(batch[f"mtp_inputs/{k}"], ops)
            h_BTD = (jnp.tensordot(module.hnorm(h_BTD), ops.weight(module.w_h), 1)
                     + jnp.tensordot(module.enorm(e_BTD), ops.weight(module.w_e), 1))
            h_BTD = constrain(h_BTD, (*decoder.BATCH_SEQ, "act_embed"))
            block = lambda x, block_state: nnx.merge(*block_state)(
                x, batch["positions"], batch["segment_ids"], inv_freq, ops)
            if cfg.remat != "none":
                block = jax.checkpoint(block, policy=REMAT_POLICIES[cfg.remat])
            h_BTD, layer_stats = block(h_BTD, nnx.split(module.block))
            outputs.append(module.norm(constrain(h_BTD, (*decoder.IO_SEQ, "act_embed"))))
            extra.append(layer_stats)
        joined = jax.tree.map(lambda main, *more: jnp.concatenate(
            [main, jnp.stack(more)]), stats, *extra)
        return {**joined, "mtp": jnp.stack(outputs)}

    projections = ("wq", "wq_a", "wq_b", "wkv_a", "wkv_b", "wo", "w_gate", "w_up", "w_down")

    @staticmethod
    def stacks(cfg: ModelConfig) -> tuple[tuple[str, int, type], ...]:
        dense = cfg.moe.first_dense
        return ((("dense_layers", dense, DenseBlock),) if dense else ()) + (
            ("layers", cfg.num_layers - dense, MoEBlock),)

    @staticmethod
    def cache_heads(cfg: ModelConfig) -> tuple[int, int, int]:
        m = cfg.mla
        return cfg.num_heads, m.qk_nope_head_dim + m.qk_rope_head_dim, m.v_head_dim


def mtp_batch(batch: dict, depth: int) -> dict:
    """A natural-order training batch with what multi-token prediction reads, [B, T] each, for
    depth k = 0 .. depth-1 (the (k+1)-th module): `mtp_inputs/k`, token t+1+k (the targets
    shifted k along the row), `mtp_targets/k`, token t+2+k, and `mtp_valid/k`, where that
    target is real: inside the row and the same document as position t. Made before the
    context split's reordering, which carries them with the rest."""
    targets, segments = batch["targets"], batch["segment_ids"]
    t = targets.shape[1]
    shift = lambda x, k: jnp.pad(x[:, k:], ((0, 0), (0, k)))
    out = dict(batch)
    for k in range(depth):
        out[f"mtp_inputs/{k}"] = shift(targets, k)
        out[f"mtp_targets/{k}"] = shift(targets, k + 1)
        out[f"mtp_valid/{k}"] = ((shift(segments, k + 1) == segments) & (segments != 0)
                                 & (jnp.arange(t) < t - k - 1)).astype(segments.dtype)
    return out
