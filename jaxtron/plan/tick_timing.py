"""How long the 1F1B programs' ticks take when each device runs its own program and only the
devices a collective names wait for each other: a model of the step's critical path, in units
of a stage's forward time, for choosing the half ticks' design (parallel/half_ticks.py).

A device's program is a list of ("compute", seconds) and ("meet", key, devices): a meet ends when
every named device has reached it, as a collective permute between two stages (or an all-gather
over all of them) does on GPUs.
"""

from __future__ import annotations


def play(programs: list[list[tuple]]) -> float:
    """When the last device finishes its program."""
    n = len(programs)
    pc, clock, arrived = [0] * n, [0.0] * n, {}
    moved = True
    while moved:
        moved = False
        for d in range(n):
            while pc[d] < len(programs[d]):
                op = programs[d][pc[d]]
                if op[0] == "compute":
                    clock[d] += op[1]
                    pc[d] += 1
                    moved = True
                    continue
                _, key, group = op
                arrived.setdefault(key, {})[d] = clock[d]
                if any(g not in arrived[key] for g in group):
                    break
                end = max(arrived[key][g] for g in group)
                for g in group:
                    clock[g], pc[g] = end, pc[g] + 1
                moved = True
    if any(pc[d] < len(programs[d]) for d in range(n)):
        raise ValueError("the programs' meets do not match")
    return max(clock)


def whole_ticks(s: int, m: int, f: float, b: float, loss: float = 0.0) -> list[list[tuple]]:
    """one_f_one_b's ticks: a forward, the loss shared out over every stage (a meet of all),
    a backward, then the sends to both neighbours (a meet of all, as the ring's permutes)."""
    everyone = tuple(range(s))
    programs = [[] for _ in range(s)]
    for t in range(m + 2 * s - 2):
        for me, p in enumerate(programs):
            if 0 <= t - me < m:
                p.append(("compute", f))
            p.append(("meet", ("loss", t), everyone))
            if 0 <= t - s + 1 < m:
                p.append(("compute", loss / s))
            if 0 <= t - 2 * s + 2 + me < m:
                p.append(("compute", b))
            p.append(("meet", ("send", t), everyone))
    return programs


def half_ticks(s: int, m: int, f: float, b: float, loss: float = 0.0,
               meet_all: bool = False) -> list[list[tuple]]:
    """half_ticks' program: a forward or a backward per half tick, the last stage's loss after
    its forward, then the swap with one neighbour. `meet_all`: with a collective over every
    stage in each tick as well (what the loss shared out, or stage 0's input gathered from its
    pieces, would add)."""
    programs = [[] for _ in range(s)]
    for k in range(2 * (m + s - 1)):
        for me, p in enumerate(programs):
            if (k - me) % 2 == 0:
                if 0 <= (k - me) // 2 < m:
                    p.append(("compute", f + (loss if me == s - 1 else 0.0)))
                if me + 1 < s:
                    p.append(("meet", ("swap", k, me), (me, me + 1)))
            else:
                if 0 <= (k + me + 1) // 2 - s < m:
                    p.append(("compute", b))
                if me >= 1:
                    p.append(("meet", ("swap", k, me - 1), (me - 1, me)))
            if meet_all and k % 2:
                p.append(("meet", ("all", k), tuple(range(s))))
    return programs
