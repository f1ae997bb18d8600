"""Which layers attend within a sliding window (model.sliding_window), and which globally.

A windowed layer's query at position i sees the keys at i - W + 1 .. i of its own document
(W = model.sliding_window, the query's own key included: transformers' `sliding_window`, cuDNN's
`sliding_window_length`). With model.global_every = n > 0 every n-th layer (layers n-1, 2n-1, ...)
attends globally and the others within the window: Gemma 3's 5 local to 1 global is n = 6, the
alternation of Gemma 2 and gpt-oss n = 2; n = 0 windows every layer (Mistral).

A scanned stack whose layers differ carries each layer's kind as a scanned input, and its
attention picks the kernel with a `lax.cond` (both are compiled, one runs); a stack whose layers
are all alike picks it statically.
"""

from __future__ import annotations

import numpy as np

from jaxtron.config import ConfigError, ModelConfig
from jaxtron.ops import attention


def is_local(cfg: ModelConfig, layer: int) -> bool:
    """Whether layer `layer` (0-based, over the whole model) attends within the window."""
    if not cfg.sliding_window:
        return False
    return not cfg.global_every or (layer + 1) % cfg.global_every != 0


def stack_kinds(cfg: ModelConfig, first: int, count: int) -> bool | np.ndarray:
    """Which of the layers first .. first+count-1 are windowed: a bool when they are all alike,
    else a bool array [count] (a scanned input)."""
    local = np.array([is_local(cfg, first + i) for i in range(count)])
    return bool(local[0]) if (local == local[0]).all() else local


def local_layers(cfg: ModelConfig) -> int:
    """How many of the model's layers are windowed."""
    return sum(is_local(cfg, layer) for layer in range(cfg.num_layers))


def keys_per_query(window: int, seq: int) -> float:
    """The keys a query attends to on average, causally, in a sequence of `seq` (window 0: all
    earlier ones): seq/2 globally, about the window when it is short."""
    w = min(window or seq, seq)
    return w - w * w / (2 * seq)


def counted_keys(window: int, seq: int) -> int:
    """The keys per query at which a compiled step's cuDNN attention is counted
    (jaxtron/program/flops.py): the whole sequence for a causal kernel (twice the half it
    computes), and for a windowed one likewise twice the window, the sequence at most."""
    return min(seq, 2 * window) if window else seq


def layer_windows(cfg: ModelConfig) -> list[int]:
    """Each layer's window (0: global)."""
    return [cfg.sliding_window if is_local(cfg, layer) else 0 for layer in range(cfg.num_layers)]


def shares(cfg: ModelConfig) -> dict[int, float]:
    """Each window's share of the layers (0: global), for a compiled step's count of the
    kernels a layer picks in a conditional (jaxtron/program/flops.py)."""
    found = layer_windows(cfg)
    return {window: found.count(window) / len(found) for window in set(found)}


def scored_keys(cfg: ModelConfig, seq: int) -> list[int]:
    """Each layer's keys per query in the XLA kernel's scores: the whole sequence, or a window's
    two chunks (attention.band_chunk)."""
    chunks = [attention.band_chunk(seq, window) for window in layer_windows(cfg)]
    return [2 * chunk if chunk else seq for chunk in chunks]


def check(cfg: ModelConfig) -> None:
    """The window's settings are in range (one line naming the setting otherwise)."""
    if cfg.sliding_window < 0:
        raise ConfigError(f"model.sliding_window={cfg.sliding_window} must be 0 (none) or "
                          "positive")
    if cfg.global_every < 0 or cfg.global_every == 1:
        raise ConfigError(f"model.global_every={cfg.global_every} must be 0 (every layer "
                          "windowed) or at least 2 (every n-th layer global)")
    if cfg.global_every and not cfg.sliding_window:
        raise ConfigError(f"model.global_every={cfg.global_every} picks the layers that attend "
                          "globally among windowed ones: set model.sliding_window too")
    if cfg.sliding_window and cfg.mla.kv_lora_rank:
        raise ConfigError("model.sliding_window with latent attention (model.mla.kv_lora_rank > "
                          "0) is not supported: DeepSeek's families attend globally")
