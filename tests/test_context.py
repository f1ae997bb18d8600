"""Context parallelism's pieces: the balanced order, attention over a sequence split across
`context` ranks (XLA, and cuDNN's split into diagonal and prefix calls with their merge and
backward, on CPU through stand-ins with cuDNN's semantics), and the layouts it refuses.

Whole training runs on context meshes against one device are in tests/test_parallel.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import (
    assert_refused,
    fake_backward,
    fake_forward,
    run_attention,
    run_launch,
    tiny_config,
)

from jaxtron import parallel
from jaxtron.config import ConfigError, MeshConfig
from jaxtron.ops import attention, context_attention
from jaxtron.parallel import context
from jaxtron.step import check_segments

B, T, N, K, H = 2, 64, 4, 2, 16  # C = 4 ranks: pieces of c = 8 positions
# Documents across three pieces, a piece starting mid-document, one starting a document exactly,
# short documents inside one piece, and padding (id 0) filling the last pieces.
SEGMENTS = np.array([[1] * 29 + [2] * 3 + [3] * 4 + [4] * 18 + [0] * 10,
                     [1] * 8 + [2] * 40 + [3] * 16], np.int32)


def test_each_rank_holds_a_piece_from_either_end():
    np.testing.assert_array_equal(context.order(16, 2).reshape(2, 2, 4)[:, :, 0],
                                  [[0, 12], [4, 8]])  # rank 0: pieces 0 and 3; rank 1: 1 and 2
    x = jnp.arange(3 * 48).reshape(3, 48)
    balanced = context.to_balanced(x, 3)
    np.testing.assert_array_equal(balanced[0], context.order(48, 3))
    np.testing.assert_array_equal(context.to_natural(balanced, 3), x)


def _inputs():
    keys = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(keys[0], (B, T, N, H), jnp.float32)
    k, v = (jax.random.normal(key, (B, T, K, H), jnp.float32) for key in keys[1:3])
    return q, k, v, jnp.asarray(SEGMENTS), jax.random.normal(keys[3], (B, T, N, H))


@pytest.fixture
def cudnn_stand_ins(monkeypatch):
    monkeypatch.setattr(context_attention, "cudnn_forward", fake_forward)
    monkeypatch.setattr(context_attention, "cudnn_backward", fake_backward)


@pytest.mark.parametrize("impl", ["xla", "cudnn"])
def test_split_sequence_attends_like_the_whole_one(cudnn_stand_ins, impl):
    """Balanced, split over context=4 (fsdp=2 splitting the batch), against the reference on the
    natural order: output and the gradients of q, k and v (float32)."""
    q, k, v, segments, cotangent = _inputs()
    want = jax.jit(lambda *a: run_attention(attention.xla_attention, *a))(q, k, v, segments, cotangent)
    mesh = parallel.make_mesh(MeshConfig(context=4, fsdp=2), jax.devices())

    def split(q, k, v, segments):
        ways = 4  # the mesh's context ranks
        run = lambda *a: context_attention.attention(*a, impl=impl)
        out = run(*(context.to_balanced(x, ways) for x in (q, k, v, segments)))
        return context.to_natural(out, ways)

    with jax.set_mesh(mesh):
        got = jax.jit(lambda *a: run_attention(split, *a))(q, k, v, segments, cotangent)
    for name, a, r in zip(("output", "dq", "dk", "dv"), got, want):
        np.testing.assert_allclose(a, r, atol=2e-5, rtol=2e-5, err_msg=name)


def test_cudnn_stand_ins_match_the_reference(cudnn_stand_ins):
    """The stand-ins are cuDNN's semantics: one whole causal call with the segment mask as a
    bias gives the reference output, and its backward from the output and statistics gives
    autodiff's gradients (so the test above checks the split, not the stand-ins)."""
    q, k, v, segments, cotangent = _inputs()
    same = segments[:, :, None] == segments[:, None, :]
    bias = jnp.where(same, 0.0, -1e30)[:, None]
    out, lse = fake_forward(q, k, v, bias, None, None, True)
    want = run_attention(attention.xla_attention, q, k, v, segments, cotangent)
    np.testing.assert_allclose(out, want[0], atol=1e-5)
    grads = fake_backward(q, k, v, bias, None, None, True, out, lse, cotangent)
    for a, r in zip(grads, want[1:]):
        np.testing.assert_allclose(a, r, atol=1e-5)


@pytest.mark.parametrize("ways", [2, 4])
def test_the_gpu_self_check_simulates_the_ranks_on_one_device(cudnn_stand_ins, monkeypatch, ways):
    """`context_attention.simulated`: the ranks as a vmap on one device (what model.attention_check
    runs on a GPU before a context-parallel run) passes the self-check, forward and gradients;
    a prefix call that reads its window one key too far fails it, naming the split form."""
    errors = attention.self_check("cudnn", jnp.float32, 1e-5, context_attention.simulated(ways))
    assert max(errors.values()) < 1e-5
    monkeypatch.setattr(context_attention._Prefix, "kv_len", lambda self: self.length + 1)
    with pytest.raises(ConfigError, match=r"split over mesh.context\) disagrees"):
        attention.self_check("cudnn", jnp.float32, 1e-2, context_attention.simulated(ways),
                             form=" (split over mesh.context)")


@pytest.mark.parametrize("overrides,names", [
    (("mesh.context=4", "mesh.fsdp=2", "train.seq_len=100"), ("train.seq_len", "mesh.context")),
    (("mesh.context=2", "mesh.fsdp=2", "mesh.tensor=2", "train.seq_len=36"),
     ("train.seq_len", "2*mesh.context*mesh.tensor")),
])
def test_a_sequence_that_does_not_split_into_pieces_is_refused(overrides, names):
    cfg = tiny_config(*overrides)
    sizes = parallel.mesh_shape(cfg.mesh, 8)
    with pytest.raises(ConfigError, match="train.seq_len=") as refusal:
        parallel.check_layout(cfg, sizes)
    assert all(name in str(refusal.value) for name in names)


def test_context_with_experts_is_refused_in_one_line():
    result = run_launch("--config", "configs/tiny_moe.yaml", "--dry-run", "--devices", "8",
                        "mesh.context=2", "mesh.fsdp=2", "mesh.expert=2")
    assert_refused(result.returncode, result.stderr, "mesh.context=2", "mesh.expert")


def test_the_layout_names_context_only_where_it_splits():
    assert "context" not in parallel.mesh_shape(MeshConfig(fsdp=8), 8)
    sizes = parallel.mesh_shape(MeshConfig(fsdp=-1, context=4), 8)
    assert sizes == {"data": 1, "stage": 1, "fsdp": 2, "context": 4, "tensor": 1}
    assert parallel.describe(sizes) == "data=1, stage=1, fsdp=2, context=4, tensor=1"


def test_a_segment_id_reused_further_along_a_row_is_refused():
    """The context split's prefix call finds a piece's first document by its id's first
    occurrence: each document's ids must be one contiguous run. Packed rows pass (padding 0 at
    the end, ids from 1); a row whose id 1 comes back after id 2 is refused before the model,
    naming the id and the row."""
    check_segments(np.array([[1, 1, 2, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]]))
    check_segments(np.array([[0, 0, 0, 0]]))
    with pytest.raises(ConfigError, match="segment id 1 .* row 1"):
        check_segments(np.array([[1, 1, 2, 2, 3, 3, 0, 0], [1, 1, 2, 2, 1, 1, 0, 0]]))
