"""The 1F1B schedules (`1f1b`, `interleaved_1f1b`, `zb_h1`) over the `stage` mesh axis, inside
one SPMD program, with the backward written out.

Each tick every stage runs one item's forward and one item's backward, so a microbatch's
activations live from its forward on a stage to its backward there, never the whole pass.
docs/operations.md, "The pipeline", has the schedule and its bubble.

The loop computes the loss, its gradients and the stages' sends itself, and `loss` wraps it as a
`custom_vjp` (the gradients are its residuals), so the train step differentiates the model as
before. A stage's forward is `jax.vjp` of its layers; the pullback's residuals (what the remat
policy saves, the stage input among them) wait in a ring of slots until its backward, where the
weights and the microbatch's rows are passed again instead of stored per slot.

Items. With R repeats (virtual stages) per stage the microbatches go in groups of S: item i is
group i // (S*R), repeat (i // S) % R, microbatch group*S + i % S, as Megatron-Core orders
interleaved 1F1B. Stage s runs the forward of item t - s at tick t, and the backward of
backward-item t - D + s, D = (R+1)*S - 2 (backward-items run the repeats last to first). When
a microbatch leaves the last stage's last repeat, every stage computes the loss of S-th of its
positions, and the microbatch's backward starts on the last stage in the same tick.
At most (R+1)*S - 1 items are alive on a stage at once (stage 0): that many slots, each one
repeat's layers of one microbatch, (1 + 1/R)*S microbatches of a stage's activations whatever M
(Megatron-Core's interleaved count; its 1F1B keeps S, stage s entering the steady state after
S - s forwards, which lockstep ticks of one forward and one backward cannot).
Ticks: M*R + D; a stage with no forward (or backward) in a tick skips it (`lax.cond`), so the
bubble is (S-1)/(R*M + S-1) as for 1F1B and interleaved 1F1B.

A mixture of experts (`router`): a sequence's balancing loss couples the pair counts of all its
layers, on every stage. Each microbatch's router statistics summed over the layers so far ride
with its activations; the last stage forms the router's objective of the whole sums and its
gradient in them, which rides back with the activations' gradient and is each stage's
cotangent of its layers' statistics (`stage_ops.Flow`).

zb_h1 (R = 1): the backward cut into B, the input gradient, and W, the weight gradients
(zero_bubble.split). Stage s's first s backward-items come before stage 0's first backward
(t < D); their W waits in a queue of S-1 items and runs in the stage's last s ticks, where it
has no backward, so the warm-up ticks last F + B instead of F + B + W (pipeline.Pipeline.bubble).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from jaxtron.parallel import half_ticks, pieces, stage_ops, stage_vjp
from jaxtron.parallel import pipeline as gpipe

STAGE = "stage"
# The named scopes of a tick's forward, loss and backward: the compiled program's conditionals
# run each on some ticks only, and flops.compiled weighs their matmuls by `shares`.
SCOPES = ("1f1b_forward", "1f1b_loss", "1f1b_backward", "1f1b_weights")


@dataclass(frozen=True)
class Ticks:
    """The 1F1B tick arithmetic of S stages, R repeats and M microbatches (module docstring)."""

    stages: int
    repeats: int
    microbatches: int
    zero_bubble: bool = False  # zb_h1: the backward's weight gradients apart (module docstring)
    halves: bool = False  # 1f1b: forwards and backwards in alternate half ticks (half_ticks.py)

    @classmethod
    def of(cls, pipe: gpipe.Pipeline) -> Ticks:
        return cls(pipe.stages, pipe.repeats, pipe.microbatches, pipe.schedule == "zb_h1",
                   pipe.schedule == "1f1b")

    @property
    def items(self) -> int:
        return self.microbatches * self.repeats

    @property
    def delay(self) -> int:  # D: stage s runs backward-item t - D + s at tick t
        return (self.repeats + 1) * self.stages - 2

    @property
    def ticks(self) -> int:
        """The loop's trip count: ticks, or with `halves` pairs of half ticks."""
        if self.halves:
            return gpipe.Pipeline(self.stages, 1, self.microbatches, schedule="1f1b").iterations
        return self.items + self.delay

    @property
    def slots(self) -> int:
        """The most items whose residuals are alive at once on a stage: (R+1)*S - 1 once M >=
        S, stage 0's (Megatron-Core's interleaved count, S*R*(1 + (S-1)/(S*R)) items); S with
        `halves` (Megatron-Core's 1F1B count)."""
        if self.halves:
            return min(self.stages, self.microbatches)
        return int(self.slot_table().max()) + 1

    @functools.cache  # noqa: B019 (a frozen dataclass of three ints)
    def slot_table(self) -> np.ndarray:
        """[S, items]: the slot each item's residuals take on each stage, from its forward to
        its backward tick (both included). The lifetimes are intervals, so taking the lowest
        slot free at each forward in tick order uses as few slots as are ever alive at once."""
        table = np.zeros((self.stages, self.items), np.int32)
        backward_tick = np.zeros(self.items, np.int64)
        for stage in range(self.stages):
            for b in range(self.items):
                backward_tick[self.backward_item(b)[2]] = b + self.delay - stage
            free_at: list[int] = []  # per slot: the first tick it is free again
            for item in range(self.items):  # forwards in tick order: item + stage
                start = item + stage
                slot = next((i for i, t in enumerate(free_at) if t <= start), len(free_at))
                free_at[slot:slot + 1] = [int(backward_tick[item]) + 1]
                table[stage, item] = slot
        return table

    def shares(self) -> dict[str, float]:
        """Per named scope (SCOPES), the share of the ticks on which a stage runs it: the
        forward and backward on M*R, its share of the loss on M. With `halves` each runs in two
        conditionals per trip (one per half), and the last stage alone runs the loss: per trip
        M/(2T) of each forward and backward, M/(S*T) of the loss, the mean over the stages."""
        if self.halves:
            both = self.items / (2 * self.ticks)
            return dict(zip(SCOPES, (both, self.items / (self.stages * self.ticks), both, 0.0)))
        work = self.items / self.ticks
        return dict(zip(SCOPES, (work, self.microbatches / self.ticks, work, work)))

    def forward_item(self, i):
        """Item i's (microbatch, repeat)."""
        s, r = self.stages, self.repeats
        return (i // (s * r)) * s + i % s, (i // s) % r

    def backward_item(self, i):
        """Backward-item i's (microbatch, repeat, its forward item): repeats last to first."""
        s, r = self.stages, self.repeats
        group, u = i // (s * r), i % s
        repeat = r - 1 - (i // s) % r
        return group * s + u, repeat, group * s * r + repeat * s + u


def loss(layers_fn: Callable, tail_fn: Callable, stacked: Any, tail: Any, x_BTD: jax.Array,
         positions_BT: jax.Array, segment_ids_BT: jax.Array, targets_BT: jax.Array,
         mask_BT: jax.Array, pipe: gpipe.Pipeline, permutes: bool = False,
         router: Any = None) -> tuple[jax.Array, jax.Array, dict]:
    """(the summed objective, the summed loss, the router's sums) of the batch through every
    stacked layer (stored in `layer_order`) and `tail_fn(tail, x_bTD, targets_bT, mask_bT,
    strided=False)` (final norm, LM head, cross-entropy: a sum over the microbatch; `strided`
    chunks of positions, vocab.plain_total, for 1f1b's whole microbatches), the objective
    differentiable in `stacked`, `tail` and `x_BTD`. `layers_fn(stacked, x, positions,
    segment_ids, select=)` runs one stage's layers as in pipeline.run: (x, their statistics
    [L', ...]). `permutes`: the layers hold collective permutes over the stage's devices
    (collective matmuls; see `stage_ops.skips`).

    `router` (a mixture of experts, moe.Router): each microbatch's statistics summed over the
    layers ride with its activations to the last stage, which adds `router.objective` of them
    to the loss; its gradient in those sums rides back with the activations' gradient into
    every stage's backward (module docstring). Its sums: `router.sums` of the objective's parts
    summed over microbatches and each layer's statistics [L, ...], storage order; {} without."""
    return _loss(layers_fn, tail_fn, pipe, permutes, router, stacked, tail, x_BTD,
                 positions_BT, segment_ids_BT, targets_BT, mask_BT)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2, 3, 4))
