"""Context parallelism: the sequence split over the `context` mesh axis, causally load-balanced.

With C context ranks a sequence of T positions is cut into 2C pieces of c = T / 2C. Rank r holds
pieces r and 2C-1-r, so under a causal mask every rank attends to the same number of earlier
positions (piece r sees the fewest, piece 2C-1-r the most). `balance` lays a batch out in that
order before the model runs: tokens, targets, segment ids and positions move together, so RoPE
reads true positions, packed documents keep their ids, and the loss (a sum over tokens) is the
unsharded one. Attention gathers K and V over `context` (jaxtron/ops/context_attention.py);
every other layer is position-wise and runs on the rank's own 2c positions.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxtron.parallel import constrain

AXIS = "context"


def order(t: int, c: int) -> np.ndarray:
    """The natural position at each balanced position of a sequence of `t` over `c` ranks: rank
    r's 2t/2c positions are pieces r and 2c-1-r."""
    pieces = np.arange(t).reshape(2 * c, t // (2 * c))
    return np.stack([pieces[:c], pieces[c:][::-1]], 1).reshape(-1)


def to_balanced(x: jax.Array, c: int) -> jax.Array:
    """x[B, T, ...] in natural order -> balanced order along T (reshapes and slices, no gather)."""
    b, t = x.shape[:2]
    y = x.reshape(b, 2 * c, t // (2 * c), *x.shape[2:])
    return jnp.stack([y[:, :c], y[:, c:][:, ::-1]], 2).reshape(x.shape)


def to_natural(x: jax.Array, c: int) -> jax.Array:
    """The inverse of `to_balanced`: x[B, T, ...] in balanced order -> natural order."""
    b, t = x.shape[:2]
    y = x.reshape(b, c, 2, t // (2 * c), *x.shape[2:])
    return jnp.concatenate([y[:, :, 0], y[:, ::-1, 1]], 1).reshape(x.shape)


def balance(batch: dict[str, jax.Array], c: int) -> dict[str, jax.Array]:
    """A batch of [B, T] arrays in balanced order over `c` context ranks, T split over
    `context` (itself when c is 1)."""
    if c == 1:
        return batch
    return {key: constrain(to_balanced(v, c), ("act_batch", "act_ctx")) for key, v in batch.items()}


def unbalance(x: jax.Array, c: int) -> jax.Array:
    """x[B, T, ...] of a batch balanced over `c` context ranks -> natural order."""
    return x if c == 1 else to_natural(x, c)
