"""The training loss against an independent NumPy cross-entropy on a hand-packed batch.

A 2-layer fp32 model (vocab 128, init_std 0.2 so per-token losses spread over ~1.6 nats instead of
sitting at log V) on 4 rows of 16 tokens holding 2-3 documents each (segment ids 1, 2, ...,
positions restarting at 0) and 0-12 padding tokens (segment id 0) at the row ends. The reference
takes the model's fp32 logits and does log-softmax, target gather, padding mask and sum in float64
NumPy. Measured: |loss_sums - reference| / reference = 4.9e-8 (float32 logsumexp and summation
rounding); asserted rtol 1e-6, while dropping the padding mask moves the sum by 41%. New padding
tokens and targets, and new tokens in other documents, change the loss by exactly 0.0 (measured;
the same positions' own losses move by >= 0.2); asserted within rtol 1e-6 (atol 1e-5 per token).
The 2-microbatch mean equals total/count to 3.2e-8 (rtol 1e-6) while the mean of the microbatch
means is 0.35% off; its gradient equals the one-pass gradient to 1.8e-6 of each array's norm
(asserted 1e-5).
"""

import functools

import jax
import numpy as np
import pytest
from flax import nnx

from jaxtron import config
from jaxtron.model import Transformer
from jaxtron.step import loss_and_grads, loss_sums

MODEL = ["model.num_layers=2", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=2",
         "model.mlp_dim=128", "model.vocab_size=128", "model.init_std=0.2", "model.dtype=float32"]
T = 16
# Document lengths per row; the rest of each row is padding. Rows 0 and 2 (microbatch 0 of 2)
# hold 28 real tokens and rows 1 and 3 (microbatch 1) 17, so a mean of per-microbatch means
# differs from the token-weighted mean.
ROWS = [(5, 7), (3, 4, 6), (10, 6), (2, 2)]
RTOL = 1e-6
_jit_loss_sums = jax.jit(loss_sums, static_argnums=1)
_jit_loss_and_grads = jax.jit(loss_and_grads, static_argnums=(1, 3))


@pytest.fixture(scope="module")
def model_parts():
    """(graphdef, params) of the small model."""
    cfg = config.load(["configs/tiny.yaml"], MODEL)
    make = lambda: Transformer(cfg.model, nnx.Rngs(0))
    # Initialised under jit: eager NNX init runs op by op and takes seconds.
    graphdef = nnx.graphdef(nnx.eval_shape(make))
    return graphdef, jax.jit(lambda: nnx.to_pure_dict(nnx.state(make())))()


def _packed_batch(seed: int = 0) -> dict[str, np.ndarray]:
    """ROWS packed as the data pipeline does: each document's targets are its next tokens."""
    rng = np.random.default_rng(seed)
    batch = {k: np.zeros((len(ROWS), T), np.int32)
             for k in ("tokens", "targets", "segment_ids", "positions")}
    for row, lengths in enumerate(ROWS):
        start = 0
        for segment, n in enumerate(lengths, start=1):
            doc = rng.integers(0, 128, n + 1)
            span = slice(start, start + n)
            batch["tokens"][row, span], batch["targets"][row, span] = doc[:-1], doc[1:]
            batch["segment_ids"][row, span] = segment
            batch["positions"][row, span] = np.arange(n)
            start += n
        # Padding: arbitrary in-vocabulary tokens and targets, segment 0, position 0.
        batch["tokens"][row, start:] = rng.integers(0, 128, T - start)
        batch["targets"][row, start:] = rng.integers(0, 128, T - start)
    return batch


@functools.partial(jax.jit, static_argnums=1)
def _model_logits(params, graphdef, tokens, positions, segment_ids):
    return nnx.merge(graphdef, params)(tokens, positions, segment_ids)


def _logits(model_parts, batch) -> np.ndarray:
    """The model's float32 logits [B, T, V], as float64."""
    graphdef, params = model_parts
    args = (batch[k] for k in ("tokens", "positions", "segment_ids"))
    return np.asarray(_model_logits(params, graphdef, *args), np.float64)


