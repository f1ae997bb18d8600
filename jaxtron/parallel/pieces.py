"""A microbatch's positions cut into one piece per pipeline stage, for the 1F1B ticks
(one_f_one_b.py): stage 0's fresh input and the loss's output gradient gathered from the pieces,
the last stage's output and stage 0's input gradient scattered into them, so that every stage
computes the loss of its own piece and no device sends another its positions."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtron import parallel
from jaxtron.parallel import pipeline as gpipe

STAGE = "stage"


@dataclass(frozen=True)
class Pieces:
    """A microbatch's positions cut into S pieces, stage s's piece the s-th part of each of the
    `ways` runs of positions a device holds (act_seq), so that no device sends another its
    positions. Stage 0's fresh input and the loss's output gradient are the pieces gathered
    (an all-gather), the last stage's output and stage 0's input gradient scattered (a
    reduce-scatter of a masked sum): half an all-reduce's traffic each."""

    seq: int
    stages: int

    @property
    def ways(self) -> int:
        return seq_ways(self.seq, self.stages)

    def _runs(self, a: jax.Array, axis: int, pieces: int) -> jax.Array:
        """a[..., T, ...] (T at `axis`) -> [..., ways, pieces, T/(ways*S), ...]."""
        run = self.seq // (self.ways * self.stages)
        return a.reshape(*a.shape[:axis], self.ways, pieces, run, *a.shape[axis + 1:])

    def _joined(self, runs: jax.Array, axis: int) -> jax.Array:
        return runs.reshape(*runs.shape[:axis], -1, *runs.shape[axis + 3:])

    def _per_run(self, fn: Callable, runs_bWSRD: jax.Array) -> jax.Array:
        """fn (a collective over `stage`) on each device's own runs: left to the partitioner,
        it gathered the runs over the act_seq axes first and moved whole sequences (8x the
        bytes at tensor 8)."""
        if self.ways == 1 or jax.sharding.get_abstract_mesh().empty:
            return fn(runs_bWSRD)
        entry = parallel.spec(("act_seq",))[0]
        spec = P(None, entry)
        return jax.shard_map(fn, in_specs=spec, out_specs=spec,
                             axis_names={entry} if isinstance(entry, str) else set(entry),
                             check_vma=False)(runs_bWSRD)

    def take(self, a: jax.Array, me: jax.Array) -> jax.Array:
        """Stage `me`'s piece [b, T/S, ...] of a [b, T, ...] array."""
        runs = self._runs(a, 1, self.stages)
        return self._joined(jax.lax.dynamic_slice_in_dim(runs, me, 1, 2), 1)

    def put(self, a: jax.Array, piece: jax.Array, me: jax.Array) -> jax.Array:
        """a [b, T, ...] with stage `me`'s piece replaced by `piece` [b, T/S, ...] (`take`'s
        inverse)."""
        runs = self._runs(a, 1, self.stages)
        return self._joined(jax.lax.dynamic_update_slice_in_dim(
            runs, self._runs(piece, 1, 1).astype(a.dtype), me, 2), 1)

    def gathered(self, piece: jax.Array) -> jax.Array:
        """Every stage's piece [b, T/S, ...] gathered into [b, T, ...] (an all-gather)."""
        gather = lambda runs: jax.lax.all_gather(runs, STAGE, axis=2, tiled=True)
        return self._joined(self._per_run(gather, self._runs(piece, 1, 1)), 1)

    def scattered(self, a: jax.Array) -> jax.Array:
        """This stage's piece of the sum over the stages of a[b, T, ...] (a reduce-scatter)."""
        scatter = lambda runs: jax.lax.psum_scatter(runs, STAGE, scatter_dimension=2, tiled=True)
        return self._joined(self._per_run(scatter, self._runs(a, 1, self.stages)), 1)

    def stacked(self, x_MbTD: jax.Array) -> jax.Array:
        """[M, b, T, ...] -> [S, M, b, T/S, ...]: every stage's pieces, stage-sharded."""
        runs = self._runs(x_MbTD, 2, self.stages)
        return gpipe._stage_sharded(self._joined(jnp.moveaxis(runs, 3, 0)[:, :, :, :, None], 3))

    def unstacked(self, pieces_SMbPD: jax.Array) -> jax.Array:
        """The inverse of `stacked`."""
        runs = self._runs(pieces_SMbPD, 3, 1)[:, :, :, :, 0]
        return self._joined(jnp.moveaxis(runs, 0, 3), 2)


def seq_ways(seq: int, stages: int) -> int:
    """How many devices the activations' positions are split over between layers (act_seq:
    context and tensor), where T splits into that many runs of S pieces; else 1."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return 1
    entry = parallel.spec(("act_seq",))[0]
    axes = (entry,) if isinstance(entry, str) else entry or ()
    ways = math.prod(mesh.shape.get(a, 1) for a in axes)
    return ways if seq % (ways * stages) == 0 else 1
