"""gpt-oss, on the decoder's blocks, stacks and operations set (decoder.py).

What gpt-oss changes, each where transformers' GptOss modules have it:
- attention with biases on q, k, v (model.qkv_bias) and on the output projection;
- a learned sink logit per head in every softmax's denominator (model.attn_sinks, the XLA
  kernels: jaxtron/ops/attention.py);
- windowed and global layers alternating (model.sliding_window, model.global_every=2);
- YaRN RoPE with an untruncated correction range, its attention factor on the scores;
- experts with biases behind a router with a bias (top k of the logits, softmaxed over the k),
  their gate and up stored interleaved in one [E, D, 2F] tensor as Hugging Face stores them,
  and the clamped SwiGLU (model.moe.swiglu_limit, swiglu_alpha: jaxtron/ops/experts.py).

Shape key as in decoder.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.model import decoder, moe
from jaxtron.model.layers import param, rope_attention_factor
from jaxtron.ops.layer_ops import LayerOps


class Attention(decoder.Attention):
    """Grouped-query attention with an output bias and per-head sinks."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.bo = param(rngs, cfg, (cfg.d_model,), ("norm",), value=0.0)
        self.sinks = param(rngs, cfg, (cfg.num_heads,), ("heads",))

    def _rotated(self, x_BTD, positions_BT, inv_freq, ops: LayerOps):
        """q times YaRN's attention factor squared: transformers scales cos and sin, so q and
        k, by it."""
        q_BTNH, k_BTKH, v_BTKH = super()._rotated(x_BTD, positions_BT, inv_freq, ops)
        factor = rope_attention_factor(self.cfg) ** 2
        if factor != 1.0:
            q_BTNH = q_BTNH * jnp.asarray(factor, q_BTNH.dtype)
        return q_BTNH, k_BTKH, v_BTKH

    def _sinks(self) -> jax.Array:
        return self.sinks[...].astype(jnp.float32)

    def _output(self, out_BTNH, ops: LayerOps) -> jax.Array:
        return super()._output(out_BTNH, ops) + ops.weight(self.bo)


class MoE(moe.MoE):
    """Experts with biases: gate and up interleaved in w_gate_up [E, D, 2F] (columns 2j, 2j+1
    are gate j and up j) with b_gate_up [E, 2F], w_down [E, D, F] (as moe.MoE's) with b_down
    [E, D]; the router [D, E] with b_router [E] on its logits."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f, e = cfg.d_model, cfg.moe.mlp_dim or cfg.mlp_dim, cfg.moe.num_experts
        self.cfg = cfg
        self.router = param(rngs, cfg, (d, e), ("embed", None))
        self.b_router = param(rngs, cfg, (e,), (None,))
        self.w_gate_up = param(rngs, cfg, (e, d, 2 * f), ("experts", "expert_embed", "mlp"))
        self.b_gate_up = param(rngs, cfg, (e, 2 * f), ("experts", "mlp"), value=0.0)
        self.w_down = param(rngs, cfg, (e, d, f), ("experts", "expert_embed", "mlp"))
        self.b_down = param(rngs, cfg, (e, d), ("experts", None), value=0.0)

    def _logits(self, x_BTD) -> jax.Array:
        return super()._logits(x_BTD) + self.b_router[...].astype(jnp.float32)

    def _experts(self) -> tuple[tuple[jax.Array, ...], tuple]:
        """Gate and up split out of their interleaved columns (pairs stay whole on a tensor
        rank: the split is local), in the compute dtype with the rest."""
        dtype = self.cfg.dtype
        gate_up = self.w_gate_up[...].astype(dtype)
        gate_up = gate_up.reshape(*gate_up.shape[:-1], -1, 2)
        bias = self.b_gate_up[...].astype(dtype)
        bias = bias.reshape(*bias.shape[:-1], -1, 2)
        weights = (gate_up[..., 0], gate_up[..., 1], self.w_down[...].astype(dtype))
        return weights, (bias[..., 0], bias[..., 1], self.b_down[...].astype(dtype))


class Block(decoder.Block):
    """The decoder's pre-norm layer with gpt-oss's attention and experts."""

    attention = Attention
    mixer = MoE


class Transformer(decoder.Transformer):
    """The decoder's embedding, stack and head around gpt-oss's blocks."""

    @staticmethod
    def stacks(cfg: ModelConfig) -> tuple[tuple[str, int, type], ...]:
        return (("layers", cfg.num_layers, Block),)
