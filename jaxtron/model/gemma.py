"""Gemma 2 and Gemma 3 (text), on the decoder's blocks, stacks and operations set (decoder.py).

What Gemma changes, each where transformers' Gemma2/Gemma3 modules have it:
- the embeddings times sqrt(d_model), in the compute dtype;
- RMSNorms of x * (1 + scale) (`ZeroCentredNorm`), and four per layer: before and after the
  attention and the MLP, each output normed before the residual add;
- GeGLU: the MLP's gate through tanh-approximated GELU;
- attention scores over sqrt(query_pre_attn_scalar) (model.attn_scale_dim) rather than the
  head size, q/k norms in Gemma 3 (model.qk_norm);
- windowed layers (model.sliding_window, every model.global_every-th global, jaxtron/model/
  windows.py) with their own RoPE base in Gemma 3 (model.rope_local_theta), the global ones
  with linear scaling;
- Gemma 2's soft caps on the attention scores and the final logits (model.attn_softcap,
  model.logit_softcap).

Shape key as in decoder.py.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp

from jaxtron.config import ModelConfig
from jaxtron.model import decoder
from jaxtron.model.layers import ZeroCentredNorm, local_rope_frequencies, rope_frequencies
from jaxtron.ops.layer_ops import LayerOps
from jaxtron.parallel import constrain


def _pick(inv_freq: tuple[jax.Array, jax.Array], local: jax.Array | bool) -> jax.Array:
    """The layer's RoPE frequencies of (global, windowed), by its kind (traced or not)."""
    global_inv, local_inv = inv_freq
    if isinstance(local, bool):
        return local_inv if local else global_inv
    return jnp.where(local, local_inv, global_inv)


class Attention(decoder.Attention):
    """Grouped-query attention with Gemma's norms, score scale and per-kind RoPE."""

    norm = ZeroCentredNorm

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, inv_freq, ops: LayerOps,
                 local: jax.Array | bool = False) -> jax.Array:
        return super().__call__(x_BTD, positions_BT, segment_ids_BT, _pick(inv_freq, local),
                                ops, local)

    def decode(self, x_BTD, start, inv_freq, k_BSKH, v_BSKH, ops: LayerOps,
               local: jax.Array | bool = False):
        return super().decode(x_BTD, start, _pick(inv_freq, local), k_BSKH, v_BSKH, ops, local)

    def _rotated(self, x_BTD, positions_BT, inv_freq, ops: LayerOps):
        """q scaled so that the kernels' 1/sqrt(H) makes 1/sqrt(model.attn_scale_dim)."""
        q_BTNH, k_BTKH, v_BTKH = super()._rotated(x_BTD, positions_BT, inv_freq, ops)
        scale = self.cfg.attn_scale_dim
        if scale and scale != self.cfg.head_size:
            q_BTNH = q_BTNH * jnp.asarray(math.sqrt(self.cfg.head_size / scale), q_BTNH.dtype)
        return q_BTNH, k_BTKH, v_BTKH


class MLP(decoder.MLP):
    """GeGLU: down(gelu_tanh(x W_gate) * (x W_up))."""

    activation = staticmethod(functools.partial(jax.nn.gelu, approximate=True))


class Block(decoder.Block):
    """x + post_attn_norm(attn(attn_norm(x))), then x + post_mlp_norm(mlp(mlp_norm(x)))."""

    attention = Attention
    mixer = MLP
    norm = ZeroCentredNorm

    def __init__(self, cfg: ModelConfig, rngs):
        super().__init__(cfg, rngs)
        self.post_attn_norm, self.post_mlp_norm = self.norm(cfg, rngs), self.norm(cfg, rngs)

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, inv_freq, ops: LayerOps,
                 local: jax.Array | bool = False) -> tuple[jax.Array, dict]:
        h_BTD = ops.whole_seq(self.attn_norm(x_BTD))
        y_BTD = self.attn(h_BTD, positions_BT, segment_ids_BT, inv_freq, ops, local)
        x_BTD = constrain(x_BTD + self.post_attn_norm(y_BTD), (*decoder.BATCH_SEQ, "act_embed"))
        y_BTD, stats = self._mlp(ops.whole_seq(self.mlp_norm(x_BTD)), segment_ids_BT, ops)
        return constrain(x_BTD + self.post_mlp_norm(y_BTD),
                         (*decoder.BATCH_SEQ, "act_embed")), stats

    def decode(self, x_BTD, start, inv_freq, k_BSKH, v_BSKH, ops: LayerOps,
               local: jax.Array | bool = False):
        out_BTD, k_BSKH, v_BSKH = self.attn.decode(self.attn_norm(x_BTD), start, inv_freq,
                                                   k_BSKH, v_BSKH, ops, local)
        x_BTD = x_BTD + self.post_attn_norm(out_BTD)
        y_BTD = self._mlp(self.mlp_norm(x_BTD), None, ops)[0]
        return x_BTD + self.post_mlp_norm(y_BTD), k_BSKH, v_BSKH


class Transformer(decoder.Transformer):
    """Gemma's embedding scale, blocks and final norm around the decoder's stack."""

    norm = ZeroCentredNorm

    @staticmethod
    def stacks(cfg: ModelConfig) -> tuple[tuple[str, int, type], ...]:
        return (("layers", cfg.num_layers, Block),)

    @staticmethod
    def rope(cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
        """(the global layers' inverse frequencies, the windowed layers')."""
        return rope_frequencies(cfg), local_rope_frequencies(cfg)

    def _embed(self, tokens_BT, ops: LayerOps) -> jax.Array:
        """Token ids -> embeddings times sqrt(d_model), the factor in the compute dtype."""
        scale = jnp.asarray(math.sqrt(self.cfg.d_model), self.cfg.dtype)
        return super()._embed(tokens_BT, ops) * scale
