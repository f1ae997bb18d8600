"""Compile the real train step for a GPU cluster that is not here, and report what it would run.

XLA compiles for GPUs it cannot see: `jax.experimental.topologies` gives compile-only devices of a
`GpuTargetConfig` (jaxtron/program/targets/*.txtpb: the device's SMs, memory, cuDNN and CUDA
versions), arranged as hosts x GPUs. The plan, state and batch shardings and the jitted step are
the ones `train()` builds; `.lower().compile()` runs XLA's whole GPU pipeline (SPMD partitioning,
fusion, the latency-hiding scheduler, cuDNN and Triton kernel choices, buffer assignment) with the
XLA flags a GPU host would get. Nothing is autotuned and nothing runs; the result is the optimized
HLO and its memory analysis, read by `jaxtron.program.hlo`.

Needs the CUDA plugin (`pip install -e '.[gpu-aot]'`: jax-cuda12-plugin and cuDNN) and
JAX_PLATFORMS=cpu, so that jax starts no CUDA runtime; `jaxtron train --compile-for` sets both up.
"""

from __future__ import annotations

import dataclasses
import math
import os
import time
from pathlib import Path

import jax

from jaxtron import parallel
from jaxtron.cli import plural
from jaxtron.config import Config, ConfigError
from jaxtron.model import windows
from jaxtron.ops import attention, experts
from jaxtron.parallel import one_f_one_b, pipeline
from jaxtron.plan import autofit, costs, memory
from jaxtron.plan.setup import Setup, set_up
from jaxtron.program import flops, hlo, xla_flags

TARGET_DIR = Path(__file__).resolve().parent / "targets"
TARGETS = {"h100": "h100_sxm.txtpb", "h200": "h200_sxm.txtpb"}
INSTALL = "pip install -e '.[gpu-aot]'"  # the extra that brings the CUDA plugin and cuDNN
PLUGINS = ("jax_plugins.xla_cuda12", "jax_cuda12_plugin", "jax_plugins.xla_cuda13")
DEFAULT_MEM_FRACTION = 0.75  # jax's GPU client preallocates this share unless told otherwise


def target_config(target: str) -> str:
    """The GpuTargetConfig text of a supported target."""
    if target not in TARGETS:
        raise ConfigError(f"--compile-for {target}: unknown target; "
                          f"use one of {', '.join(TARGETS)}")
    return (TARGET_DIR / TARGETS[target]).read_text()


def check_target(target: str, num_devices: int, gpus_per_host: int,
                 option: str = "--compile-for") -> None:
    """A known target, the CUDA plugin installed, whole hosts: before anything compiles.
    `option` is the command's option that asked for the compile, as its messages name it."""
    target_config(target)
    from jaxtron.program import xla_flags

    if not any(map(xla_flags._installed, PLUGINS)):
        raise ConfigError(f"{option} needs jax's CUDA plugin, which is not installed: {INSTALL}")
    if num_devices < 1 or gpus_per_host < 1:
        raise ConfigError("--devices and --gpus-per-host must be at least 1")
    if num_devices % min(gpus_per_host, num_devices):
        raise ConfigError(f"--devices {num_devices} is not a whole number of hosts of "
                          f"--gpus-per-host {gpus_per_host}")


def target_devices(target: str, num_devices: int, gpus_per_host: int) -> list:
    """Compile-only devices of `target`: hosts x gpus_per_host of them, ids in host-major order
    (device i is GPU i % gpus_per_host of host i // gpus_per_host)."""
    check_target(target, num_devices, gpus_per_host)
    from jax.experimental import topologies

    per_host = min(gpus_per_host, num_devices)
    topology = f"1x{num_devices // per_host}x{per_host}"
    return list(topologies.get_topology_desc(platform="cuda", topology=topology,
                                             target_config=target_config(target)).devices)


def _field(target: str, name: str) -> str:
    """A top-level or gpu_device_info field of the target's config, as text."""
    for line in target_config(target).splitlines():
        key, _, value = line.strip().partition(":")
        if key == name:
            return value.strip().strip('"')
    raise ValueError(f"{TARGETS[target]} has no {name}")


def capacity_bytes(target: str) -> int:
    """The device's memory size, as its target config states it."""
    return int(_field(target, "device_memory_size"))


def target_device_kind(target: str) -> str:
    return _field(target, "device_description_str")


def usable_fraction(cfg: Config | None = None) -> float:
    """The share of GPU memory jax's allocator may use: XLA_PYTHON_CLIENT_MEM_FRACTION (or its
    new name XLA_CLIENT_MEM_FRACTION) when set, else what the run sets (xla.mem_fraction), else
    jax's default."""
    if env := xla_flags.env_mem_fraction():
        return env[1]
    return cfg.xla.mem_fraction if cfg is not None else DEFAULT_MEM_FRACTION


