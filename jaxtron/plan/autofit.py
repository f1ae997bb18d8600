"""`model.remat=auto` and `train.microbatches=auto`: the least recompute, then the fewest
microbatches, whose estimated peak leaves SPARE of the device's usable memory free.

Recompute costs FLOPs on every step (remat=full adds a third to the matmuls of the layers);
microbatches cost little more than their share of collective latency and smaller matmuls, so
recompute is the first thing to avoid. The policies are tried from the least recompute to the
most (POLICIES), each with the fewest microbatches first; the first pair whose estimate
(jaxtron.plan.memory: what `--dry-run` prints, held within 15% of compiled peaks) fits in
(1 - SPARE) x usable wins. With a pipeline (mesh.stage > 1) the microbatch count is no free
choice (it sets the bubble), so `train.microbatches=auto` asks for a number there. When nothing
fits, the pair with the smallest estimate is taken and the line says so (the dry run's verdict
then says what to change).

The usable memory is the target's: `--compile-for`'s GPU, `--dry-run --gpu`'s, or the run's own
devices (a GPU's allocator limit; CPU devices share this machine's available memory).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Callable

from jaxtron.config import Config, ConfigError

AUTO = "auto"  # model.remat
AUTO_MICROBATCHES = 0  # train.microbatches: `auto` in a preset or an override is read as 0
SPARE = 0.10  # the share of usable memory the choice leaves free (estimate error, fragmentation)
# From the least recompute to the most (jaxtron/plan/costs.py RECOMPUTED: what each recomputes). The
# offloading policy is left to those who ask for it: it needs pinned host memory and PCIe time.
POLICIES = ("none", "save_dots", "save_qkv_out", "save_attn_out", "full")


def is_auto(cfg: Config) -> bool:
    return cfg.model.remat == AUTO or cfg.train.microbatches == AUTO_MICROBATCHES


def _counts(cfg: Config, ways: int) -> list[int]:
    """Microbatch counts to try, fewest first: each a divisor of the rows per data replica."""
    if cfg.train.microbatches != AUTO_MICROBATCHES:
        return [cfg.train.microbatches]
    rows = cfg.train.batch_size // ways if cfg.train.batch_size % ways == 0 else 1
    return [m for m in range(1, rows + 1) if rows % m == 0]


def _with(cfg: Config, remat: str, microbatches: int) -> Config:
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat=remat),
                               train=dataclasses.replace(cfg.train, microbatches=microbatches))


def candidates(cfg: Config, num_devices: int) -> list[tuple[str, int, int]]:
    """(remat, microbatches, estimated peak bytes) of every pair the config's checks accept, in
    the order of preference."""
    from jaxtron import parallel
    from jaxtron.plan import memory
    from jaxtron.step.optim import make_optimizer
    from jaxtron.step.state import make_plan

    if cfg.train.microbatches == AUTO_MICROBATCHES and cfg.mesh.stage > 1:
        raise ConfigError("train.microbatches=auto is for runs without a pipeline; with "
                          f"mesh.stage={cfg.mesh.stage} give a number (at least 4 x the stages "
                          "keeps the bubble under a fifth of the step)")
    remats = POLICIES if cfg.model.remat == AUTO else (cfg.model.remat,)
    sizes = parallel.mesh_shape(cfg.mesh, num_devices)
    ways = sizes.get("data", 1) * sizes.get("fsdp", 1)
    tx = make_optimizer(cfg)
    out = []
    for remat in remats:
        for count in _counts(cfg, ways):
            candidate = _with(cfg, remat, count)
            try:
                plan = make_plan(candidate, tx, num_devices)
            except ConfigError:
                continue
            out.append((remat, count, sum(memory.estimate(candidate, plan).values())))
    if not out:  # no count splits the batch: the plan's own error says what to change
        make_plan(_with(cfg, remats[0], 1), tx, num_devices)
    return out


def resolve(cfg: Config, num_devices: int, usable: int | None, where: str) -> tuple[Config, str]:
    """cfg with `auto` replaced by the choice, and one line saying what was chosen and why.
    `usable`: bytes jax may allocate per device on `where` (None: unknown; then the estimate
    alone cannot choose, and the least-memory pair is taken)."""
    if not is_auto(cfg):
        return cfg, ""
    found = candidates(cfg, num_devices)
    budget = int(usable * (1 - SPARE)) if usable else 0
    fits = [c for c in found if c[2] <= budget]
    remat, count, peak = fits[0] if fits else min(found, key=lambda c: c[2])
    chosen = _with(cfg, remat, count)
    said = " and ".join(f"{key}={value}" for key, value, auto in (
        ("model.remat", remat, cfg.model.remat == AUTO),
        ("train.microbatches", count, cfg.train.microbatches == AUTO_MICROBATCHES)) if auto)
    gib = lambda n: f"{n / 2**30:.1f} GiB"
    if not usable:
        return chosen, (f"auto: {said}, the least memory ({gib(peak)} per device estimated); "
                        f"no memory limit is known for {where}")
    if not fits:
        return chosen, (f"auto: {said}, the least memory, and still {gib(peak)} per device "
                        f"estimated against {gib(usable)} usable on {where}: nothing fits")
    lighter = [c for c in found if cfg.model.remat == AUTO
               and POLICIES.index(c[0]) < POLICIES.index(remat)]
    why = (f"; less recompute needs {gib(min(c[2] for c in lighter))} at the least"
           if lighter else "")
    return chosen, (f"auto: {said}: {gib(peak)} per device estimated, {1 - peak / usable:.0%} of "
                    f"the {gib(usable)} usable on {where} free (at least {SPARE:.0%} kept){why}")


def usable_here(devices: list) -> tuple[int | None, str]:
    """(bytes jax may allocate per device, in words where) on the run's own devices: a GPU's
    allocator limit, the same on every process of the run (so that all choose alike); None on
    CPU devices (they share what the machine has free, which differs between processes)."""
    import jax

    device = next((d for d in devices if d.process_index == jax.process_index()), devices[0])
    if device.platform == "cpu":
        return None, "CPU devices"
    return (device.memory_stats() or {}).get("bytes_limit"), f"this {device.device_kind}"


# XLA's rematerialization cannot make a program that is far over the memory fit (llama3_8b with
# remat=none on 8 H100s: 86.8 GiB after it recomputed a third of the matmuls, 91.9 without): it
# only hides what the program as written needs. Such a program compiles with no limit, so that
# the report shows that need and the matmuls the policy implies.
NO_LIMIT = {"xla_gpu_memory_limit_slop_factor": 10000}
# Around gradient accumulation (a loop over microbatches around the layers' loops) XLA's
# pipelined all-gather (the gpu preset's, for the layers' FSDP gathers) kept about one more
# microbatch's saved activations alive and hid less: llama3_1b, 8 H100s, seq 4096, remat=none, 2
# microbatches: 25.0 GiB with it, 16.2 without (one microbatch: 15.4); llama2_7b as shipped: 85.4
# GiB (53.2 after XLA's rematerialization, 7% more matmuls) and 309 GiB of exposed fsdp traffic
# with it, 54.8 GiB and 165 GiB without. Without accumulation it pays (llama3_8b, full, one
# sequence per GPU: 6.2 GiB exposed with it, 8.8 without), so it is switched off only there.
# jax 0.11's XLA has no such compile option (its pipelining is an enum, and the same 1B program
# compiles to 16.2 GiB there with the preset's flags): compile_with leaves it out.
NO_PIPELINED_GATHER = {"xla_gpu_enable_pipelined_all_gather": False}
_UNKNOWN = re.compile(r"No such compile option: '(\w+)'")


def compile_with(compile: Callable, options: dict):
    """compile(options), without the options this jaxlib does not know (XLA renames them)."""
    options = dict(options)
    while True:
        try:
            return compile(options or None)
        except Exception as e:  # noqa: BLE001 - jax's runtime error; any other is raised again
            unknown = _UNKNOWN.search(str(e))
            if not unknown or unknown.group(1) not in options:
                raise
            del options[unknown.group(1)]


def compiler_options(cfg: Config, plan, usable: int | None, platform: str) -> dict:
    """XLA options for compiling cfg's step on `platform`: NO_PIPELINED_GATHER around gradient
    accumulation, NO_LIMIT when the estimate is over `usable`."""
    from jaxtron.plan import memory

    if platform != "gpu":
        return {}
    options = {}
    if plan.accumulation > 1 and not plan.pipe:
        options.update(NO_PIPELINED_GATHER)
    if usable and sum(memory.estimate(cfg, plan).values()) > usable:
        options.update(NO_LIMIT)
    return options

def layout_need(cfg: Config, num_devices: int, usable: int | None):
    """For parallel.describe_hosts: need(mesh) is None when cfg on that mesh fits `usable` with
    some remat policy and microbatch count, else what it needs at the least, in words."""
    from jaxtron.config import MeshConfig

    def need(mesh: dict[str, int]) -> str | None:
        free = {} if cfg.mesh.stage > 1 else {"microbatches": AUTO_MICROBATCHES}
        other = dataclasses.replace(
            cfg, mesh=MeshConfig(**mesh), model=dataclasses.replace(cfg.model, remat=AUTO),
            train=dataclasses.replace(cfg.train, **free))
        try:
            least = min(peak for _, _, peak in candidates(other, num_devices))
        except (ConfigError, ValueError):
            return None  # not a layout this check can judge: the plain advice stands
        if least <= usable:
            return None
        return (f"needs {least / 2**30:.1f} GiB per GPU at the least, over the "
                f"{usable / 2**30:.1f} GiB usable")

    return need if usable else None
