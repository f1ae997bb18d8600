"""Continue a prompt with the model's KV cache, to check a model by eye: greedy, or sampled with
temperature, top-k and top-p.

    cfg, params = jaxtron.hf.from_pretrained("~/Llama-3.2-1B")
    ids = jaxtron.model.generate.generate(cfg, params, prompt_ids, 32)                   # greedy
    ids = jaxtron.model.generate.generate(cfg, params, prompt_ids, 32, temperature=0.8, top_p=0.95)

One jitted program per (model, prompt length, max_new_tokens): the prompt runs through
`Transformer.decode` in one call (prefill), then a `lax.while_loop` feeds back one token per step
until `max_new_tokens` or an end-of-sequence id. Greedy output equals transformers'
`generate(do_sample=False)` for the same weights (tests/test_generate.py). One sequence at a time,
on the default device, no mesh.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxtron.config import ConfigError, ModelConfig
from jaxtron.model import abstract_model, in_compute_dtype, init_cache


class Sampling(NamedTuple):
    """How each next token is chosen; traced scalars, so changing them does not recompile."""

    temperature: jax.Array  # 0: greedy (argmax)
    top_k: jax.Array  # keep the k most likely tokens; 0: all
    top_p: jax.Array  # then the fewest whose probability reaches p; 1: all
    eos_ids: jax.Array  # [E] ids that end the continuation (-1: none)


def check(max_new_tokens: int, temperature: float, top_k: int, top_p: float,
          flags: bool = False) -> None:
    """Refuse numbers that mean nothing, naming the argument (ConfigError: one line, exit 2) as
    the library spells it (`top_k=-1`) or, with `flags`, as the command line does (`--top-k -1`)."""
    def said(name: str, value: object = None) -> str:
        if flags:
            return f"--{name.replace('_', '-')}" + ("" if value is None else f" {value}")
        return name + ("" if value is None else f"={value}")

    if max_new_tokens < 1:
        raise ConfigError(f"{said('max_new_tokens', max_new_tokens)}: generate at least 1 token")
    if not (math.isfinite(temperature) and temperature >= 0):
        raise ConfigError(f"{said('temperature', temperature)}: use 0 (greedy) or a positive "
                          "number")
    if top_k < 0:
        raise ConfigError(f"{said('top_k', top_k)}: use 0 (no limit) or a positive count")
    if not 0 < top_p <= 1:
        raise ConfigError(f"{said('top_p', top_p)}: must be in (0, 1] (1 keeps every token)")
    if temperature == 0 and (top_k or top_p < 1):
        raise ConfigError(f"{said('top_k')} and {said('top_p')} choose among tokens to sample; "
                          f"{said('temperature', 0)} is greedy and would ignore them: add a "
                          f"{said('temperature')} above 0")


def prompt_array(cfg: ModelConfig, prompt_ids: Sequence[int] | np.ndarray) -> np.ndarray:
    """The prompt as int32 [1, T], checked: one non-empty sequence of ids within the vocabulary."""
    ids = np.asarray(prompt_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ConfigError(f"the prompt must be a non-empty list of token ids, not shape "
                          f"{ids.shape} of {ids.dtype}")
    if ids.min() < 0 or ids.max() >= cfg.vocab_size:
        raise ConfigError(f"prompt ids must be in [0, {cfg.vocab_size}) (the model's vocabulary); "
                          f"got {ids.min()}..{ids.max()}")
    return ids.astype(np.int32)[None]


def generate(cfg: ModelConfig, params: dict, prompt_ids: Sequence[int] | np.ndarray,
             max_new_tokens: int, *, temperature: float = 0.0, top_k: int = 0,
             top_p: float = 1.0, seed: int = 0,
             eos_id: int | Sequence[int] | None = None) -> list[int]:
    """The ids that continue `prompt_ids` (used as given: no BOS added): `max_new_tokens` of
    them, or fewer ending with the first produced id that `eos_id` (an id or a list) holds.
    Greedy when temperature is 0; otherwise drawn from softmax(logits / temperature) cut to
    `top_k` and then `top_p`, the same for one `seed`. `params` is the model's pure nested dict
    (numpy or jax arrays)."""
    check(max_new_tokens, temperature, top_k, top_p)
    prompt = prompt_array(cfg, prompt_ids)
    eos = [-1] if eos_id is None else np.atleast_1d(eos_id).tolist()
    knobs = Sampling(jnp.float32(temperature), jnp.int32(top_k), jnp.float32(top_p),
                     jnp.asarray(eos, jnp.int32))
    ids, count = _continue(cfg, params, jnp.asarray(prompt), max_new_tokens, knobs,
                           jax.random.key(seed))
    return np.asarray(ids)[:int(count)].tolist()


def pick(logits_V: jax.Array, key: jax.Array, knobs: Sampling) -> jax.Array:
    """The next token of float32 logits [V]: the argmax when temperature is 0, else one draw
    among the `top_k` most likely, narrowed to the fewest whose probability reaches `top_p`
    (the most likely always kept)."""
    order_V = jnp.argsort(-logits_V)  # most likely first; ties keep the lower id first
    heat = jnp.where(knobs.temperature > 0, knobs.temperature, 1.0)
    scaled_V = logits_V[order_V] / heat
    rank_V = jnp.arange(logits_V.shape[0])
    keep_V = (knobs.top_k <= 0) | (rank_V < knobs.top_k)
    probs_V = jax.nn.softmax(jnp.where(keep_V, scaled_V, -jnp.inf))
    mass_before_V = jnp.cumsum(probs_V) - probs_V
    keep_V &= (mass_before_V < knobs.top_p) | (knobs.top_p >= 1)
    drawn = order_V[jax.random.categorical(key, jnp.where(keep_V, scaled_V, -jnp.inf))]
    return jnp.where(knobs.temperature > 0, drawn, jnp.argmax(logits_V)).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 3))
def _continue(cfg: ModelConfig, params: dict, prompt_1T: jax.Array, max_new: int,
              knobs: Sampling, key: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(ids [max_new], how many of them were generated): prefill, then one token per step."""
    model = nnx.merge(nnx.graphdef(abstract_model(in_compute_dtype(cfg))), params)
    t = prompt_1T.shape[1]
    # Every token but the last generated one is fed back, so that many slots.
    cache = init_cache(cfg, 1, t + max_new - 1)
    logits_1TV, cache = model.decode(prompt_1T, cache, 0)
    first = pick(logits_1TV[0, -1], jax.random.fold_in(key, 0), knobs)
    ids = jnp.zeros((max_new,), jnp.int32).at[0].set(first)

    def going(carry) -> jax.Array:
        i, token, _, _ = carry
        return (i < max_new) & ~jnp.any(token == knobs.eos_ids)

    def step(carry):
        i, token, cache, ids = carry
        logits_11V, cache = model.decode(token.reshape(1, 1), cache, t + i - 1)
        token = pick(logits_11V[0, -1], jax.random.fold_in(key, i), knobs)
        return i + 1, token, cache, ids.at[i].set(token)

    count, _, _, ids = jax.lax.while_loop(going, step, (jnp.int32(1), first, cache, ids))
    return ids, count