def compile_for(cfg: Config | Setup, target: str, num_devices: int, gpus_per_host: int = 8,
                hlo_path: str | None = None) -> dict:
    """Compile the train step for `num_devices` GPUs of `target` (of `cfg`, or of a Setup that
    set_up_for made); the report (see `report`)."""
    setup = cfg if isinstance(cfg, Setup) else set_up_for(cfg, target, num_devices)
    compiled, plan, seconds = compile_step_for(setup, target, num_devices, gpus_per_host)
    text = compiled.as_text()
    if hlo_path:
        Path(hlo_path).write_text(text)
    per_host = min(gpus_per_host, num_devices)
    return report(setup.cfg, plan, compiled.memory_analysis(), hlo.parse(text), target, seconds,
                  per_host)


def gpu_program(cfg: Config) -> tuple[Config, list[str]]:
    """Before any jax backend starts: the program a GPU host would compile. jax starts no CUDA
    runtime here (compile-only devices come from the plugin), and XLA gets the flags a GPU run
    sets (`xla.preset=auto` meaning the GPU preset). cfg with that preset, and the flags."""
    jax.config.update("jax_platforms", "cpu")  # read when the first backend starts: not yet
    if cfg.xla.preset == "auto":
        cfg = dataclasses.replace(cfg, xla=dataclasses.replace(cfg.xla, preset="gpu"))
    return cfg, xla_flags.apply(cfg.xla)


def for_gpus(cfg: Config) -> Config:
    """cfg as it runs on GPUs: `model.attention=auto` resolved (cudnn in 16-bit compute), and
    `model.moe.kernel=auto` (tokamax's Mosaic GPU kernel where it is installed)."""
    return experts.configure(attention.configure(cfg, "gpu"), "gpu")


def compile_step_for(cfg: Config | Setup, target: str, num_devices: int,
                     gpus_per_host: int = 8):
    """(compiled train step, plan, seconds): train()'s step, compiled for the target's devices
    (`model.attention=auto` meaning what it means on them: cudnn)."""
    setup = cfg if isinstance(cfg, Setup) else set_up_for(cfg, target, num_devices)
    mesh = parallel.make_mesh(setup.cfg.mesh, target_devices(target, num_devices, gpus_per_host))
    start = time.perf_counter()
    # the constraints on activations need the mesh, as in train(); tokamax and jax's cuDNN
    # attention lower their kernels for the target's GPUs, not this host's devices
    target_device = mesh.devices.flat[0]
    with (jax.set_mesh(mesh), experts.cross_compiling(target_device),
          attention.cross_compiling(target_device)):
        lowered = setup.lower(mesh)
        try:
            compiled = autofit.compile_with(lowered.compile, setup.options("gpu"))
        except jax.errors.JaxRuntimeError as e:
            raise ConfigError(compile_failure(str(e), target)) from None
    return compiled, setup.plan, time.perf_counter() - start


# A float32 matmul inside a loop XLA double-buffers: its cloned Triton fusion has no block
# config here (nothing is autotuned), seen with mesh.data=8 train.microbatches=2 on tiny.
DOUBLE_BUFFERING = "--xla_gpu_enable_while_loop_double_buffering=false"


def compile_failure(error: str, target: str) -> str:
    """One line for XLA's refusal to compile the step for `target`, with a way round it."""
    first = error.strip().splitlines()[0] if error.strip() else "no message"
    first = first if len(first) <= 200 else first[:197] + "..."
    hint = (f"; compile without loop double buffering: 'xla.flags=[{DOUBLE_BUFFERING}]'"
            if "double_buffer_clone" in error else
            "; try another layout (jaxtron plan ranks them), or xla.preset=none")
    return f"XLA could not compile this step for {target}: {first}{hint}"


