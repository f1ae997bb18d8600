"""Goodput: where a run's wall time went, over all its attempts (each start of the same run.dir).

An attempt's wall time, from its Python's start (jaxtron.STARTED: `jaxtron train`, and launch.py,
import jaxtron first thing) to the end of train(), is split into parts:
  startup     Python's start to the loop (imports, joining processes, input, restore, init), less:
  compile     lowering and compiling the train step
  data        the loop waiting for its next batch
  step        the loop's training steps (dispatch, and the device work seen at the loop's syncs)
  checkpoint  the loop blocked on checkpoint saves, and on the last async save at exit
  eval        evaluations on the held-out split (their compile included)
  profile     starting and writing the profiler trace (run.profile_steps)
  other       what none of these covers (writing this account): the parts add up to the wall time
An attempt that resumes from a checkpoint before the last step an earlier attempt trained trains
those steps again: the earlier attempt's time for them moves from `step` to `redone`, using the
cumulative step time it recorded when it saved each checkpoint. Goodput = step / wall, summed over
the attempts; the time between attempts (a job queue) is not counted.

The parts come from the loop's metrics.Stopwatch spans and two clock readings (loop start, loop
end); nothing here syncs with the device. run.dir/goodput.json holds one record per attempt,
written atomically at each log row and checkpoint save (outcome "running") and again when the
attempt ends: done, preempted or failed. An attempt that ended without its exit (SIGKILL, the OOM
killer, a lost host) keeps its account as of its last row or save, and the next attempt marks it
"killed"; its steps after the checkpoint the next one resumes from count as redone.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

import jaxtron
from jaxtron.train.metrics import Stopwatch

FILE = "goodput.json"
PARTS = ("startup", "compile", "data", "step", "checkpoint", "eval", "profile", "redone", "other")
LOOP_PHASES = ("data", "checkpoint", "eval", "profile")  # the loop's time that is not its steps


def process_start() -> float:
    """When this process's Python started, as a time.time() value: when it first imported
    jaxtron (jaxtron.STARTED), which `jaxtron train` (and launch.py) does as it starts. Not
    /proc's start of the pid, which counted what ran in it before python was exec'ed into it:
    `pip install -e . && python launch.py` (bash execs the last command) counted the pip install,
    48 of 51.9 s of start-up."""
    return jaxtron.STARTED


class Attempt:
    """The wall-time account of this attempt, read off the loop's Stopwatch."""

    def __init__(self, watch: Stopwatch, started: float, run_dir: Path | None = None,
                 warn: Callable[[str], None] = print):
        self.watch = watch
        self.started = started  # also the attempt's key in goodput.json
        self.run_dir, self.warn = run_dir, warn  # where persist() writes (None: nowhere)
        self.origin = time.perf_counter() - (time.time() - started)  # `started`, perf_counter clock
        self.resumed_from: int | None = None  # the step the state was restored at (0: fresh)
        self.last_step: int | None = None  # the last step the loop dispatched
        self.step_s_at: dict[str, float] = {}  # checkpoint step -> cumulative step seconds
        self.loop_start: float | None = None  # perf_counter clock
        self.loop_end: float | None = None
        self.in_loop: dict[str, float] = {}  # LOOP_PHASES totals when the loop ended
        self.stragglers: dict[str, int] = {}  # host -> reports that named it

    def start_loop(self, resumed_from: int) -> None:
        """The loop begins after step `resumed_from`; what came before is start-up and compile."""
        self.resumed_from = self.last_step = resumed_from
        self.loop_start = time.perf_counter()

    def step_seconds(self) -> float:
        """Seconds the loop spent in training steps so far: its time outside LOOP_PHASES."""
        end = self.loop_end or time.perf_counter()
        phases = self.in_loop if self.loop_end else self.watch.totals
        return end - self.loop_start - sum(phases.get(p, 0.0) for p in LOOP_PHASES)

    def saved(self, step: int) -> None:
        """A checkpoint of `step` is being saved, `step` finished: note the step time to here."""
        self.step_s_at[str(step)] = self.step_seconds()
        self.persist()

    def straggler(self, host: str) -> None:
        """A straggler report named `host` (jaxtron/train/stragglers.py)."""
        self.stragglers[host] = self.stragglers.get(host, 0) + 1
        self.persist()

    def persist(self) -> None:
        """Write the account so far into goodput.json as a "running" attempt (replaced by the
        record at exit): an attempt killed before its exit still counts, as of this call."""
        if self.run_dir is not None and self.loop_start is not None:
            append(self.run_dir, self.record("running"), self.warn)

    def end_loop(self) -> None:
        """The loop is over (done, preempted or failed); later checkpoint waits are the exit's."""
        if self.loop_end is not None:
            return
        self.loop_end = time.perf_counter()
        if self.loop_start is None:  # it never began: everything so far was start-up
            self.loop_start = self.loop_end
        self.in_loop = {p: self.watch.totals.get(p, 0.0) for p in LOOP_PHASES}

    def record(self, outcome: str) -> dict:
        """This attempt as one goodput.json entry (call after end_loop and the last waits)."""
        totals, now = self.watch.totals, time.perf_counter()
        seconds = {p: totals.get(p, 0.0) for p in ("compile", "data", "checkpoint", "eval")}
        seconds["startup"] = self.loop_start - self.origin - seconds["compile"]
        seconds["profile"] = totals.get("profile", 0.0)
        seconds["step"] = self.step_seconds()
        wall = now - self.origin
        seconds["other"] = wall - sum(seconds.values())
        return {"started": self.started, "wall_s": wall, "outcome": outcome,
                "resumed_from": self.resumed_from, "last_step": self.last_step,
                "seconds": seconds, "step_s_at": self.step_s_at, "stragglers": self.stragglers}