def _loss(layers_fn, tail_fn, pipe, permutes, router, stacked, tail, x_BTD, positions_BT,
          segment_ids_BT, targets_BT, mask_BT):
    return _run(layers_fn, tail_fn, pipe, permutes, router, stacked, tail, x_BTD, positions_BT,
                segment_ids_BT, targets_BT, mask_BT, grads=False)[0]


def _loss_fwd(layers_fn, tail_fn, pipe, permutes, router, stacked, tail, x_BTD, *batch):
    return _run(layers_fn, tail_fn, pipe, permutes, router, stacked, tail, x_BTD, *batch)


def _loss_bwd(layers_fn, tail_fn, pipe, permutes, router, grads, g):
    """The objective's gradient times its cotangent; the loss and the sums are read, never
    differentiated."""
    del layers_fn, tail_fn, pipe, permutes, router
    d_stacked, d_tail, d_x = jax.tree.map(lambda a: (a * g[0]).astype(a.dtype), grads)
    return d_stacked, d_tail, d_x, None, None, None, None


_loss.defvjp(_loss_fwd, _loss_bwd)


def _run(layers_fn, tail_fn, pipe: gpipe.Pipeline, permutes: bool, router, stacked, tail, x_BTD,
         positions_BT, segment_ids_BT, targets_BT, mask_BT, grads: bool = True):
    """((objective sum, loss sum, router sums), (d stacked, d tail, d x)) of the whole batch
    through the 1F1B ticks; without `grads` the forwards alone, the gradients zeros."""
    skip = stage_ops.skips(permutes)
    s, r, m = pipe.stages, pipe.repeats, pipe.microbatches
    staged = jax.tree.map(
        lambda w: gpipe._stage_sharded(
            w.reshape(s, r, w.shape[0] // (s * r), *w.shape[1:]).swapaxes(1, 2)), stacked)
    copies = gpipe._copy_axes(pipe)
    leaves, tree = jax.tree.flatten(staged)
    specs = [spec if copies == ("data",) else gpipe._without_fsdp(spec)
             for spec in gpipe._layer_specs(stacked)]
    # One copy of the stage weights per data replica, gathered over fsdp in the compute dtype
    # once per pass (pipeline._gathered): the ticks read these.
    whole = [gpipe._gathered(gpipe._copied(w, copies, spec), copies, spec, pipe.dtype)
             for w, spec in zip(leaves, specs)]
    # the inputs and their gradient spread over the stages by positions: stage s holds its
    # piece (`pieces.Pieces.take`) of every microbatch, gathered for stage 0 at its tick
    x_MbTD = gpipe._microbatches(x_BTD, m)
    cut = pieces.Pieces(x_BTD.shape[1], s)
    inputs_SMbPD = cut.stacked(x_MbTD)
    rows = [gpipe._microbatches(a, m) for a in (positions_BT, segment_ids_BT, targets_BT,
                                                 mask_BT)]
    ticks = Ticks.of(pipe)

    def per_device(whole, tail, inputs_SMbPD, *rows):
        w = [a[0, 0] for a in whole]
        if grads and ticks.halves:
            out = half_ticks.program(layers_fn, tail_fn, s, jax.tree.unflatten(tree, w), tail,
                                     inputs_SMbPD[0], rows, specs, skip, router, SCOPES[:3])
        else:
            out = _ticks(layers_fn, tail_fn, ticks, jax.tree.unflatten(tree, w), tail,
                         inputs_SMbPD[0], rows, specs, skip, grads, router)
        totals, d_w, d_tail, d_inputs, layer_stats = out
        meshed = stage_ops.meshed()
        axes = (STAGE, *copies) if meshed else STAGE
        totals, d_tail = jax.lax.psum((totals, d_tail), axes)
        # the copies' gradients summed here, into the running sum's own buffers
        d_w = jax.lax.psum(jax.tree.leaves(d_w), copies) if meshed else jax.tree.leaves(d_w)
        layer_stats = jax.lax.psum(layer_stats, copies) if meshed else layer_stats
        return (totals, [a[None] for a in d_w], d_tail, d_inputs[None],
                jax.tree.map(lambda a: a[None], layer_stats))

    if stage_ops.meshed():
        per_copy, io = P(STAGE, copies), P(STAGE, None, copies)
        fn = jax.shard_map(per_device,
                           in_specs=(per_copy, P(), io, *[P(None, copies)] * 4),
                           out_specs=(P(), P(STAGE), P(), io, P(STAGE)),
                           axis_names={STAGE, *copies}, check_vma=False)
    else:  # one device: the stages vmapped, the per-device blocks' [1, ...] axes added
        fn = _vmapped(per_device)
    totals, d_whole, d_tail, d_inputs, layer_stats = fn(whole, tail, inputs_SMbPD, *rows)
    objective, entropy, parts = totals
    # [S, R, L', ...] -> [L, ...]: layer s*R*L' + r*L' + l, the stored order
    layer_stats = jax.tree.map(lambda a: a.reshape(-1, *a.shape[3:]), layer_stats)
    sums = router.sums(parts, layer_stats) if router is not None else {}
    # back to the stacked layout [L, ...] in the weights' dtype
    d_staged = [d.astype(w.dtype) for d, w in zip(d_whole, leaves)]
    d_stacked = jax.tree.map(
        lambda d: d.swapaxes(1, 2).reshape(-1, *d.shape[3:]),
        jax.tree.unflatten(tree, d_staged))
    d_x = cut.unstacked(d_inputs).swapaxes(0, 1).reshape(x_BTD.shape)
    d_tail = jax.tree.map(lambda d, a: d.astype(a.dtype), d_tail, tail)
    return (objective, entropy, sums), (d_stacked, d_tail, d_x.astype(x_BTD.dtype))


def _vmapped(per_device):
    """Without a mesh: the stages vmapped over `stage`, each called with the blocks a device of
    the mesh would hold (whole [1, 1, ...], inputs [1, M, ...]) and its outputs stacked."""

    def one(whole, tail, inputs_MbPD, *rows):
        totals, d_w, d_tail, d_inputs, stats = per_device([w[None] for w in whole], tail,
                                                          inputs_MbPD[None], *rows)
        return (totals, [d[0, 0] for d in d_w], d_tail, d_inputs[0],
                jax.tree.map(lambda a: a[0], stats))

    return jax.vmap(one, in_axes=(0, None, 0, None, None, None, None),
                    out_axes=(None, 0, None, 0, 0), axis_name=STAGE)


def _ticks(layers_fn, tail_fn, ticks: Ticks, w, tail, inputs_MbPD, rows, specs, skip: bool,
           grads: bool = True, router=None):
    """One stage's program: every tick a forward and a backward (each skipped where the stage
    has none, with `skip`; else computed and dropped), then the sends. Returns ((objective sum,
    loss sum, the router objective's parts summed), d w summed in float32, d tail, d inputs,
    the stage's layers' statistics [R, L', ...]). Without `grads` the forwards and the loss
    only (the loss's value outside autodiff: an evaluation), M*R + S - 1 ticks, nothing
    stored."""
    positions_MbT, segments_MbT, targets_MbT, mask_MbT = rows
    s, r = ticks.stages, ticks.repeats
    last = s - 1
    me, cut, when, stage_fn, zero_x, primals, flow = stage_ops.setting(
        layers_fn, w, inputs_MbPD, rows, router, skip, s)
    # x stored, w passed again
    pullback = stage_vjp.Pullback.of(stage_fn, primals) if grads else None
    slots = [jnp.zeros((ticks.slots, *a.shape), a.dtype) for a in pullback.stored] if grads else []
    slots_of = jnp.asarray(ticks.slot_table())  # [S, items]

    def forward(t, x_bTD):
        """Item t - me's forward: its output and the residuals its slot is to hold."""
        micro, repeat = ticks.forward_item(t - me)
        args = (w, x_bTD, positions_MbT[micro], segments_MbT[micro], repeat)
        if not grads:
            return stage_fn(*args), []
        return pullback.forward(stage_fn, args)

    def no_forward(t, x):
        return (zero_x, flow.zeros()), [jnp.zeros(a.shape, a.dtype)
                                        for a in (pullback.stored if grads else [])]

    def store(buffers, stored, t, do_f):
        """The new item's residuals into its slot, outside the conditional (a ring passed
        through one is held twice: its operand and its result); where the stage had no
        forward, the slot is written back as it was."""
        slot = slots_of[me, jnp.clip(t - me, 0, ticks.items - 1)]
        out = []
        for b, a in zip(buffers, stored):
            old = jax.lax.dynamic_index_in_dim(b, slot, 0, False)
            out.append(jax.lax.dynamic_update_index_in_dim(b, jnp.where(do_f, a, old), slot, 0))
        return out

    piece = cut.seq // s  # the positions of the loss each stage computes
    take = lambda a: cut.take(a, me)

    def loss_of(y_bPD, micro):
        """This stage's share of the tail's loss of the microbatch leaving the last stage (its
        piece of the positions, `take`), the share's gradient in the tail and in y."""
        fn = lambda p, y: tail_fn(p, y, take(targets_MbT[micro]), take(mask_MbT[micro]))
        if not grads:
            part = fn(tail, y_bPD)
            return part.astype(jnp.float32), jax.tree.map(jnp.zeros_like, tail), y_bPD
        part, vjp = jax.vjp(fn, tail, y_bPD)
        d_tail, d_y = vjp(jnp.ones_like(part))
        return part.astype(jnp.float32), d_tail, d_y

    def slot_of_backward(buffers, t):
        """The residuals of backward-item t - D + me, read out of their slot."""
        item = ticks.backward_item(jnp.clip(t - ticks.delay + me, 0, ticks.items - 1))[2]
        return [jax.lax.dynamic_index_in_dim(b, slots_of[me, item], 0, False) for b in buffers]

    def backward(t, stored, ct_bTD):
        """Backward-item t - D + me: (d w, d x) from its stored residuals."""
        micro, repeat, _ = ticks.backward_item(t - ticks.delay + me)
        args = (w, None, positions_MbT[micro], segments_MbT[micro], repeat)
        d_w, d_x = pullback.backward(args, stored, ct_bTD)
        return d_w, d_x

    def item_args(item):
        """The passed-again arguments of backward-item `item`, x None."""
        micro, repeat, _ = ticks.backward_item(item)
        return (w, None, positions_MbT[micro], segments_MbT[micro], repeat)

    # zb_h1: the backward cut into B (d x) and W (d w); W of the backward-items a stage runs
    # before stage 0's first backward waits in `queue` for the stage's idle last ticks
    cut_w = (pullback.split(item_args(0), (zero_x, flow.zeros()))
             if grads and ticks.zero_bubble else None)
    queue = ([jnp.zeros((s - 1, *a.shape), a.dtype) for a in cut_w.found] if cut_w else [])

    def split_backward(t, b_item, do_b, buffers, ct_bTD, queue):
        """B of backward-item b_item, and W of it or, in the stage's last idle ticks, of one
        that waited: (d w, d x, queue)."""
        zeros_w = lambda *_: jax.tree.map(jnp.zeros_like, w)
        with jax.named_scope(SCOPES[2]):
            d_x, early, found = when(
                do_b, lambda t, b, c: pullback.input_grad(cut_w, item_args(t - ticks.delay + me),
                                                         b, c),
                lambda t, b, c: (zero_x, zeros_w(),
                                 [jnp.zeros(a.shape, a.dtype) for a in cut_w.found]),
                t, slot_of_backward(buffers, t), ct_bTD)
        wait = do_b & (t < ticks.delay)  # b_item < me
        late = t - (ticks.ticks - me)  # the stage's idle last ticks: W of item `late`
        do_late = (late >= 0) & (late < me) & (late < ticks.items)  # M < S: fewer waited
        at = lambda i: jnp.clip(i, 0, s - 2)
        queue = [jax.lax.dynamic_update_index_in_dim(
            q, jnp.where(wait, f, jax.lax.dynamic_index_in_dim(q, at(b_item), 0, False)),
            at(b_item), 0) for q, f in zip(queue, found)]
        found = [jnp.where(do_late, jax.lax.dynamic_index_in_dim(q, at(late), 0, False), f)
                 for q, f in zip(queue, found)]
        with jax.named_scope(SCOPES[3]):
            d_w = when((do_b & ~wait) | do_late,
                       lambda i, f: pullback.weight_grad(cut_w, item_args(i), f), zeros_w,
                       jnp.where(do_late, late, b_item), found)
        return jax.tree.map(jnp.add, early, d_w), d_x, queue

    f32 = lambda tree: jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)
    acc_w = [stage_ops.constrained(a, spec) for a, spec in zip(jax.tree.leaves(f32(w)), specs)]

    up = lambda a: jax.lax.ppermute(a, STAGE, [(i, (i + 1) % s) for i in range(s)])
    down = lambda a: jax.lax.ppermute(a, STAGE, [(i, (i - 1) % s) for i in range(s)])

    def tick(carry, t):
        recv_f, recv_b, buffers, acc_w, total, d_tail_sum, d_inputs, queue, routed = carry
        sums_f, sums_b, acc_stats, value_sum, parts_sum = routed
        # stage 0's fresh microbatch, its pieces gathered from every stage
        micro0, repeat0 = ticks.forward_item(jnp.minimum(t, ticks.items - 1))
        fresh = cut.gathered(inputs_MbPD[micro0])
        first = (me == 0) & (repeat0 == 0) & (t < ticks.items)
        x_bTD = jnp.where(first, fresh, recv_f)
        f_item = t - me
        do_f = (f_item >= 0) & (f_item < ticks.items)
        with jax.named_scope(SCOPES[0]):
            (y_bTD, stats), stored = when(do_f, forward, no_forward, t, x_bTD)
        buffers = store(buffers, stored, t, do_f)
        # the statistics summed over the layers so far ride with the output
        sums_out = flow.added(jax.tree.map(lambda a: jnp.where(first, 0, a), sums_f), stats)
        acc_stats = flow.logged(acc_stats, stats, ticks.forward_item(f_item)[1])
        # the output on to the next stage, behind the loss and backward below on GPUs
        recv_f, sums_f = up(y_bTD), jax.tree.map(up, sums_out)
        # The loss of the microbatch leaving the last stage, shared out: every stage computes
        # the head and loss of T/S of its positions, so the last stage's ticks are no longer
        # than the others' (the head alone is 12% of a 70B stage's matmuls on 8 stages).
        l_micro, l_repeat = ticks.forward_item(t - last)
        do_loss = (t - last >= 0) & (t - last < ticks.items) & (l_repeat == r - 1)
        y_last = cut.scattered(jnp.where(me == last, y_bTD, 0))  # this stage's piece
        with jax.named_scope(SCOPES[1]):
            part, d_tail, d_piece = when(
                do_loss, loss_of,
                lambda y, m: (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, tail),
                              jnp.zeros_like(y[:, :piece])), y_last, l_micro)
        total = total + part
        d_tail_sum = jax.tree.map(jnp.add, d_tail_sum, d_tail)
        d_sums = flow.zeros_summed()
        if router is not None:  # on the last stage, from the sums that left it
            value, parts, d_sums = when(
                do_loss & (me == last), lambda a, m: stage_ops.objective(router, a, mask_MbT[m]),
                lambda a, m: (jnp.zeros((), jnp.float32),
                              jax.tree.map(jnp.zeros_like, parts_sum), flow.zeros_summed()),
                sums_out, l_micro)
            value_sum = value_sum + value.astype(jnp.float32)
            parts_sum = jax.tree.map(jnp.add, parts_sum, parts)
        routed = (sums_f, sums_b, acc_stats, value_sum, parts_sum)
        if not grads:
            return (recv_f, recv_b, buffers, acc_w, total, d_tail_sum, d_inputs, queue,
                    routed), None
        d_y = cut.gathered(d_piece)
        b_item = t - ticks.delay + me
        do_b = (b_item >= 0) & (b_item < ticks.items)
        _, b_repeat, _ = ticks.backward_item(b_item)
        starts = (me == last) & (b_repeat == r - 1)
        d_sums = jax.tree.map(lambda d, a: jnp.where(starts, d, a), d_sums, sums_b)
        ct_bTD = (jnp.where(starts, d_y, recv_b), flow.spread(d_sums))
        if cut_w is None:
            with jax.named_scope(SCOPES[2]):
                d_w, d_x = when(do_b, backward,
                                lambda t, b, c: (jax.tree.map(jnp.zeros_like, w), zero_x),
                                t, slot_of_backward(buffers, t), ct_bTD)
        else:
            d_w, d_x, queue = split_backward(t, b_item, do_b, buffers, ct_bTD, queue)
        acc_w = [a + stage_ops.constrained(d.astype(jnp.float32), spec)
                 for a, d, spec in zip(acc_w, jax.tree.leaves(d_w), specs)]
        # stage 0's first repeat: d x of the microbatch, its pieces back to the stages
        item0 = t - ticks.delay
        micro0, repeat0, _ = ticks.backward_item(jnp.clip(item0, 0, ticks.items - 1))
        done = (item0 >= 0) & (item0 < ticks.items) & (repeat0 == 0)
        d_fresh = cut.scattered(jnp.where(done & (me == 0), d_x, 0))
        old = jax.lax.dynamic_index_in_dim(d_inputs, micro0, 0, False)
        d_inputs = jax.lax.dynamic_update_index_in_dim(
            d_inputs, jnp.where(done, d_fresh.astype(d_inputs.dtype), old), micro0, 0)
        # the gradient on to the stage below, with the sums' gradient the backward was given
        recv_b, sums_b = down(d_x), jax.tree.map(down, d_sums)
        routed = (sums_f, sums_b, acc_stats, value_sum, parts_sum)
        return (recv_f, recv_b, buffers, acc_w, total, d_tail_sum, d_inputs, queue,
                routed), None

    zero = jnp.zeros((), jnp.float32)
    parts = flow.zeros_parts(zero_x.shape[0])
    routed = (flow.zeros_summed(), flow.zeros_summed(), flow.zeros_logged(r), zero, parts)
    carry = (zero_x, zero_x, slots, acc_w, zero, jax.tree.map(jnp.zeros_like, tail),
             jnp.zeros_like(inputs_MbPD), queue, routed)
    length = ticks.ticks if grads else ticks.items + s - 1
    carry, _ = jax.lax.scan(tick, carry, jnp.arange(length))
    _, _, _, acc_w, total, d_tail_sum, d_inputs, _, routed = carry
    _, _, acc_stats, value_sum, parts_sum = routed
    # the router's value once, from the last stage (the sum over stages adds the others' 0)
    totals = (total + value_sum, total, parts_sum)
    return (totals, jax.tree.unflatten(jax.tree.structure(w), acc_w), d_tail_sum, d_inputs,
            acc_stats)
