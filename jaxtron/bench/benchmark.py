"""Train-step benchmarks: one measurement of the real step, the checks only a GPU can make, and
the fixed suites of rows that jaxtron bench runs one process each.

A row's numbers are the compiled train step (the config's mesh, flags and attention kernel) on
random full-length documents, so the data pipeline is out of the measurement. tokens/s, TFLOP/s
per device and MFU follow jaxtron/plan/costs.py (model FLOPs only: remat does not inflate them);
the step time is the median over the timed steps, its spread (max - min) / median; the peak
memory is the device allocator's own `peak_bytes_in_use` (None where the device keeps no
statistics: CPUs); the attention kernel is read from the compiled program, not the config.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import re
import shutil
import statistics
import subprocess
import time

from jaxtron.config import Config, ConfigError

# The keys every row's JSON line has (a failed row: config and error, the rest null).
KEYS = ("config", "tokens_per_sec", "tflops_per_device", "mfu", "step_time", "step_time_spread",
        "peak_memory_bytes", "attention", "compile_s")
MEM_FRACTION_SLACK = 0.05  # the allocator's limit may sit this far from fraction x total memory


@dataclasses.dataclass(frozen=True)
class Row:
    """One benchmark: a preset file of jaxtron/configs/ and overrides; `minutes` is the expected
    wall time of its process on the suite's device, start-up and compile included."""

    name: str
    config: str
    overrides: tuple[str, ...]
    minutes: float


@dataclasses.dataclass(frozen=True)
class Suite:
    """Rows measured with the same timed and warm-up steps; the first also makes the checks.
    `one_gpu`: its rows are sized for one GPU, and run on the first visible one."""

    device: str
    steps: int
    warmup: int
    rows: tuple[Row, ...]
    one_gpu: bool = False


# Sized for one 80 GB H100 (xla.mem_fraction 0.9: 71.2 GiB usable) by compiling each row for it
# (`jaxtron train --compile-for h100 --devices 1`, peaks in docs/performance.md); the remat policy
# and one microbatch are the row's (what the presets leave to auto, jaxtron/plan/autofit.py, is
# fixed so that a row is the same program on every card), every other setting is the preset's
# (dtype, optimizer). Batches give each step 8-64 k tokens, a second or so.
FIXED = ("train.microbatches=1",)
SUITES = {
    # In the order of what each proves, for a GPU window that may end early: a dense Llama row
    # first (with --peer, the comparison with MaxText), then the 8B and its FP8 gain.
    "gpu": Suite("one NVIDIA H100 80 GB (or H200)", steps=10, warmup=3, rows=(
        Row("llama3_1b seq 4096", "llama3_1b.yaml",
            ("train.batch_size=16", "train.seq_len=4096", *FIXED, "model.remat=full"), 1.5),
        Row("llama3_8b 16 layers seq 8192", "llama3_8b.yaml",  # half of it: 67.6 GiB of 71.2
            ("model.num_layers=16", "train.batch_size=1", "train.seq_len=8192", *FIXED,
             "model.remat=full"), 1.5),
        # the row above with FP8 projections (model.fp8), its MFU against the row's the FP8 gain;
        # 14 layers: at 16, 77.0 GiB (FP8's temporaries on one GPU, docs/parallelism.md)
        Row("llama3_8b 14 layers seq 8192 fp8", "llama3_8b.yaml",
            ("model.num_layers=14", "train.batch_size=1", "train.seq_len=8192", *FIXED,
             "model.remat=full", "model.fp8=tensorwise"), 1.5),
        Row("llama3_1b seq 8192", "llama3_1b.yaml",
            ("train.batch_size=8", "train.seq_len=8192", *FIXED, "model.remat=full"), 1.5),
        Row("gpt2_124m seq 1024", "gpt2_124m.yaml",
            ("train.batch_size=64", "train.seq_len=1024", *FIXED, "model.remat=none"), 1.0),
    ), one_gpu=True),
    # The same harness on this machine's CPU devices, in seconds: what CI runs.
    "smoke": Suite("the local CPU devices", steps=3, warmup=1, rows=(
        Row("tiny seq 128", "tiny.yaml", ("train.batch_size=8", "train.seq_len=128"), 0.3),
        Row("tiny remat=full seq 256", "tiny.yaml",
            ("train.batch_size=8", "train.seq_len=256", "model.remat=full",
             "model.num_layers=2"), 0.3),
    )),
}


