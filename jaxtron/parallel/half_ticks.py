"""1F1B in half ticks (`pipeline.schedule=1f1b`): Megatron-Core's 1F1B inside one SPMD program,
at most S microbatches' activations alive on a stage whatever M.

In half tick k stage s runs a forward when k - s is even (microbatch (k - s)/2) and a backward
otherwise (microbatch (k + s + 1)/2 - S). Then each stage that ran a forward swaps with the
stage above it: its output goes up, that stage's input gradient comes down. The last stage runs
a microbatch's loss right after its forward and its backward in the next half tick, so
microbatch i lives on stage s from half tick 2i + s to 2i + 2S - 1 - s: S - s at once, S slots.
The whole ticks (one_f_one_b.py) run a forward and a backward in every tick, so each hop costs
a tick and stage 0 keeps 2S - 1.

Only neighbours wait on each other here, so forwards and backwards keep their own lengths
(Megatron's send-forward-receive-backward pairs). A collective over every stage inside the loop
would line the stages up each tick and make every half tick as long as a backward: 4/3 of the
step at B = 2F (tools/pipeline_timing.py plays both). Hence:
- the loss runs on the last stage alone: its head and cross-entropy lengthen that stage by the
  loss's time per microbatch (the whole ticks share the loss out over the stages);
- stage 0's inputs and their gradient stay spread over the stages by positions
  (pieces.Pieces). Each stage's piece of a microbatch rides down the swaps to stage 0, and
  stage 0's input gradient rides up them, each stage keeping its own piece. For that the loop
  runs about S half ticks before the first forward and S after the last backward, with no
  compute in them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxtron.parallel import pipeline as gpipe
from jaxtron.parallel import stage_ops, stage_vjp

STAGE = "stage"


def forward_item(k, me):
    """The microbatch stage `me` runs forward in half tick k, where k - me is even."""
    return (k - me) // 2


def backward_item(k, me, stages: int):
    """The microbatch stage `me` runs backward in half tick k, where k - me is odd."""
    return (k + me + 1) // 2 - stages


def down_item(k, me):
    """The microbatch whose input pieces stage `me` sends down in half tick k (a backward's),
    its own added: stage 0 runs it forward in half tick 2i."""
    return (k + 1 + me) // 2


def up_item(k, me, stages: int):
    """The microbatch whose input gradient's pieces reach stage `me` from below in half tick k
    (a backward's): stage 0 sends them up in the half tick after its backward."""
    return (k - 2 * stages - me + 1) // 2


def program(layers_fn, tail_fn, stages: int, w, tail, inputs_MbPD, rows, specs, skip: bool,
            router=None, scopes=("forward", "loss", "backward")):
    """One stage's program through the half ticks, with gradients: ((objective sum, loss sum,
    the router objective's parts summed), d w summed in float32, d tail, d inputs [M, b, T/S,
    ...] (this stage's pieces), the stage's layers' statistics [1, L', ...]), as
    one_f_one_b._ticks returns them."""
    positions_MbT, segments_MbT, targets_MbT, mask_MbT = rows
    s, m = stages, targets_MbT.shape[0]
    last = s - 1
    me, cut, when, stage_fn, zero_x, primals, flow = stage_ops.setting(
        layers_fn, w, inputs_MbPD, rows, router, skip, s)
    pullback = stage_vjp.Pullback.of(stage_fn, primals)
    slots = min(s, m)
    rows_of = lambda i: (positions_MbT[i], segments_MbT[i], i * 0)  # repeat 0, traced as in `of`
    zeros_w = lambda: jax.tree.map(jnp.zeros_like, w)

    def forward(i, x_bTD):
        return pullback.forward(stage_fn, (w, x_bTD, *rows_of(i)))

    def no_forward(i, x_bTD):
        return (zero_x, flow.zeros()), [jnp.zeros(a.shape, a.dtype) for a in pullback.stored]

    def backward(i, stored, ct):
        return pullback.backward((w, None, *rows_of(i)), stored, ct)

    def loss_of(y_bTD, i):
        """The last stage's loss of microbatch i and its gradient in the tail and in y."""
        fn = lambda p, y: tail_fn(p, y, targets_MbT[i], mask_MbT[i], strided=True)
        part, vjp = jax.vjp(fn, tail, y_bTD)
        d_tail, d_y = vjp(jnp.ones_like(part))
        return part.astype(jnp.float32), d_tail, d_y

    def no_loss(y_bTD, i):
        return jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, tail), y_bTD * 0

    def objective(sums, i):
        return stage_ops.objective(router, sums, mask_MbT[i])

    def no_objective(sums, i):
        return jnp.zeros((), jnp.float32), flow.zeros_parts(zero_x.shape[0]), flow.zeros_summed()

    def at(a, i):
        return jax.lax.dynamic_index_in_dim(a, i, 0, False)

    def put(a, i, value, pred):
        return jax.lax.dynamic_update_index_in_dim(a, jnp.where(pred, value, at(a, i)), i, 0)

    def half(carry, d_w_sum, k, h: int):
        """Half tick k (k = h mod 2, h static: the swaps' pairs): the carry, and `d_w_sum`
        with this half's weight gradients added."""
        recv, recv_sums, down_pkt, up_pkt, buffers, totals, d_tail_sum, d_inputs, acc_stats = carry
        f_turn = (h - me) % 2 == 0
        f_item, b_item = forward_item(k, me), backward_item(k, me, s)
        do_f = f_turn & (f_item >= 0) & (f_item < m)
        do_b = ~f_turn & (b_item >= 0) & (b_item < m)
        fi, bi = jnp.clip(f_item, 0, m - 1), jnp.clip(b_item, 0, m - 1)
        # the forward: stage 0's input its own piece and the pieces that came down
        x_bTD = jnp.where(me == 0, cut.put(down_pkt, inputs_MbPD[fi], 0), recv)
        with jax.named_scope(scopes[0]):
            (y_bTD, stats), stored = when(do_f, forward, no_forward, fi, x_bTD)
        buffers = [put(b, fi % slots, a, do_f) for b, a in zip(buffers, stored)]
        sums_out = flow.added(jax.tree.map(lambda a: jnp.where(me == 0, 0, a), recv_sums), stats)
        acc_stats = flow.logged(acc_stats, stats, 0)
        total, value_sum, parts_sum = totals
        if (h - last) % 2 == 0:  # the last stage runs forwards in this half: the loss after one
            do_loss = do_f & (me == last)
            with jax.named_scope(scopes[1]):
                part, d_tail, d_y = when(do_loss, loss_of, no_loss, y_bTD, fi)
            total = total + part
            d_tail_sum = jax.tree.map(jnp.add, d_tail_sum, d_tail)
            d_sums = recv_sums
            if router is not None:
                value, parts, d_sums = when(do_loss, objective, no_objective, sums_out, fi)
                value_sum = value_sum + value.astype(jnp.float32)
                parts_sum = jax.tree.map(jnp.add, parts_sum, parts)
        # the backward, from the gradient that came down (the loss's, on the last stage)
        ct = (recv, flow.spread(recv_sums))
        with jax.named_scope(scopes[2]):
            d_w, d_x = when(do_b, backward, lambda i, b, c: (zeros_w(), zero_x), bi,
                            [at(b, bi % slots) for b in buffers], ct)
        d_w_sum = [a + d.astype(jnp.float32) for a, d in zip(d_w_sum, jax.tree.leaves(d_w))]
        d_inputs = put(d_inputs, bi, cut.take(d_x, 0).astype(d_inputs.dtype), do_b & (me == 0))
        # the swap: up the output, the router sums and the input gradient's pieces; down the
        # input gradient, the sums' gradient and the inputs' pieces, this stage's added
        sent = down_item(k, me)
        adds = ~f_turn & (me >= 1) & (sent >= 0) & (sent < m)
        down_send = jnp.where(adds, cut.put(down_pkt, inputs_MbPD[jnp.clip(sent, 0, m - 1)], me),
                              down_pkt)
        send = (jnp.where(f_turn, y_bTD, d_x),
                jax.tree.map(lambda a, b: jnp.where(f_turn, a, b), sums_out, recv_sums),
                jnp.where(f_turn, up_pkt, down_send))
        pairs = [(a, a + 1) for a in range(h % 2, s - 1, 2)]
        got = (jax.lax.ppermute(send, STAGE, pairs + [(b, a) for a, b in pairs]) if pairs
               else jax.tree.map(jnp.zeros_like, send))
        from_above = f_turn & (me + 1 < s)
        from_below = ~f_turn & (me >= 1)
        paired = from_above | from_below
        recv = jnp.where(paired, got[0], recv)
        recv_sums = jax.tree.map(lambda a, b: jnp.where(paired, a, b), got[1], recv_sums)
        if (h - last) % 2 == 0:  # the last stage's next backward starts from its loss
            recv = jnp.where(me == last, d_y, recv)
            recv_sums = jax.tree.map(lambda a, b: jnp.where(me == last, a, b), d_sums, recv_sums)
        down_pkt = jnp.where(from_above, got[2], down_pkt)
        up_pkt = jnp.where(from_below, got[2], jnp.where((me == 0) & ~f_turn, d_x, up_pkt))
        # this stage's piece of the input gradient that came up
        came = up_item(k, me, s)
        keep = from_below & (came >= 0) & (came < m)
        d_inputs = put(d_inputs, jnp.clip(came, 0, m - 1),
                       cut.take(got[2], me).astype(d_inputs.dtype), keep)
        totals = (total, value_sum, parts_sum)
        return (recv, recv_sums, down_pkt, up_pkt, buffers, totals, d_tail_sum, d_inputs,
                acc_stats), d_w_sum

    def period(carry, p):
        """Two half ticks; their weight gradients (one backward's) added to the running sum
        once, laid out as the weights (a reduce-scatter per trip with grad_sum=sharded)."""
        state, acc_w = carry
        d_w = [jnp.zeros(a.shape, jnp.float32) for a in jax.tree.leaves(w)]
        for h in (0, 1):
            state, d_w = half(state, d_w, 2 * p + h - gpipe.half_lead(s), h)
        acc_w = [a + stage_ops.constrained(d, spec) for a, d, spec in zip(acc_w, d_w, specs)]
        return (state, acc_w), None

    f32 = lambda a: jnp.zeros(a.shape, jnp.float32)
    acc_w = [stage_ops.constrained(f32(a), spec) for a, spec in zip(jax.tree.leaves(w), specs)]
    zero = jnp.zeros((), jnp.float32)
    carry = (zero_x, flow.zeros_summed(), zero_x, zero_x,
             [jnp.zeros((slots, *a.shape), a.dtype) for a in pullback.stored],
             (zero, zero, flow.zeros_parts(zero_x.shape[0])), jax.tree.map(jnp.zeros_like, tail),
             jnp.zeros_like(inputs_MbPD), flow.zeros_logged(1))
    trips = gpipe.Pipeline(s, 1, m, schedule="1f1b").iterations
    (carry, acc_w), _ = jax.lax.scan(period, (carry, acc_w), jnp.arange(trips))
    *_, (total, value_sum, parts_sum), d_tail_sum, d_inputs, acc_stats = carry
    totals = (total + value_sum, total, parts_sum)
    return (totals, jax.tree.unflatten(jax.tree.structure(w), acc_w), d_tail_sum, d_inputs,
            acc_stats)