def load(run_dir: Path, warn: Callable[[str], None]) -> list[dict]:
    """The attempts recorded in run_dir so far ([] for none, or for an unreadable file)."""
    path = run_dir / FILE
    if not path.exists():
        return []
    try:
        records = json.loads(path.read_text())
        if isinstance(records, list):
            return records
    except ValueError:
        pass
    warn(f"warning: {path} is not a goodput record; the account starts over from this attempt")
    return []


def append(run_dir: Path, record: dict, warn: Callable[[str], None]) -> list[dict]:
    """Add `record` to run_dir/goodput.json atomically (written whole, then renamed over), in
    place of its attempt's earlier record (the same "started"). Another attempt still marked
    "running" ended without its exit (run.dir's lock lets one run at a time): now "killed"."""
    records = [r for r in load(run_dir, warn) if r["started"] != record["started"]]
    for earlier in records:
        if earlier["outcome"] == "running":
            earlier["outcome"] = "killed"
    records.append(record)
    path = run_dir / FILE
    tmp = path.with_name(f".{FILE}.tmp")
    tmp.write_text(json.dumps(records, indent=1) + "\n")
    os.replace(tmp, path)
    return records


def previous_end(run_dir: Path) -> float:
    """When the last recorded attempt of run_dir ended (0 if none): an attempt made in the same
    process as an earlier one starts no earlier than that, so no second is counted twice."""
    records = load(run_dir, lambda _: None)
    return max((r["started"] + r["wall_s"] for r in records), default=0.0)


def _redone(record: dict, resumed_at: int | None) -> tuple[float, int]:
    """Seconds and steps of `record`'s training that a later attempt, resuming from the
    checkpoint of step `resumed_at`, trains again."""
    first, last, step_s = record["resumed_from"], record["last_step"], record["seconds"]["step"]
    if resumed_at is None or first is None or resumed_at >= last:
        return 0.0, 0
    if resumed_at <= first:
        return step_s, last - first
    kept = record["step_s_at"].get(str(resumed_at))
    if kept is None:  # a checkpoint this attempt did not write: spread its time over its steps
        kept = step_s * (resumed_at - first) / (last - first)
    return step_s - kept, last - resumed_at


def summarize(records: list[dict]) -> dict[str, float]:
    """All attempts: seconds per part (redone moved out of step), wall, goodput, counts."""
    total = dict.fromkeys(PARTS, 0.0)
    redone_steps = 0
    for i, record in enumerate(records):
        for part, value in record["seconds"].items():
            total[part] += value
        later = [r["resumed_from"] for r in records[i + 1:] if r["resumed_from"] is not None]
        seconds, steps = _redone(record, min(later, default=None))
        total["step"] -= seconds
        total["redone"] += seconds
        redone_steps += steps
    wall = sum(r["wall_s"] for r in records)
    return {**{f"{part}_s": value for part, value in total.items()}, "wall_s": wall,
            "goodput": total["step"] / wall if wall > 0 else 0.0,
            "attempts": len(records), "redone_steps": redone_steps}


def failures(records: list[dict]) -> list[dict]:
    """Each attempt that ended short of done and was followed by another: the step it ended
    after, how long the restart took (the gap between the attempts, then the next one's start-up
    and compile, to its first step) and the steps the next one trained again."""
    out = []
    for record, following in zip(records, records[1:]):
        if record["outcome"] == "done" or following["resumed_from"] is None:
            continue
        gap = max(following["started"] - (record["started"] + record["wall_s"]), 0.0)
        seconds = following["seconds"]
        restart = gap + seconds["startup"] + seconds["compile"]
        _, steps = _redone(record, following["resumed_from"])
        out.append({"outcome": record["outcome"], "last_step": record["last_step"],
                    "resumed_from": following["resumed_from"], "restart_s": restart,
                    "gap_s": gap, "redone_steps": steps})
    return out


def stragglers(records: list[dict]) -> dict[str, int]:
    """Host -> straggler reports that named it, over all attempts."""
    named: dict[str, int] = {}
    for record in records:
        for host, count in record.get("stragglers", {}).items():
            named[host] = named.get(host, 0) + count
    return named


def format_summary(summary: dict[str, float]) -> str:
    """Two lines for the end of an attempt: goodput, then each part's seconds and share."""
    wall = summary["wall_s"] or 1.0
    attempts = int(summary["attempts"])
    parts = []
    for part in PARTS:
        seconds = summary[f"{part}_s"]
        if part == "profile" and not seconds:
            continue
        steps = f", {int(summary['redone_steps'])} steps" if part == "redone" else ""
        parts.append(f"{part} {seconds:.1f} s ({100 * seconds / wall:.1f}%{steps})")
    return (f"goodput {100 * summary['goodput']:.1f}%: training steps over {summary['wall_s']:.1f} "
            f"s of wall time in {attempts} attempt{'s' if attempts != 1 else ''} "
            f"({FILE})\n  " + " | ".join(parts))


def format_failures(records: list[dict]) -> list[str]:
    """A line per failure (failures()) and one naming the stragglers, if any."""
    lines = [f"failure after step {f['last_step']} ({f['outcome']}): restarted in "
             f"{f['restart_s']:.1f} s ({f['gap_s']:.1f} s between the attempts, then start-up and "
             f"compile), from step {f['resumed_from']}: {f['redone_steps']} steps redone"
             for f in failures(records)]
    if named := stragglers(records):
        lines.append("stragglers named: " + ", ".join(f"{host} ({count}x)"
                                                       for host, count in named.items()))
    return lines