def random_batch(cfg: Config, mesh):
    """One global batch of random tokens, one document per row, sharded like real input."""
    import jax
    import numpy as np

    from jaxtron import parallel
    from jaxtron.step import BATCH_KEYS

    b, t = cfg.train.batch_size, cfg.train.seq_len
    tokens = np.random.default_rng(0).integers(0, cfg.model.vocab_size, (b, t + 1), np.int32)
    local = {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
             "segment_ids": np.ones((b, t), np.int32),
             "positions": np.broadcast_to(np.arange(t, dtype=np.int32), (b, t))}
    sharding = jax.sharding.NamedSharding(mesh, parallel.batch_spec())
    return {k: jax.device_put(local[k], sharding) for k in BATCH_KEYS}


def measure(cfg: Config, steps: int, warmup: int, checks: bool = False) -> dict:
    """Compile and time `cfg`'s train step on the local devices (after the GPU checks when
    `checks`); the row's numbers (KEYS) and the settings that move them."""
    import jax

    from jaxtron import parallel
    from jaxtron.plan import autofit, costs, memory
    from jaxtron.plan.setup import set_up
    from jaxtron.program import hlo, xla_flags
    from jaxtron.step.state import init_state

    devices = xla_flags.start_backend()  # one that cannot start here: one line, not a trace
    setup = set_up(cfg, len(devices), devices[0].platform, autofit.usable_here(devices))
    cfg, tx, plan = setup.cfg, setup.tx, setup.plan  # as train() sets it up
    memory.check_host(plan, devices, cfg)  # one line, not the out-of-memory killer
    found = gpu_checks(cfg, devices) if checks else None
    mesh = parallel.make_mesh(cfg.mesh, devices)
    with jax.set_mesh(mesh):
        state = init_state(cfg, plan, tx, mesh)
        batch = random_batch(cfg, mesh)
        start = time.perf_counter()
        step = autofit.compile_with(setup.lower(mesh, state, batch).compile,
                                    setup.options(devices[0].platform))  # train()'s options
        compile_s = time.perf_counter() - start
        compiled = step.memory_analysis()
        fmha = {name: n for name, n in hlo.kernels(hlo.parse(step.as_text())).items()
                if "fmha" in name}
        times = []
        for i in range(warmup + steps):
            start = time.perf_counter()
            state, out = step(state, batch)
            loss = float(out["loss"])  # waits for the step
            if i >= warmup:
                times.append(time.perf_counter() - start)
    step_time = statistics.median(times)
    cost = costs.StepCost.of(cfg, devices)
    row = costs.make_row(steps, {"loss": loss, "lr": 0.0, "grad_norm": 0.0}, step_time, cost,
                           (warmup + steps) * cost.tokens)
    stats = devices[0].memory_stats() or {}
    return {
        "tokens_per_sec": row["tokens_per_sec"], "tflops_per_device": row["tflops_per_device"],
        "mfu": row["mfu"], "mfu_fp8": row["mfu_fp8"], "fp8": cfg.model.fp8,
        "step_time": step_time,
        "step_time_spread": (max(times) - min(times)) / step_time,
        "step_time_min": min(times), "step_time_max": max(times),
        "peak_memory_bytes": stats.get("peak_bytes_in_use"),
        "attention": "cudnn" if fmha else "xla", "attention_kernels": fmha,
        "compile_s": compile_s, "loss": loss,
        "device": devices[0].device_kind, "devices": len(devices), "mesh": plan.mesh_sizes,
        "params": plan.num_params, "batch": cfg.train.batch_size, "seq_len": cfg.train.seq_len,
        "microbatches": cfg.train.microbatches, "remat": cfg.model.remat,
        "dtype": cfg.model.dtype, "bubble": plan.pipe.bubble if plan.pipe else 0.0,
        "steps": steps, "warmup": warmup,
        "argument_bytes": compiled.argument_size_in_bytes,
        "temp_bytes": compiled.temp_size_in_bytes, "versions": versions(),
        **({"checks": found} if checks else {}),
    }


