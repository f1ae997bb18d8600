"""Attention whose values have another head size than its queries and keys (DeepSeek-V3's latent
attention: 192 for q and k, 128 for v), here 24 and 16 on the CPU: the output has v's head size,
the scores the scale of q's. The XLA reference against numpy, the KV-cache form and the context
split (XLA, and cuDNN's diagonal and prefix calls through test_context's stand-ins) against the
reference, and cuDNN's one-device entry through a stand-in for the kernel (it needs a GPU).

Whether cuDNN compiles these shapes for an H100 is a compile-only question (docs/compile_for.md):
jax's own entry checks for a local Hopper GPU before it emits the kernel."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fake_backward, fake_forward, run_attention

from jaxtron import parallel
from jaxtron.config import MeshConfig
from jaxtron.ops import attention, context_attention
from jaxtron.parallel import context

B, T, N, K, HQK, HV = 2, 32, 4, 2, 24, 16
# Packed rows: a document crossing the middle (the context split's pieces), short ones, padding.
SEGMENTS = np.array([[1] * 11 + [2] * 9 + [3] * 7 + [0] * 5,
                     [1] * 3 + [2] * 29], np.int32)
TOLERANCE = dict(atol=2e-5, rtol=2e-5)  # float32 throughout


def _inputs(kv_heads: int = K):
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (B, T, N, HQK), jnp.float32)
    k = jax.random.normal(keys[1], (B, T, kv_heads, HQK), jnp.float32)
    v = jax.random.normal(keys[2], (B, T, kv_heads, HV), jnp.float32)
    return q, k, v, jnp.asarray(SEGMENTS), jax.random.normal(keys[3], (B, T, N, HV))


def _numpy_attention(q, k, v, segments):
    """Per row and head, in float64: softmax(q k^T / sqrt(q's H)) v over the earlier keys of the
    same segment (padding, id 0, attends to earlier padding as the kernels do)."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b, t, n, h = q.shape
    group = n // k.shape[2]
    out = np.zeros((b, t, n, v.shape[3]))
    for row in range(b):
        seen = (np.tril(np.ones((t, t), bool))
                & (segments[row][:, None] == segments[row][None, :]))
        for head in range(n):
            scores = q[row, :, head] @ k[row, :, head // group].T / np.sqrt(h)
            scores = np.where(seen, scores, -np.inf)
            probs = np.exp(scores - scores.max(-1, keepdims=True))
            probs /= probs.sum(-1, keepdims=True)
            out[row, :, head] = probs @ v[row, :, head // group]
    return out


@pytest.mark.parametrize("kv_heads", [N, K])  # as many kv heads as heads (DeepSeek-V3), grouped
def test_xla_attention_with_a_smaller_v_head_is_the_numpy_reference(kv_heads):
    q, k, v, segments, _ = _inputs(kv_heads)
    out = jax.jit(attention.xla_attention)(q, k, v, segments)
    assert out.shape == (B, T, N, HV)
    np.testing.assert_allclose(out, _numpy_attention(q, k, v, SEGMENTS), **TOLERANCE)


def test_cached_attention_with_a_smaller_v_head_is_the_whole_sequence_attention():
    """The prompt (start 0, all slots) and then 4 new queries at slots 10..13 of a cache whose
    later slots hold keys they must not see: rows of the reference over one document."""
    q, k, v, _, _ = _inputs()
    one_document = jnp.ones((B, T), jnp.int32)
    want = jax.jit(attention.xla_attention)(q, k, v, one_document)
    cached = jax.jit(attention.cached_attention)
    prompt = cached(q, k, v, jnp.int32(0))
    assert prompt.shape == (B, T, N, HV)
    np.testing.assert_allclose(prompt, want, **TOLERANCE)
    step = cached(q[:, 10:14], k, v, jnp.int32(10))
    np.testing.assert_allclose(step, want[:, 10:14], **TOLERANCE)


@pytest.fixture
def cudnn_stand_ins(monkeypatch):
    """test_context's stand-ins with cuDNN's semantics in the context split's cuDNN calls."""
    monkeypatch.setattr(context_attention, "cudnn_forward", fake_forward)
    monkeypatch.setattr(context_attention, "cudnn_backward", fake_backward)


@pytest.mark.parametrize("impl", ["xla", "cudnn"])
def test_two_context_ranks_with_a_smaller_v_head_attend_like_the_whole_sequence(
        cudnn_stand_ins, impl):
    """Balanced, split over context=2 of the simulated CPU devices (fsdp=2 splitting the batch,
    tensor=2 the heads), against the reference on the natural order: output, dq, dk, dv."""
    q, k, v, segments, cotangent = _inputs()
    want = jax.jit(lambda *a: run_attention(attention.xla_attention, *a))(q, k, v, segments, cotangent)
    mesh = parallel.make_mesh(MeshConfig(context=2, fsdp=2, tensor=2), jax.devices())

    def split(q, k, v, segments):
        ways = 2  # the mesh's context ranks
        run = lambda *a: context_attention.attention(*a, impl=impl)
        out = run(*(context.to_balanced(x, ways) for x in (q, k, v, segments)))
        return context.to_natural(out, ways)

    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: run_attention(split, *a))(q, k, v, segments, cotangent)
    for name, a, r, shape in zip(("output", "dq", "dk", "dv"), got, want,
                                 (cotangent.shape, q.shape, k.shape, v.shape)):
        assert a.shape == shape, name
        np.testing.assert_allclose(a, r, **TOLERANCE, err_msg=name)


def test_the_simulated_context_ranks_take_a_smaller_v_head(cudnn_stand_ins):
    """The one-device form of the GPU self-check (`context_attention.simulated`), two ranks."""
    q, k, v, segments, cotangent = _inputs()
    want = run_attention(attention.xla_attention, q, k, v, segments, cotangent)
    got = jax.jit(lambda *a: run_attention(context_attention.simulated(2), *a))(q, k, v, segments,
                                                                      cotangent)
    for name, a, r in zip(("output", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, r, **TOLERANCE, err_msg=name)


def test_cudnn_entry_takes_a_smaller_v_head_with_q_s_scale_and_the_causal_segment_mask(
        monkeypatch):
    """jax.nn's cuDNN entry refuses v of another head size, so `_cudnn_local` calls cuDNN's own
    (here a stand-in with its semantics: the CPU has no cuDNN) with what jax.nn would pass it."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    calls = []

    def kernel(q, k, v, bias=None, mask=None, *, scale, mask_type, **rest):
        calls.append((scale, mask_type, bias, rest))
        q = q * (scale * q.shape[-1] ** 0.5)  # the stand-in scales by q's 1/sqrt(H): the given one
        return fake_forward(q, k, v, jnp.where(mask, 0.0, -1e30), None, None,
                            mask_type == fa.MaskType.CAUSAL)[0]

    monkeypatch.setattr(fa, "dot_product_attention", kernel)
    q, k, v, segments, _ = _inputs(N)
    out = jax.jit(attention.cudnn_attention)(q, k, v, segments)
    np.testing.assert_allclose(out, _numpy_attention(q, k, v, SEGMENTS), **TOLERANCE)
    [(scale, mask_type, bias, rest)] = calls
    assert scale == HQK ** -0.5 and mask_type == fa.MaskType.CAUSAL and bias is None and not rest