def _token_losses(model_parts, batch) -> np.ndarray:
    """Reference per-token cross-entropy [B, T] in float64 (padding included, unmasked)."""
    logits = _logits(model_parts, batch)
    top = logits.max(axis=-1, keepdims=True)
    log_probs = logits - top - np.log(np.exp(logits - top).sum(axis=-1, keepdims=True))
    return -np.take_along_axis(log_probs, batch["targets"][..., None].astype(np.int64), -1)[..., 0]


def _loss_sums(model_parts, batch) -> tuple[float, int]:
    """jaxtron's (summed loss, token count) of `batch`."""
    graphdef, params = model_parts
    total, count = _jit_loss_sums(params, graphdef, batch)
    return float(total), int(count)


def test_loss_sums_is_the_masked_cross_entropy(model_parts):
    """Summed loss and count against the float64 reference over the non-padding tokens."""
    batch = _packed_batch()
    losses = _token_losses(model_parts, batch)
    real = batch["segment_ids"] != 0
    total, count = _loss_sums(model_parts, batch)
    assert count == sum(map(sum, ROWS)) == 45
    np.testing.assert_allclose(total, losses[real].sum(), rtol=RTOL)
    assert losses.std() > 1.0  # the losses spread: a target-blind loss could not match


def test_padding_tokens_do_not_change_the_loss(model_parts):
    """Other tokens and targets at every padding position: the same sum and count."""
    batch = _packed_batch()
    pad = batch["segment_ids"] == 0
    changed = {k: v.copy() for k, v in batch.items()}
    rng = np.random.default_rng(1)
    for key in ("tokens", "targets"):
        changed[key][pad] = (batch[key][pad] + rng.integers(1, 128, pad.sum())) % 128
    # The padding positions' own losses do change: the edit reaches the model.
    moved = _token_losses(model_parts, changed) - _token_losses(model_parts, batch)
    assert np.abs(moved[pad]).min() > 0
    before, n_before = _loss_sums(model_parts, batch)
    after, n_after = _loss_sums(model_parts, changed)
    assert n_before == n_after == 45
    np.testing.assert_allclose(after, before, rtol=RTOL)


def test_documents_do_not_attend_across_boundaries(model_parts):
    """New tokens in every row's document 1 leave the later documents' per-token losses alone."""
    batch = _packed_batch()
    first = batch["segment_ids"] == 1
    later = batch["segment_ids"] >= 2
    changed = {k: v.copy() for k, v in batch.items()}
    changed["tokens"][first] = (batch["tokens"][first] + 1 + np.arange(first.sum())) % 128
    before, after = _token_losses(model_parts, batch), _token_losses(model_parts, changed)
    assert np.abs(after - before)[first].max() > 0.1  # document 1 itself did change
    np.testing.assert_allclose(after[later], before[later], rtol=RTOL, atol=1e-5)


def test_microbatched_mean_is_total_over_count(model_parts):
    """Two microbatches of unequal token counts: the mean is token-weighted over the batch."""
    graphdef, params = model_parts
    batch = _packed_batch()
    total, count = _loss_sums(model_parts, batch)
    mean, grads, _ = _jit_loss_and_grads(params, graphdef, batch, 2)
    np.testing.assert_allclose(float(mean), total / count, rtol=RTOL)
    # The batch discriminates: the unweighted mean of the microbatch means (rows m::2) is off.
    losses, real = _token_losses(model_parts, batch), batch["segment_ids"] != 0
    means = [losses[m::2][real[m::2]].mean() for m in (0, 1)]
    assert abs(np.mean(means) / (total / count) - 1) > 100 * RTOL
    # And the gradient is the one-pass gradient, per array relative to its norm.
    _, whole, _ = _jit_loss_and_grads(params, graphdef, batch, 1)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(whole)):
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)


