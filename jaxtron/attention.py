"""Attention kernels behind one function, all honouring packed-sequence segment ids.

Shapes: B batch, T query length, S key length, N query heads, K kv heads, G = N // K query heads
per kv head, H head size. Segment id 0 marks padding; a token attends only to earlier tokens of
its own segment. Every backend is tested against `xla_attention` on a packed batch.
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp


def segment_causal_mask(segment_ids_BT: jax.Array) -> jax.Array:
    """mask[B, 1, 1, T, S]: causal and within one segment (broadcasts over K and G)."""
    t = segment_ids_BT.shape[1]
    causal_TS = jnp.tril(jnp.ones((t, t), dtype=bool))
    same_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    return (causal_TS[None] & same_BTS)[:, None, None]


def xla_attention(
    q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array, segment_ids_BT: jax.Array
) -> jax.Array:
    """Reference attention in plain XLA ops; softmax in float32."""
    b, t, n, h = q_BTNH.shape
    k = k_BSKH.shape[2]
    q_BKGTH = q_BTNH.reshape(b, t, k, n // k, h).transpose(0, 2, 3, 1, 4)
    scores_BKGTS = jnp.einsum(
        "bkgth,bskh->bkgts", q_BKGTH, k_BSKH, preferred_element_type=jnp.float32
    ) / jnp.sqrt(jnp.float32(h))
    mask = segment_causal_mask(segment_ids_BT)
    scores_BKGTS = jnp.where(mask, scores_BKGTS, jnp.finfo(jnp.float32).min)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BSKH.dtype)
    out_BKGTH = jnp.einsum("bkgts,bskh->bkgth", probs_BKGTS, v_BSKH)
    return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(b, t, n, h)


ATTENTION_IMPLS: dict[str, Callable[..., jax.Array]] = {
    "xla": xla_attention,
}


def attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, impl: str = "xla") -> jax.Array:
    """Dispatch to the configured kernel (`model.attention`)."""
    return ATTENTION_IMPLS[impl](q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)