def report(cfg: Config, plan, stats, module: hlo.Module, target: str, seconds: float,
           gpus_per_host: int) -> dict:
    """The compile report: memory per device (XLA's memory analysis) against the device and the
    dry run's estimate, model and compiled FLOPs, collectives, kernels, compile time."""
    num_devices = math.prod(plan.mesh_sizes.values())
    capacity = capacity_bytes(target)
    usable = int(capacity * usable_fraction(cfg))
    peak = (stats.argument_size_in_bytes + stats.output_size_in_bytes
            - stats.alias_size_in_bytes + stats.temp_size_in_bytes)
    estimate = memory.estimate(cfg, plan)
    tokens = cfg.train.batch_size * cfg.train.seq_len / num_devices  # per device
    pipe = pipeline.from_config(cfg, plan.mesh_sizes.get("stage", 1))
    ticks = one_f_one_b.Ticks.of(pipe) if pipe and pipe.explicit else None
    shares = ticks and ticks.shares()
    counted = flops.compiled(module, windows.shares(cfg.model), shares)
    # the experts' kernels: each pair of the expert group's buffer runs on one of its devices
    ragged = counted["ragged"] // plan.mesh_sizes.get("expert", 1)
    counted["matmul"] += ragged
    rows = hlo.collectives(module, plan.mesh_sizes, _hosts(cfg, target, num_devices, gpus_per_host),
                           shares)
    return {
        "target": target,
        "device_kind": target_device_kind(target),
        "devices": num_devices,
        "hosts": num_devices // gpus_per_host,
        "gpus_per_host": gpus_per_host,
        "mesh": plan.mesh_sizes,
        "remat": cfg.model.remat,
        "hosts_layout": parallel.describe_hosts(plan.mesh_sizes, gpus_per_host,
                                                autofit.layout_need(cfg, num_devices, usable)),
        "memory": {"argument_bytes": stats.argument_size_in_bytes,
                   "output_bytes": stats.output_size_in_bytes,
                   "temp_bytes": stats.temp_size_in_bytes,
                   "alias_bytes": stats.alias_size_in_bytes,
                   "peak_bytes": peak, "capacity_bytes": capacity, "usable_bytes": usable},
        "fits": peak <= usable,
        "plan_peak_bytes": sum(estimate.values()),
        "plan_terms": estimate,
        "flops": {"model_per_device": round(costs.flops_per_token(cfg.model, cfg.train.seq_len)
                                            * tokens),
                  "compiled_per_device": counted["matmul"] + counted["attention"],
                  "matmul_per_device": counted["matmul"],
                  "attention_per_device": counted["attention"],
                  "ragged_matmul_per_device": ragged,
                  "ragged_matmul_bound_per_device": counted["ragged"],
                  "fp8_matmul_per_device": counted["fp8"],
                  "fp8_e5m2_matmul_per_device": counted["fp8_e5m2"],
                  # the optimizer's (Muon's Newton-Schulz), not in matmul_per_device
                  "optimizer_matmul_per_device": counted["optimizer"],
                  "expected_matmul_per_device": costs.expected_matmul(
                      cfg, tokens, plan.mesh_sizes.get("expert", 1),
                      plan.mesh_sizes.get("tensor", 1)),
                  "six_n_tokens_per_device": round(6 * costs.matmul_params(cfg.model) * tokens)},
        "collectives": rows,
        "exposed_bytes_per_axis": exposed_bytes(rows),
        "kernels": hlo.kernels(module, shares),
        "compile_seconds": round(seconds, 2),
        "xla_flags": os.environ.get("XLA_FLAGS", "").split(),
    }


def exposed_bytes(rows: list[dict]) -> dict[str, int]:
    """Collective bytes per step per device with no matmul to hide behind, by mesh axes (joined
    by "+"): an async collective's bytes less its overlapped ones, a synchronous one's whole."""
    exposed: dict[str, int] = {}
    for row in rows:
        axes = _axes(row["axes"])
        hidden = row["overlapped_bytes"] if row["async"] else 0
        exposed[axes] = exposed.get(axes, 0) + row["bytes"] - hidden
    return exposed


def _axes(axes: list[str] | None) -> str:
    """A collective's mesh axes as the report names them: "fsdp", "data+fsdp", none, ?."""
    return "+".join(axes) if axes else ("none" if axes == [] else "?")


def _hosts(cfg: Config, target: str, num_devices: int, gpus_per_host: int) -> list[int]:
    """The host of each of the program's devices, in the order of the mesh it was compiled on
    (collectives name devices by their place in that order)."""
    mesh = parallel.make_mesh(cfg.mesh, target_devices(target, num_devices, gpus_per_host))
    return [d.process_index for d in mesh.devices.flat]


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n:.0f} B"