@pytest.mark.parametrize("chunk", [4, 6])  # 4 chunks of 4; 6 -> the largest divisor, 4 chunks of 4
def test_chunked_loss_equals_the_whole_loss_and_gradient(model_parts, chunk):
    """The LM head and cross-entropy over chunks of positions (train.loss_chunk): the same sum,
    count and gradient as over the whole [B, T, V] at once."""
    graphdef, params = model_parts
    batch = _packed_batch()
    whole = jax.jit(jax.value_and_grad(loss_sums, has_aux=True), static_argnums=(1, 4))
    (total, count), grads = whole(params, graphdef, batch, None, 0)
    (c_total, c_count), c_grads = whole(params, graphdef, batch, None, chunk)
    assert int(c_count) == int(count) == 45
    np.testing.assert_allclose(float(c_total), float(total), rtol=RTOL)
    for a, b in zip(jax.tree.leaves(c_grads), jax.tree.leaves(grads)):
        assert np.linalg.norm(a - b) <= 1e-5 * np.linalg.norm(b)
    # The chunks cover every position: a loss over the first chunk only is far off.
    first = {k: v.copy() for k, v in batch.items()}
    first["segment_ids"][:, 4:] = 0
    assert float(whole(params, graphdef, first, None, 0)[0][0]) < 0.5 * float(total)


@pytest.mark.parametrize("mesh,tied,extra", [
    (("mesh.tensor=2", "mesh.fsdp=4"), False, ()),
    (("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"), False, ()),
    (("mesh.stage=2", "mesh.fsdp=2", "mesh.tensor=2"), False, ()),  # vocab over (tensor, stage)
    (("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"), True, ()),  # the head is the table
    # Gemma 2's soft-capped logits: the hand-written backward through the cap's tanh
    (("mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2"), True, ("model.logit_softcap=1.5",)),
], ids=["tensor2-fsdp4", "data2-fsdp2-tensor2", "stage2-fsdp2-tensor2", "tied", "softcap"])
def test_sharded_loss_equals_the_whole_loss(model_parts, mesh, tied, extra):
    """The loss under a mesh (jaxtron/ops/vocab.py's shard_map with its own backward): rows over
    data/fsdp/stage, vocabulary over tensor, the head gathered and its gradient reduce-scattered
    by hand. The single-device whole-loss value and gradient (measured <= 2e-7 of each
    gradient's norm; a head gradient not summed over `data` is off by 50%; with soft-capped
    logits the backward without the cap's derivative is off by 0.92 of the embedding's
    gradient)."""
    from jaxtron import parallel
    from jaxtron.step import global_batch
    from jaxtron.step.optim import make_optimizer
    from jaxtron.step.state import make_plan

    cfg = config.load(["configs/tiny.yaml"], MODEL + [*mesh, "train.batch_size=4",
                                                     f"model.tie_embeddings={str(tied).lower()}",
                                                     *extra])
    if tied:
        make = lambda: Transformer(cfg.model, nnx.Rngs(0))
        graphdef = nnx.graphdef(nnx.eval_shape(make))
        params = jax.jit(lambda: nnx.to_pure_dict(nnx.state(make())))()
    else:
        graphdef, params = model_parts
    plan = make_plan(cfg, make_optimizer(cfg), 8)
    mesh_ = parallel.make_mesh(cfg.mesh)
    batch = _packed_batch()
    whole = jax.jit(jax.value_and_grad(loss_sums, has_aux=True), static_argnums=(1, 4))
    (total, _), grads = whole(params, graphdef, batch, None, 0)
    with jax.set_mesh(mesh_):
        sharded = jax.device_put(params, parallel.named(plan.specs["params"], mesh_))
        (c_total, _), c_grads = whole(sharded, graphdef, global_batch(batch, mesh_), None, 4)
    np.testing.assert_allclose(float(c_total), float(total), rtol=RTOL)
    for a, b in zip(jax.tree.leaves(c_grads), jax.tree.leaves(grads)):
        assert np.linalg.norm(np.asarray(a) - b) <= 1e-5 * np.linalg.norm(b)
