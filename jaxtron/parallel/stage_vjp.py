"""A pipeline stage's forward as `jax.vjp`, its residuals kept apart from what its backward is
given again (the weights, the microbatch's rows), and that backward whole or cut into the input
gradient and the weight gradients (zero_bubble). The 1F1B ticks (one_f_one_b) store the
residuals in their ring of slots and call the backward ticks later."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp

from jaxtron.parallel import zero_bubble


@dataclass
class Pullback:
    """A stage forward's `jax.vjp` split into what is stored per item (`stored`: the residuals,
    the stage input among them when the pullback reads it) and what is passed again in the
    backward (the weights, the microbatch's rows, the repeat): the weights are never copied per
    slot. The primals are (w, x, positions, segment_ids, repeat)."""

    tree: Any  # the treedef of the VJP object, its jaxpr static
    from_primal: list  # per VJP leaf: the index of the primal leaf it is, or None (stored)
    stored: list  # the stored leaves' shapes

    @classmethod
    def of(cls, fn, primals) -> Pullback:
        found = {}

        def trace(*primals):
            out, vjp = jax.vjp(fn, *primals)
            found["tree"], found["from_primal"], stored = _residuals(vjp, primals)
            return stored

        stored = jax.eval_shape(trace, *primals)
        return cls(found["tree"], found["from_primal"], list(stored))

    def forward(self, fn, args):
        y, vjp = jax.vjp(fn, *args)
        tree, from_primal, stored = _residuals(vjp, args)
        if from_primal != self.from_primal or [a.shape for a in stored] != [
                a.shape for a in self.stored]:
            raise AssertionError("a stage's forward traced two ways")
        return y, stored

    def backward(self, args, stored, ct):
        """(d w, d x) of the item whose `stored` leaves these are; args' x is None."""
        flat, pos = jax.tree.leaves(args), iter(stored)
        leaves = [next(pos) if i is None else flat[i] for i in self.from_primal]
        d_w, d_x, *_ = jax.tree.unflatten(self.tree, leaves)(ct)
        return d_w, d_x

    def split(self, args, ct) -> zero_bubble.Split:
        """The backward cut into B (d x) and W (d w): `input_grad`, `weight_grad`. `ct`: the
        outputs' cotangent, any tree of arrays of their shapes."""
        flat, tree = jax.tree.flatten(args)
        n_w, n_in = len(jax.tree.leaves(args[0])), len(flat) + len(self.stored)
        ct_leaves, ct_tree = jax.tree.flatten(ct)

        def fn(*a):
            d_w, d_x = self.backward(jax.tree.unflatten(tree, a[:len(flat)]),
                                     a[len(flat):n_in], jax.tree.unflatten(ct_tree, a[n_in:]))
            return [*jax.tree.leaves(d_w), d_x]

        stored = [jnp.zeros(a.shape, a.dtype) for a in self.stored]
        return zero_bubble.split(fn, [*flat, *stored, *ct_leaves], [n_w],
                                 list(range(len(flat))))

    @staticmethod
    def input_grad(cut: zero_bubble.Split, args, stored, ct):
        """B: (d x, the weight gradients B computes whole (the others zeros), what W reads)."""
        (d_x,), early, found = cut.b(*jax.tree.leaves(args), *stored, *jax.tree.leaves(ct))
        return d_x, _placed(args[0], cut.early, early), found

    @staticmethod
    def weight_grad(cut: zero_bubble.Split, args, found):
        """W: the weight gradients B left (the others zeros), in args[0]'s tree."""
        return _placed(args[0], cut.late, cut.w(jax.tree.leaves(args), found))


def _placed(w, indices, values):
    """w's tree of zeros with `values` at leaves `indices`."""
    leaves = [jnp.zeros_like(a) for a in jax.tree.leaves(w)]
    for i, v in zip(indices, values):
        leaves[i] = v
    return jax.tree.unflatten(jax.tree.structure(w), leaves)


def _residuals(vjp, primals):
    """(treedef, per leaf the index of the passed-again primal leaf it is or None, the leaves
    stored: all others, the stage input x (primals[1]) too)."""
    leaves, tree = jax.tree.flatten(vjp)
    flat = jax.tree.leaves((primals[0], None, *primals[2:]))
    ids = {id(p): i for i, p in enumerate(flat)}
    from_primal = [ids.get(id(leaf)) for leaf in leaves]
    return tree, from_primal, [a for a, i in zip(leaves, from_primal) if i is None]
