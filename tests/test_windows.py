"""Sliding-window attention (jaxtron/model/windows.py, jaxtron/ops/attention.py): the banded XLA
kernel against the masked reference, which layers attend within the window, and the settings
refused in one line. Transformers' Mistral within its window: tests/test_hf_parity.py; training
on a mesh: tests/test_parallel.py; the H100 compile: tests/test_aot.py."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import tiny_config

from jaxtron.config import ConfigError
from jaxtron.model import build, windows
from jaxtron.model import check as model_check
from jaxtron.ops import attention


def _packed(t: int):
    """q, k, v of 2 rows of t positions (8 query heads over 2 kv heads) and their segment ids:
    three documents and padding in one row, two in the other."""
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, t, 8, 16))
    k, v = (jax.random.normal(key, (2, t, 2, 16)) for key in keys[1:])
    cut = [t // 3, t // 3 + t // 2, t - 5]
    first = np.searchsorted(cut, np.arange(t), side="right") + 1
    segments = np.stack([np.where(first == 4, 0, first), (np.arange(t) >= 7) + 1])
    return q, k, v, jnp.asarray(segments, jnp.int32)


@pytest.mark.parametrize("window", [20, 24, 5])
def test_banded_attention_is_the_masked_reference_forward_and_backward(window):
    """At 96 positions a window of 20 or 24 runs in chunks of 24 (5 in chunks of 6), over two
    chunks of keys: output and gradients equal the whole masked [T, T] attention's. Measured
    in float32: output 3.6e-7, gradients 3.8e-6 at most (of values up to ~40)."""
    q, k, v, segments = _packed(96)
    assert attention.band_chunk(96, window) == (6 if window == 5 else 24)
    cotangent = jax.random.normal(jax.random.key(1), q.shape)

    def run(kernel):
        loss = lambda *qkv: jnp.sum(kernel(*qkv) * cotangent)
        return (kernel(q, k, v), *jax.grad(loss, argnums=(0, 1, 2))(q, k, v))

    want = run(lambda *qkv: attention.masked_attention(
        *qkv, attention.segment_causal_mask(segments, window)))
    got = run(lambda *qkv: attention.xla_attention(*qkv, segments, window))
    for name, a, b in zip(("output", "dq", "dk", "dv"), got, want):
        assert np.abs(np.asarray(a - b)).max() < 2e-5, name
    # the window matters: full causal attention is far from it
    full = attention.xla_attention(q, k, v, segments)
    assert np.abs(np.asarray(full - want[0])).max() > 0.1


def test_a_short_sequence_attends_whole_and_the_window_keeps_each_query_its_latest_keys():
    assert attention.band_chunk(64, 32) == 0  # two chunks would cover it: the masked form
    mask = np.asarray(attention.segment_causal_mask(jnp.ones((1, 10), jnp.int32), 3))[0, 0, 0]
    assert [np.flatnonzero(row).tolist() for row in mask[[0, 2, 9]]] == [[0], [0, 1, 2],
                                                                          [7, 8, 9]]


def _logits(cfg, tokens):
    model = build(cfg, nnx.Rngs(0))
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1]), tokens.shape)
    return np.asarray(model(tokens, positions, jnp.ones_like(tokens)))


@pytest.mark.parametrize("every", [0, 2])
def test_a_layer_sees_its_window_and_every_nth_layer_sees_everything(every):
    """Two layers with a window of 8 at 64 positions: windowed both, position 40 sees tokens
    back to 40 - 14 (each layer 7 back) and nothing before; with model.global_every=2 the
    second layer attends globally and position 40 sees token 0. The scanned stack (a
    conditional per layer where they differ) equals the unrolled one."""
    cfg = dataclasses.replace(tiny_config("model.num_layers=2", "model.sliding_window=8",
                                          f"model.global_every={every}").model, dtype="float32")
    assert windows.layer_windows(cfg) == ([8, 8] if not every else [8, 0])
    tokens = jax.random.randint(jax.random.key(2), (1, 64), 3, cfg.vocab_size)
    base = _logits(cfg, tokens)
    moved = lambda at: np.abs(_logits(cfg, tokens.at[0, at].set(1)) - base)[0, 40].max()
    assert moved(26) > 1e-3  # 14 back: within reach of both windows
    assert (moved(0) > 1e-3) == bool(every) and (moved(25) > 1e-3) == bool(every)
    unrolled = _logits(dataclasses.replace(cfg, scan_layers=False), tokens)
    assert np.abs(unrolled - base).max() < 1e-5


@pytest.mark.parametrize("overrides, message", [
    (["model.sliding_window=-1"], r"model.sliding_window=-1 must be 0 \(none\) or positive"),
    (["model.global_every=2"], "model.global_every=2 picks the layers .* set "
                               "model.sliding_window too"),
    (["model.sliding_window=8", "model.global_every=1"], "model.global_every=1 must be 0"),
])
def test_bad_window_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message) as refused:
        model_check(tiny_config(*overrides).model)
    assert "\n" not in str(refused.value)


def test_flops_count_the_window():
    """Model FLOPs: a windowed layer's attention over its mean keys per query (about the
    window), a global one's over half the sequence."""
    assert windows.keys_per_query(0, 4096) == 2048
    assert windows.keys_per_query(1024, 4096) == 1024 - 1024 * 1024 / 8192
    assert windows.keys_per_query(8192, 4096) == 2048
    assert windows.counted_keys(128, 4096) == 256 and windows.counted_keys(0, 4096) == 4096
    cfg = tiny_config("model.num_layers=6", "model.sliding_window=16",
                      "model.global_every=3").model
    assert windows.layer_windows(cfg) == [16, 16, 0, 16, 16, 0]
    assert windows.shares(cfg) == {16: 4 / 6, 0: 2 / 6}


@pytest.mark.parametrize("hf, want", [
    ({"model_type": "qwen2", "use_sliding_window": True, "max_window_layers": 0}, (8, 0)),
    ({"model_type": "qwen2", "use_sliding_window": False, "max_window_layers": 0}, (0, 0)),
    ({"model_type": "qwen2", "use_sliding_window": True}, (0, 0)),  # default 28 >= 4 layers
    ({"model_type": "qwen2", "use_sliding_window": True,
      "layer_types": ["sliding_attention", "full_attention"] * 2}, (8, 2)),
    ({"model_type": "mistral"}, (8, 0)),
])
def test_transformers_windowed_layers_read_as_the_pattern(hf, want):
    """config.json's windowed layers, as transformers picks them, read as model.sliding_window
    and model.global_every; a pattern that is neither every layer nor all but every n-th is
    refused naming the layers."""
    from jaxtron.hf import config_json

    base = {"vocab_size": 64, "hidden_size": 32, "num_attention_heads": 4,
            "intermediate_size": 64, "num_hidden_layers": 4, "sliding_window": 8}
    read = config_json.config_from_hf({**base, **hf})
    assert (read["sliding_window"], read.get("global_every", 0)) == want
    with pytest.raises(ValueError, match=r"the windowed layers \[2, 3\] of 4 are not a pattern"):
        config_json.config_from_hf({**base, "model_type": "qwen2", "use_sliding_window": True,
                                    "max_window_layers": 2})
