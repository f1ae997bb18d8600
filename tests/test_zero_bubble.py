"""zero_bubble.split (parallel/zero_bubble.py): a backward cut into B (the input gradient) and
W (the weight gradients) gives jax.vjp's gradients, and runs each matmul of the backward once,
the weight gradients' in W. The pipeline's own (zb_h1 against one device, and its compiled
matmuls against 1f1b's) are in test_one_f_one_b."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxtron.parallel import zero_bubble

POLICIES = {"full": None, "save_dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
            "none": jax.checkpoint_policies.everything_saveable}


def _layer(c, w):
    # a: two repeats of the layer's weight, one picked (as a pipeline's stage picks a repeat's
    # layers): its gradient goes into zeros of both; s: a scale, its gradient a reduction
    a = jax.lax.dynamic_index_in_dim(w["a"], jnp.int32(1), 0, False)
    h = jax.nn.silu(c @ a) * w["s"]
    return c + h @ w["b"]


def _stack(x, w, policy):
    body = jax.checkpoint(lambda c, wi: (_layer(c, wi), None), policy=policy)
    return jax.lax.scan(body, x, w)[0]


def _backward(policy):
    """(the backward as a flat function of its residuals and cotangent, its args, w)."""
    k = jax.random.split(jax.random.key(0), 4)
    w = {"a": jax.random.normal(k[0], (3, 2, 8, 16)), "b": jax.random.normal(k[1], (3, 16, 8)) * .1,
         "s": jnp.ones((3, 16))}
    x = jax.random.normal(k[2], (4, 8))
    _, vjp = jax.vjp(lambda w, x: _stack(x, w, policy), w, x)
    leaves, tree = jax.tree.flatten(vjp)

    def fn(*a):
        d_w, d_x = jax.tree.unflatten(tree, a[:-1])(a[-1])
        return [*jax.tree.leaves(d_w), d_x]

    return fn, [*leaves, jax.random.normal(k[3], (4, 8))], w


def _dots(fn, *args) -> int:
    return str(jax.make_jaxpr(fn)(*args)).count("dot_general")


@pytest.mark.parametrize("remat", list(POLICIES))
def test_b_and_w_give_the_gradients_and_run_each_matmul_once(remat):
    fn, args, w = _backward(POLICIES[remat])
    n_w = len(jax.tree.leaves(w))
    cut = zero_bubble.split(fn, args, [n_w], [])
    (d_x,), early, found = cut.b(*args)
    late = cut.w([], found)
    got = [None] * n_w
    for i, v in [*zip(cut.early, early), *zip(cut.late, late)]:
        got[i] = v
    for a, b in zip([*got, d_x], fn(*args)):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6)
    # every weight's gradient matmul in W (x^T g, one per layer's a and b: the scan's body),
    # none of them or of the input gradient's chain twice
    assert _dots(lambda *a: cut.w([], a), *found) == 2
    assert _dots(cut.b, *args) + 2 == _dots(fn, *args)
    # W waits with each layer's two matmul inputs and their outputs' cotangents, [4, 8] and
    # [4, 16] each, and the scale's gradient [16] (a cheap reduction: it runs in B), not with
    # a's [2, 8, 16] zeros to update (W makes its own); and at most the repeat it picks, ()
    shapes = sorted(f.shape for f in found if f.shape)
    assert shapes == sorted([(3, 16), (3, 4, 8), (3, 4, 8), (3, 4, 16), (3, 4, 16)])
    assert len(found) - len(shapes) <= 1


def test_a_weight_gradient_b_computes_whole_leaves_w_at_once():
    """What B needs whole (here a matmul in an opaque call, as a collective matmul's shard_map)
    gives its weight gradient in B: `early`, nothing found for it."""
    @jax.custom_vjp
    def matmul(x, w):
        return x @ w

    def fwd(x, w):
        return x @ w, (x, w)

    def bwd(res, g):
        x, w = res
        both = lambda x, w, g: (g @ w.T, x.T @ g)  # one conditional for both: opaque
        return jax.lax.cond(jnp.isfinite(g).all(), both, both, x, w, g)

    matmul.defvjp(fwd, bwd)
    x, w, g = jnp.ones((4, 8)), jnp.ones((8, 3)), jnp.ones((4, 3))
    _, vjp = jax.vjp(lambda x, w: jnp.tanh(matmul(x, w)), x, w)
    leaves, tree = jax.tree.flatten(vjp)

    def fn(*a):
        d_x, d_w = jax.tree.unflatten(tree, a[:-1])(a[-1])
        return [d_w, d_x]

    args = [*leaves, g]
    cut = zero_bubble.split(fn, args, [1], [])
    assert cut.early == [0] and cut.late == []
    (d_x,), (d_w,), _ = cut.b(*args)
    ref_w, ref_x = fn(*args)
    np.testing.assert_allclose(d_w, ref_w)
    np.testing.assert_allclose(d_x, ref_x)


def test_a_weight_the_scan_reads_whole_sums_its_gradient_in_w():
    """A weight every layer reads (a scan const: shared, or a norm's scale) has its gradient
    summed in a carry of the scan's W part, which B's part never sees: the cheap sum stays in
    W, and the gradients are jax.vjp's."""
    k = jax.random.split(jax.random.key(1), 3)
    w = {"shared": jax.random.normal(k[0], (8, 8)) * .3, "s": jnp.full((8,), 1.5)}
    x, ct = jax.random.normal(k[1], (4, 8)), jax.random.normal(k[2], (4, 8))

    def stack(w, x):
        return jax.lax.scan(lambda c, _: (jnp.tanh(c @ w["shared"]) * w["s"], None), x, None,
                            length=3)[0]

    _, vjp = jax.vjp(stack, w, x)
    leaves, tree = jax.tree.flatten(vjp)

    def fn(*a):
        d_w, d_x = jax.tree.unflatten(tree, a[:-1])(a[-1])
        return [*jax.tree.leaves(d_w), d_x]

    args = [*leaves, ct]
    cut = zero_bubble.split(fn, args, [2], [])
    (d_x,), early, found = cut.b(*args)
    got = dict(zip(cut.late, cut.w([], found))) | dict(zip(cut.early, early))
    for i, ref in enumerate(fn(*args)):
        np.testing.assert_allclose(got.get(i, d_x), ref, rtol=1e-6, atol=1e-6)
    assert _dots(lambda *a: cut.w([], a), *found) == 1  # the shared weight's, in W
