"""Model unit tests: causality, packed segments, scan == unrolled, remat == no remat."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.model import REMAT_POLICIES, Transformer, rope_frequencies
from jaxtron.ops.attention import segment_causal_mask, xla_attention
from jaxtron.step import loss_sums

CFG = ModelConfig(vocab_size=128, num_layers=3, d_model=64, num_heads=4, num_kv_heads=2,
                  mlp_dim=96, dtype="float32", param_dtype="float32")
T = 24


def _model(cfg=CFG, seed=0):
    return Transformer(cfg, nnx.Rngs(seed))


def _logits(model, tokens, positions=None, segments=None):
    b, t = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(t), (b, t)) if positions is None else positions
    segments = jnp.ones((b, t), jnp.int32) if segments is None else segments
    return np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segments)))


def _tokens(seed, shape):
    return np.random.default_rng(seed).integers(0, CFG.vocab_size, shape).astype(np.int32)


def test_causal_future_tokens_do_not_change_past_logits():
    model = _model()
    tokens = _tokens(0, (2, T))
    changed = tokens.copy()
    changed[:, 10:] = _tokens(1, (2, T - 10))
    a, b = _logits(model, tokens), _logits(model, changed)
    np.testing.assert_allclose(a[:, :10], b[:, :10], atol=1e-6)  # positions before the change
    assert np.abs(a[:, 10:] - b[:, 10:]).max() > 1e-3  # and the change does propagate


def test_packed_documents_never_attend_across_boundaries():
    model = _model()
    doc_a, doc_b = _tokens(2, (1, 10)), _tokens(3, (1, 14))
    packed = np.concatenate([doc_a, doc_b], axis=1)
    segments = np.array([[1] * 10 + [2] * 14], np.int32)
    positions = np.array([list(range(10)) + list(range(14))], np.int32)
    out = _logits(model, packed, positions, segments)
    np.testing.assert_allclose(out[:, :10], _logits(model, doc_a), atol=1e-5)
    np.testing.assert_allclose(out[:, 10:], _logits(model, doc_b), atol=1e-5)


def test_attention_mask_is_causal_within_segments():
    segments = jnp.array([[1, 1, 2, 2, 0]])
    mask = np.asarray(segment_causal_mask(segments))[0, 0, 0]
    expected = np.array([[1, 0, 0, 0, 0],
                         [1, 1, 0, 0, 0],
                         [0, 0, 1, 0, 0],
                         [0, 0, 1, 1, 0],
                         [0, 0, 0, 0, 1]], bool)
    np.testing.assert_array_equal(mask, expected)


def test_gqa_attention_equals_repeated_kv_heads():
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(2, 8, 4, 16)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(2, 8, 2, 16)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(2, 8, 2, 16)), jnp.float32)
    seg = jnp.ones((2, 8), jnp.int32)
    grouped = xla_attention(q, k, v, seg)
    full = xla_attention(q, jnp.repeat(k, 2, axis=2), jnp.repeat(v, 2, axis=2), seg)
    np.testing.assert_allclose(np.asarray(grouped), np.asarray(full), atol=1e-6)


def _batch(seed=0, b=2):
    tokens = _tokens(seed, (b, T + 1))
    return {
        "tokens": jnp.asarray(tokens[:, :-1]), "targets": jnp.asarray(tokens[:, 1:]),
        "positions": jnp.broadcast_to(jnp.arange(T), (b, T)),
        "segment_ids": jnp.ones((b, T), jnp.int32),
    }


def _loss_and_grads(cfg):
    graphdef, state = nnx.split(_model(cfg))
    params = nnx.to_pure_dict(state)
    fn = jax.jit(jax.value_and_grad(lambda p: loss_sums(p, graphdef, _batch())[0]))
    return fn(params)


def _assert_same(a, b, rtol):
    (loss_a, grads_a), (loss_b, grads_b) = a, b
    np.testing.assert_allclose(float(loss_a), float(loss_b), rtol=rtol)
    for ga, gb in zip(jax.tree.leaves(grads_a), jax.tree.leaves(grads_b)):
        np.testing.assert_allclose(np.asarray(ga), np.asarray(gb), rtol=rtol, atol=1e-7)


def test_scan_equals_unrolled_values_and_grads():
    scanned = _loss_and_grads(CFG)
    unrolled = _loss_and_grads(dataclasses.replace(CFG, scan_layers=False))
    _assert_same(scanned, unrolled, rtol=1e-5)


@pytest.mark.parametrize("policy", [p for p in REMAT_POLICIES if p != "none"])
def test_remat_gives_same_values_and_grads(policy):
    _assert_same(_loss_and_grads(CFG), _loss_and_grads(dataclasses.replace(CFG, remat=policy)),
                 rtol=1e-5)


def test_llama3_rope_scaling_matches_published_rule():
    cfg = dataclasses.replace(CFG, head_dim=128, num_heads=1, rope_theta=500000.0,
                              rope_scaling_factor=8.0, rope_original_max_len=8192)
    base = np.asarray(rope_frequencies(dataclasses.replace(cfg, rope_scaling_factor=0.0)))
    scaled = np.asarray(rope_frequencies(cfg))
    wavelen = 2 * np.pi / base
    high = wavelen < 8192 / 4.0  # short wavelengths: unchanged
    low = wavelen > 8192 / 1.0  # long wavelengths: divided by the factor
    np.testing.assert_allclose(scaled[high], base[high], rtol=1e-6)
    np.testing.assert_allclose(scaled[low], base[low] / 8.0, rtol=1e-6)
    mid = ~high & ~low
    assert mid.any() and np.all(scaled[mid] < base[mid]) and np.all(scaled[mid] > base[mid] / 8.0)


def test_tied_embeddings_and_qkv_bias_shapes():
    cfg = dataclasses.replace(CFG, tie_embeddings=True, qkv_bias=True)
    params = nnx.to_pure_dict(nnx.state(_model(cfg)))
    assert "lm_head" not in params
    assert params["layers"]["attn"]["bq"].shape == (3, 4, 16)
    assert params["layers"]["attn"]["bk"].shape == (3, 2, 16)
    assert _logits(_model(cfg), _tokens(0, (1, 8))).shape == (1, 8, 128)


@pytest.mark.parametrize("sizes", [(64, 64), (48, 32)])
def test_attention_self_check_catches_a_kernel_that_leaks_across_documents(monkeypatch, sizes):
    """A kernel that is causal but ignores packed-document boundaries (a real failure of fused
    kernels) fails the start-up check with one line naming it; the reference passes. At the
    model's head sizes, latent attention's unequal query/key and value sizes included."""
    from jaxtron.config import ConfigError
    from jaxtron.ops import attention

    def leaky(q, k, v, segment_ids):  # every row one document: attends across boundaries
        return attention.xla_attention(q, k, v, jnp.ones_like(segment_ids))

    monkeypatch.setitem(attention.ATTENTION_IMPLS, "leaky", leaky)
    with pytest.raises(ConfigError, match=rf"model.attention=leaky disagrees .* sizes "
                                          rf"{sizes[0]}/{sizes[1]}\): output off by"):
        attention.self_check("leaky", sizes=sizes)
    errors = attention.self_check("xla", sizes=sizes)  # the reference agrees with itself
    assert max(errors.values()) == 0.0, errors


def test_head_sizes_are_the_families_attention_shapes():
    """The start-up check runs the shapes training will: latent attention's query/key of
    qk_nope + qk_rope and value of v_head_dim, else head_size for both."""
    from helpers import ROOT

    from jaxtron import config as config_lib
    from jaxtron.model import head_sizes

    assert head_sizes(config_lib.load([ROOT / "configs" / "tiny.yaml"]).model) == (64, 64)
    m = config_lib.load([ROOT / "configs" / "tiny_deepseek.yaml"]).model
    assert head_sizes(m) == (m.mla.qk_nope_head_dim + m.mla.qk_rope_head_dim, m.mla.v_head_dim)
    assert head_sizes(m)[0] != head_sizes(m)[1]


def test_attention_auto_is_cudnn_on_gpus_only():
    from jaxtron.ops import attention

    assert attention.resolve("auto", "gpu") == "cudnn"
    assert attention.resolve("auto", "cpu") == "xla"
    assert attention.resolve("xla", "gpu") == "xla"
    assert attention.resolve("auto", "gpu", "float32") == "xla"  # cuDNN's kernels are 16-bit