def format_report(report: dict) -> list[str]:
    """The report as lines for a terminal."""
    mem = report["memory"]
    shape = ", ".join(f"{a}={s}" for a, s in report["mesh"].items())
    lines = [(f"compiled for {report['devices']} x {report['device_kind']} "
              f"({plural(report['hosts'], 'host')} x {report['gpus_per_host']}), mesh {shape}, in "
              f"{report['compile_seconds']:.1f} s")]
    lines += report["hosts_layout"]
    over = mem["peak_bytes"] - mem["usable_bytes"]
    verdict = "fits" if report["fits"] else f"DOES NOT FIT, {_gib(over)} over"
    lines.append(f"memory per device: peak {_gib(mem['peak_bytes'])} of "
                 f"{_gib(mem['usable_bytes'])} "
                 f"usable ({_gib(mem['capacity_bytes'])} x XLA_PYTHON_CLIENT_MEM_FRACTION "
                 f"{mem['usable_bytes'] / mem['capacity_bytes']:.2f}): {verdict}")
    lines.append(f"  arguments {_gib(mem['argument_bytes'])}, outputs {_gib(mem['output_bytes'])}, "
                 f"aliased {_gib(mem['alias_bytes'])}, temporaries {_gib(mem['temp_bytes'])}")
    largest = sorted(report["plan_terms"].items(), key=lambda kv: -kv[1])[:3]
    lines.append(f"  dry-run estimate {_gib(report['plan_peak_bytes'])} "
                 f"({report['plan_peak_bytes'] / mem['peak_bytes'] - 1:+.1%} of the compiled "
                 "peak); largest terms: " + ", ".join(f"{k} {_gib(v)}" for k, v in largest))
    lines.append(_flops_line(report))
    lines.append("collectives per device per step (op over axes: executions, bytes; the part "
                 "with a matmul between its start and done):")
    for row in report["collectives"]:
        axes = _axes(row["axes"])
        mode = "async" if row["async"] else "sync"
        hosts = ", across hosts" if row["crosses_hosts"] else ""
        lines.append(f"  {row['op']:<18} over {axes:<16} {mode:<5} {row['count']:>6} x, "
                     f"{_bytes(row['bytes'])}; overlapped {row['overlapped']} x, "
                     f"{_bytes(row['overlapped_bytes'])}{hosts}")
    if not report["collectives"]:
        lines.append("  none")
    exposed = ", ".join(f"{axes} {_bytes(n)}"
                        for axes, n in report["exposed_bytes_per_axis"].items())
    lines.append(f"exposed collective bytes per device per step: {exposed or 'none'}")
    kernels = ", ".join(f"{name} {count}" for name, count in report["kernels"].items())
    lines.append(f"kernels per step: {kernels or 'none'}")
    return lines


def _flops_line(report: dict) -> str:
    """Compiled matmul FLOPs against the remat policy's and 6N's, and the attention kernels'."""
    counts = report["flops"]
    compiled, expected = counts["matmul_per_device"], counts["expected_matmul_per_device"]
    six_n = counts["six_n_tokens_per_device"]
    return (f"matmul flops per device per step: {compiled / 1e12:.1f} T compiled, "
            f"{expected / 1e12:.1f} T the policy ({report['remat']}) implies "
            f"({compiled / max(expected, 1):.2f}x), 6*N*tokens {six_n / 1e12:.1f} T "
            f"({compiled / max(six_n, 1):.2f}x); attention kernels "
            f"{counts['attention_per_device'] / 1e12:.1f} T{_fp8_part(counts)}"
            f"{_optimizer_part(counts)}")


def _optimizer_part(counts: dict) -> str:
    """The optimizer's matmul FLOPs (Muon's Newton-Schulz), as a share of the step's."""
    optimizer = counts.get("optimizer_matmul_per_device", 0)
    if not optimizer:
        return ""
    step = optimizer + counts["matmul_per_device"] + counts["attention_per_device"]
    return f"; optimizer (Newton-Schulz) {optimizer / 1e12:.1f} T ({optimizer / step:.2%} of all)"


def _fp8_part(counts: dict) -> str:
    """The matmul FLOPs FP8 GEMMs carry (model.fp8), and those against e5m2 gradients."""
    fp8 = counts.get("fp8_matmul_per_device", 0)
    if not fp8:
        return ""
    share = fp8 / max(counts["matmul_per_device"], 1)
    backward = counts.get("fp8_e5m2_matmul_per_device", 0) / fp8
    return f"; FP8 GEMMs {fp8 / 1e12:.1f} T ({share:.0%} of the matmul flops, {backward:.0%} " \
           "of them against e5m2 gradients)"


def usable_on(gpu: str | None, cfg: Config, devices: list) -> tuple[int | None, str]:
    """autofit.usable_here, or for one GPU of a target (`--gpu`, `--compile-for`): its memory
    times the share jax's allocator may take."""
    if not gpu:
        return autofit.usable_here(devices)
    return int(capacity_bytes(gpu) * usable_fraction(cfg)), f"one {gpu.upper()}"


def set_up_for(cfg: Config, target: str, num_devices: int) -> Setup:
    """The run's set-up (plan/setup.py) for `num_devices` GPUs of `target`: the program
    `--compile-for` compiles, with the attention kernel a GPU runs and `auto` fitted to one
    GPU's memory."""
    return set_up(cfg, num_devices, "gpu", usable_on(target, cfg, []))