def gpu_checks(cfg: Config, devices: list) -> dict[str, str]:
    """What only a GPU shows, each as a verdict line starting `passed`, `FAILED` or `not
    checked`: the attention kernel against the XLA reference on a packed batch (forward and
    gradients), the XLA flag preset taken by the GPU backend, and the memory fraction in effect
    (the allocator's limit against the device's total memory)."""
    import os

    from jaxtron.model import head_sizes
    from jaxtron.ops import attention
    from jaxtron.program import aot, xla_flags

    if devices[0].platform != "gpu":
        skip = f"not checked: {devices[0].platform} devices, no GPU"
        return {"attention": skip, "xla_flags": skip, "mem_fraction": skip}
    found = {}
    if cfg.model.attention == "xla":
        found["attention"] = "not checked: model.attention=xla"
    else:
        try:
            errors = attention.self_check(cfg.model.attention, sizes=head_sizes(cfg.model),
                                          window=cfg.model.sliding_window)
            found["attention"] = (f"passed: {cfg.model.attention} vs xla on a packed batch, "
                                  "relative error " + ", ".join(f"{k} {v:.1e}"
                                                                for k, v in errors.items()))
        except ConfigError as e:
            found["attention"] = f"FAILED: {e}"
    preset = xla_flags.resolve_preset(cfg.xla.preset)
    wanted = set(xla_flags.XLA_PRESETS[preset])
    running = set(os.environ.get("XLA_FLAGS", "").split())
    missing = wanted - running
    found["xla_flags"] = (f"FAILED: {len(missing)} of preset {preset}'s flags not in XLA_FLAGS: "
                          f"{' '.join(sorted(missing))}" if missing else
                          f"passed: the GPU backend started with preset {preset}'s "
                          f"{len(wanted)} flags ({len(running)} in XLA_FLAGS)")
    limit = (devices[0].memory_stats() or {}).get("bytes_limit")
    total = total_memory(devices[0])
    fraction = aot.usable_fraction(cfg)
    if not limit or not total:
        found["mem_fraction"] = "not checked: the device reports no allocator limit or total"
    else:
        share = limit / total
        verdict = "passed" if abs(share - fraction) <= MEM_FRACTION_SLACK else "FAILED"
        found["mem_fraction"] = (f"{verdict}: allocator limit {limit / 2**30:.2f} GiB = "
                                 f"{share:.3f} of {total / 2**30:.2f} GiB, asked {fraction}")
    return found


def total_memory(device) -> int | None:
    """The GPU's memory in bytes: nvidia-smi's figure, else the target table's for its kind."""
    from jaxtron.program import aot

    if shutil.which("nvidia-smi"):
        index = str(getattr(device, "local_hardware_id", None) or 0)
        proc = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,"
                               "nounits", "-i", index], capture_output=True, text=True)
        if proc.returncode == 0 and proc.stdout.strip().isdigit():
            return int(proc.stdout.strip()) * 2**20
    for target in aot.TARGETS:
        if target in device.device_kind.lower():
            return aot.capacity_bytes(target)
    return None


