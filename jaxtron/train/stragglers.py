"""Stragglers: the host that holds every step back, named.

In one SPMD program every process waits for the slowest at each collective, so step times are
the same everywhere; what differs is where a host's time goes, and how fast its devices are on
their own. Each process measures two things: its wait for its next batch each step (its input
pipeline, its disk, its CPU; the others spend that time waiting for it inside the step), and,
at each report, a device probe: a fixed matmul timed on each of its devices alone, after the
step's work is done (a slow or throttled GPU). Every run.straggler_every steps the processes
gather them (a collective); a host's figures are its slowest process's. A host whose input wait
exceeds the other hosts' median by more than run.straggler_margin of a step, or whose probe
takes more than (1 + run.straggler_margin) times theirs, is named with its processes and devices
in the log, in TensorBoard (straggler/*) and in goodput.json; with run.on_straggler=stop the run
saves and exits 75 naming it, and the host goes into run.dir/bad_hosts for the restart to leave
out (scripts/slurm/train.sbatch).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxtron.config import RunConfig


@dataclass
class Verdict:
    """One report: the slowest host, by how much, and whether it is a straggler."""

    host: str
    processes: list[int]
    devices: list[int]
    wait_s: float  # its wait for input per step
    median_wait_s: float  # the median of the other hosts'
    probe: float  # its device probe's time over the other hosts' median (0: no probe, CPUs)
    step_s: float  # the wall time of a step over the interval
    first: int
    last: int
    named: bool

    @property
    def excess_s(self) -> float:
        return self.wait_s - self.median_wait_s

    def line(self) -> str:
        devices = ", ".join(map(str, self.devices))
        which = "process" if len(self.processes) == 1 else "processes"
        probe = (f", and ran the device probe in {self.probe:.2f}x the time of the other hosts' "
                 "median" if self.probe else "")
        return (f"straggler: host {self.host} ({which} {', '.join(map(str, self.processes))}; "
                f"devices {devices}) waited {self.wait_s:.3f} s of each {self.step_s:.3f} s step "
                f"for its input, {self.excess_s:.3f} s more than the other hosts' median"
                f"{probe}, steps {self.first}-{self.last}")


@dataclass
class Stragglers:
    """This process's input wait since the last report, and the reports."""

    every: int
    margin: float
    nodes: tuple[str, ...]  # each process's host
    probe: Callable[[], float]
    wait_s: float = 0.0
    steps: int = 0
    since: float = field(default_factory=time.perf_counter)
    first: int = 0

    @classmethod
    def of(cls, run: RunConfig, nodes: tuple[str, ...], start: int) -> Stragglers | None:
        """None when off or on a single host (nobody to compare with)."""
        if not run.straggler_every or len(set(nodes)) < 2:
            return None
        return cls(run.straggler_every, run.straggler_margin, nodes, device_probe(),
                   first=start + 1)

    def add(self, wait_s: float) -> None:
        self.wait_s += wait_s
        self.steps += 1

    def due(self, step: int) -> bool:
        return self.steps > 0 and step % self.every == 0

    def report(self, step: int, done: object) -> Verdict:
        """Probe the devices once `done` (the last step's output) is ready, gather every
        process's figures (a collective) and judge the hosts; starts a new interval."""
        from jaxtron.train.distributed import allgather_text

        now = time.perf_counter()
        step_s = (now - self.since) / self.steps
        jax.block_until_ready(done)
        mine = f"{self.wait_s / self.steps:.6f} {self.probe():.6f}"
        figures = [tuple(map(float, text.split())) for text in allgather_text(mine)]
        verdict = judge([f[0] for f in figures], [f[1] for f in figures], self.nodes, step_s,
                        self.margin, self.first, step)
        self.wait_s, self.steps, self.since, self.first = 0.0, 0, time.perf_counter(), step + 1
        return verdict


def device_probe() -> Callable[[], float]:
    """A timer of this process's GPUs alone: the slowest one's seconds for a fixed chain of
    matmuls (bf16 4096^2 x 8: about 1 ms on an H100), run twice and the second timed. On CPUs it
    gives 0: their devices share the cores with the input, so it would time the host's load."""
    local = jax.local_devices()
    if local[0].platform != "gpu":
        return lambda: 0.0
    n, dtype, repeats = 4096, jnp.bfloat16, 8

    @jax.jit
    def chain(x):
        return jax.lax.fori_loop(0, repeats, lambda _, y: (y @ x) * (1.0 / n), x)

    inputs = [jax.device_put(np.full((n, n), 1.0, dtype), d) for d in local]

    def probe() -> float:
        slowest = 0.0
        for device, x in zip(local, inputs):
            with jax.set_mesh(Mesh(np.array([device]), ("probe",))):  # not the run's mesh
                chain(x).block_until_ready()
                start = time.perf_counter()
                chain(x).block_until_ready()
                slowest = max(slowest, time.perf_counter() - start)
        return slowest

    return probe


def judge(waits: list[float], probes: list[float], nodes: tuple[str, ...], step_s: float,
          margin: float, first: int, last: int) -> Verdict:
    """The slowest host against the median of the others (a host's figures are its slowest
    process's; with two hosts, the other one): its input wait's excess as a share of a step, or
    its probe's time over theirs, less one; named above `margin`."""
    wait: dict[str, float] = {}
    probe: dict[str, float] = {}
    for node, w, p in zip(nodes, waits, probes):
        wait[node], probe[node] = max(wait.get(node, 0.0), w), max(probe.get(node, 0.0), p)

    def others(figures: dict[str, float], host: str) -> float:
        return statistics.median(v for h, v in figures.items() if h != host)

    def ratio(host: str) -> float:
        return probe[host] / others(probe, host) if others(probe, host) > 0 else 0.0

    def score(host: str) -> float:
        return max((wait[host] - others(wait, host)) / step_s, ratio(host) - 1.0)

    slowest = max(wait, key=score)
    processes = [i for i, node in enumerate(nodes) if node == slowest]
    devices = sorted(d.id for d in jax.devices() if d.process_index in processes)
    return Verdict(slowest, processes, devices, wait[slowest], others(wait, slowest),
                   ratio(slowest), step_s, first, last, score(slowest) > margin)
