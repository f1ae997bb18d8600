"""1F1B in half ticks (parallel/half_ticks.py): the half ticks played in Python with the
program's own arithmetic and carries, every value tagged with its microbatch, against what each
forward, backward and piece needs; and the slots it keeps. The program itself is held against
one device in test_one_f_one_b.py and test_moe_pipeline.py (schedule=1f1b)."""

from __future__ import annotations

import pytest

from jaxtron.parallel import half_ticks, one_f_one_b, pipeline
from jaxtron.plan import tick_timing


def _play(s: int, m: int) -> dict:
    """Every stage's carries through the loop: recv (what the last swap brought), the input
    pieces coming down, the input gradient's pieces going up. Returns the half ticks of each
    forward and backward, the most microbatches alive per stage, the pieces each stage kept."""
    lead, trips = pipeline.half_lead(s), pipeline.Pipeline(s, 1, m, schedule="1f1b").iterations
    recv = [None] * s
    down = [dict() for _ in range(s)]  # piece -> microbatch
    up = [dict() for _ in range(s)]
    kept = [dict() for _ in range(s)]  # microbatch -> stage of the gradient piece kept
    fwd, bwd = {}, {}
    for k in range(-lead, 2 * trips - lead):
        out = [None] * s
        for me in range(s):
            f_turn = (k - me) % 2 == 0
            if f_turn:
                i = half_ticks.forward_item(k, me)
                if 0 <= i < m:
                    if me == 0:
                        pieces = {**down[0], 0: i}
                        assert pieces == {p: i for p in range(s)}, (k, pieces)
                    else:
                        assert recv[me] == ("y", i, me - 1), (k, me, recv[me])
                    fwd[me, i] = k
                    out[me] = ("y", i, me)
                send = out[me], dict(up[me])
            else:
                i = half_ticks.backward_item(k, me, s)
                if 0 <= i < m:
                    assert recv[me] == ("dy", i, me + 1), (k, me, recv[me])
                    bwd[me, i] = k
                    out[me] = ("dy", i, me)
                    if me == 0:
                        kept[0][i] = 0
                        up[0] = {p: i for p in range(1, s)}
                j = half_ticks.down_item(k, me)
                pieces = {**down[me], me: j} if me >= 1 and 0 <= j < m else dict(down[me])
                send = out[me], pieces
            out[me] = send
        for a in range(k % 2, s - 1, 2):  # the swaps: a ran a forward, a + 1 a backward
            (y, up_pkt), (dy, down_pkt) = out[a], out[a + 1]
            recv[a + 1], recv[a] = y, dy
            down[a] = down_pkt
            i = half_ticks.up_item(k, a + 1, s)
            if 0 <= i < m:
                assert up_pkt.get(a + 1) == i, (k, a + 1, up_pkt)
                kept[a + 1][i] = a + 1
            up[a + 1] = {p: v for p, v in up_pkt.items() if p != a + 1}
        if (k - (s - 1)) % 2 == 0:  # the last stage's loss: its backward next half tick
            i = half_ticks.forward_item(k, s - 1)
            if 0 <= i < m:
                recv[s - 1] = ("dy", i, s)
    alive = [max(sum(fwd[me, i] <= k <= bwd[me, i] for i in range(m))
                 for k in range(-lead, 2 * trips - lead)) for me in range(s)]
    return {"fwd": fwd, "bwd": bwd, "alive": alive, "kept": kept}


@pytest.mark.parametrize("s,m", [(2, 1), (2, 4), (3, 5), (4, 8), (4, 3), (8, 16), (5, 12)])
def test_half_ticks_bring_every_value_in_time_and_keep_s_alive(s, m):
    got = _play(s, m)
    assert len(got["fwd"]) == len(got["bwd"]) == s * m
    for me in range(s):  # a microbatch alive from its forward to its backward: S - me at most
        assert got["alive"][me] == min(s - me, m)
        assert got["kept"][me] == {i: me for i in range(m)}  # its piece of each input gradient
        for i in range(m):  # a slot (i % S) is free again before the next use of it
            later = i + min(s, m)
            if later < m:
                assert got["bwd"][me, i] < got["fwd"][me, later]
    assert one_f_one_b.Ticks(s, 1, m, halves=True).slots == min(s, m)


def test_half_ticks_keep_the_1f1b_bubble():
    """Stage 0's forwards and backwards: 2M half ticks of work in 2(M + S - 1)."""
    s, m = 4, 8
    got = _play(s, m)
    first, last = got["fwd"][0, 0], got["bwd"][0, m - 1]
    assert last - first + 1 == 2 * (m + s - 1)


@pytest.mark.parametrize("s,m,f,b", [(4, 16, 1.0, 2.0), (8, 64, 1.0, 3.0)])
def test_only_neighbours_meeting_keeps_the_1f1b_step(s, m, f, b):
    """Played with their meets (plan/tick_timing.py): the half ticks take the whole ticks'
    (M + S - 1)(F + B), though a forward and a backward share each half tick on neighbouring
    stages; a meet of every stage in each tick would make each half tick a backward long."""
    ideal = (m + s - 1) * (f + b)
    assert tick_timing.play(tick_timing.whole_ticks(s, m, f, b)) == ideal
    assert tick_timing.play(tick_timing.half_ticks(s, m, f, b)) == ideal
    lined_up = tick_timing.play(tick_timing.half_ticks(s, m, f, b, meet_all=True))
    assert lined_up >= 0.9 * ideal * 2 * b / (f + b)  # 2B per microbatch, not F + B


def test_the_loss_on_the_last_stage_lengthens_the_half_ticks():
    """The last stage's loss (L per microbatch) is on the half ticks' critical path, where the
    whole ticks share it out: about (S-1)/S of M*L more (planner.step_time's loss term)."""
    s, m, f, b, loss = 8, 64, 1.0, 2.0, 0.36
    whole = tick_timing.play(tick_timing.whole_ticks(s, m, f, b, loss))
    half = tick_timing.play(tick_timing.half_ticks(s, m, f, b, loss))
    assert half - whole == pytest.approx(m * loss * (s - 1) / s, rel=0.15)