def versions() -> dict[str, str]:
    """The installed versions that move the numbers."""
    found = {}
    for package in ("jax", "jaxlib", "flax", "jax-cuda13-plugin", "jax-cuda12-plugin",
                    "nvidia-cudnn-cu12", "nvidia-cudnn-cu13"):
        try:
            found[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            pass
    return found


def failure(row: Row, returncode: int | None, stderr: str, timeout_s: float = 0) -> str:
    """One line saying why a row's process produced no numbers."""
    if returncode is None:
        return f"timed out after {timeout_s:.0f} s"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    errors = [line for line in lines if re.match(r"^[\w.]*(Error|Exception)\b", line)
              or ": error: " in line]  # a traceback's exception line, or the tool's own
    last = (errors or lines)[-1] if lines else f"exit status {returncode}"
    if any(s in stderr for s in ("RESOURCE_EXHAUSTED", "Out of memory", "out of memory")):
        detail = next((line for line in lines if "RESOURCE_EXHAUSTED" in line
                       or "ut of memory" in line), last)
        return f"out of memory: {detail[:300]}"
    return last[:300]


def markdown(rows: list[dict], peer: bool) -> list[str]:
    """The rows as a markdown table: header, rule, one line per row."""
    head = ["row", "batch x seq", "tokens/s", "TFLOP/s per device", "MFU",
            "step time (median, spread)", "peak memory", "attention", "compile"]
    if peer:
        head += ["peer tokens/s", "jaxtron / peer"]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    return lines + [markdown_row(row, peer) for row in rows]


def _fp8_mfu(row: dict) -> str:
    """A model.fp8 row's MFU against the FP8 peak, beside the BF16 one."""
    return "" if row.get("mfu_fp8") is None else f" ({row['mfu_fp8']:.1%} of FP8)"


def markdown_row(row: dict, peer: bool) -> str:
    """One row of the markdown table; a failed row says why in its tokens/s cell."""
    if row.get("error"):
        cells = [row["config"], "", f"FAILED: {row['error']}", "", "", "", "", "", ""]
    else:
        peak = row.get("peak_memory_bytes")
        mfu = row.get("mfu")
        cells = [row["config"], f"{row['batch']} x {row['seq_len']}",
                 f"{row['tokens_per_sec']:,.0f}", _figure(row["tflops_per_device"]),
                 "n/a" if mfu is None else f"{mfu:.1%}" + _fp8_mfu(row),
                 f"{row['step_time'] * 1000:.1f} ms, {row['step_time_spread']:.1%}",
                 "n/a" if peak is None else f"{peak / 2**30:.2f} GiB", row["attention"],
                 f"{row['compile_s']:.1f} s"]
    if peer:
        found = row.get("peer") or {}
        if found.get("error"):
            cells += [f"not run: {found['error']}", ""]
        elif found:
            ratio = row.get("peer_ratio")
            cells += [f"{found['tokens_per_sec']:,.0f}",
                      "" if ratio is None else f"{ratio:.2f}x"]
        else:
            cells += ["", ""]
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"


def summary(rows: list[dict], suite: Suite, command: str) -> list[str]:
    """Lines under the table: the device, versions, steps, date and command, and the checks."""
    measured = next((row for row in rows if not row.get("error")), {})
    lines = [f"device: {measured.get('device', 'unknown')} x {measured.get('devices', '?')}; "
             + ", ".join(f"{k} {v}" for k, v in measured.get("versions", versions()).items()),
             f"each row: {suite.warmup} warm-up + {suite.steps} timed steps on random "
             f"full-length documents; {datetime.date.today().isoformat()}; `{command}`"]
    for row in rows:
        for name, verdict in (row.get("checks") or {}).items():
            lines.append(f"check {name}: {verdict}")
        peer = row.get("peer") or {}
        if peer.get("settings"):
            lines.append(f"peer for {row['config']}: {peer.get('peer')} "
                         + " ".join(f"{k}={v}" for k, v in peer["settings"].items()))
    return lines


def _figure(x: float) -> str:
    """412.3, 3.1, 0.00123: one decimal from 1 up, three significant figures below."""
    return f"{x:.1f}" if x >= 1 else f"{x:.3g}"
