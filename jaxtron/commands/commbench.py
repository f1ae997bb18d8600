"""Collective bandwidth over each mesh axis: all-gather, reduce-scatter, all-reduce, ring permute.

    jaxtron commbench mesh.fsdp=8                                  # one 8-GPU node
    jaxtron commbench mesh.fsdp=8 mesh.data=2 --sizes 1MiB..1GiB --json cb.json --plot cb.png
    jaxtron commbench --config llama3_8b --axes fsdp,tensor --iters 50
    srun --ntasks-per-node=8 jaxtron commbench mesh.fsdp=8 mesh.data=-1   # many hosts

The mesh is the one training builds (`parallel.make_mesh` from --config and `mesh.*` overrides), so
each axis measures the links its traffic really takes: inner axes (tensor, fsdp) get neighbouring
devices (NVLink within a node), outer ones (data, stage) may cross hosts (InfiniBand); the `hosts`
column says how many processes one group of the axis spans. Every group of an axis runs its
collective at once (all data replicas gather over fsdp together, as in training). Axes of size 1
are skipped. Each (op, axis, size) is one jitted `jax.shard_map`, run --warmup times, then --iters
times back to back; `time` is the mean of those (dispatch included, so small sizes read low).

The numbers follow nccl-tests (github.com/NVIDIA/nccl-tests, doc/PERFORMANCE.md), so rows compare
with its `*_perf -b 1M -e 1G -f 2` output column for column. `size` is nccl-tests' size: the
buffer each device holds after an all-gather (it sends size/n), before a reduce-scatter (it keeps
size/n), in and out of an all-reduce, and what each device sends in a permute (sendrecv_perf).
algbw = size / time. busbw = algbw x (2(n-1)/n for all-reduce, (n-1)/n for all-gather and
reduce-scatter, 1 for permute): the bytes one device's busiest link carries per second in a ring,
so it is comparable across n and with a link's own speed. GB/s are 1e9 bytes per second.

Healthy large-message busbw to expect: over NVLink 4 within an H100 node (~450 GB/s per direction
per GPU, NVSwitch) nccl-tests all-reduce reaches ~350-480 GB/s (NVLS), all-gather and
reduce-scatter ~350-370 GB/s; across nodes, over InfiniBand NDR (400 Gb/s = 50 GB/s per NIC, one
per GPU), ~40-48 GB/s per GPU. Much lower plateaus mean a wrong mesh order, a NIC or NVLink fault,
or NCCL not using the fabric; docs/commbench.md has the details and sources.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

from jaxtron import cli
from jaxtron.config import ConfigError
from jaxtron.lifecycle import one_line_errors

OPS = ("all_reduce", "all_gather", "reduce_scatter", "permute")
UNITS = {"": 1, "b": 1, "k": 2**10, "kib": 2**10, "m": 2**20, "mib": 2**20, "g": 2**30,
         "gib": 2**30, "kb": 10**3, "mb": 10**6, "gb": 10**9}  # K/M/G binary, as in nccl-tests
SIZE = re.compile(r"^\s*(\d+)\s*([a-z]*)\s*$", re.IGNORECASE)
DTYPES = ("float32", "bfloat16", "float16")


# ---------------------------------------------------------------- definitions
def bus_factor(op: str, n: int) -> float:
    """busbw / algbw for `op` over n devices (nccl-tests, doc/PERFORMANCE.md)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n  # a ring reduce-scatter, then a ring all-gather
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n  # each device moves all but its own 1/n of `size`
    if op == "permute":
        return 1.0  # point to point: every byte crosses one link once
    raise ValueError(f"unknown collective {op!r}")


def parse_size(text: str) -> int:
    """'4KiB' -> 4096, '1M' -> 1048576, '2MB' -> 2000000, '512' -> 512."""
    match = SIZE.match(text)
    if match is None or match.group(2).lower() not in UNITS:
        raise ConfigError(f"--sizes: '{text}' is not a size (e.g. 512, 64KiB, 1MiB, 1GiB)")
    return int(match.group(1)) * UNITS[match.group(2).lower()]


def parse_sizes(text: str) -> list[int]:
    """'1MiB..1GiB' (doubling), '4KiB,1MiB' (a list) or '64MiB' (one) -> bytes."""
    if ".." in text:
        first, last = (parse_size(part) for part in text.split("..", 1))
        if not 0 < first <= last:
            raise ConfigError(f"--sizes {text}: the range must run from a positive size upwards")
        return [first * 2**k for k in range((last // first).bit_length())]
    sizes = [parse_size(part) for part in text.split(",")]
    if 0 in sizes:
        raise ConfigError(f"--sizes {text}: sizes must be positive")
    return sizes


def human(num_bytes: int) -> str:
    """1536 -> '1.5 KiB', 1048576 -> '1 MiB'."""
    if num_bytes < 1024:
        return f"{num_bytes} B"
    power = min((num_bytes.bit_length() - 1) // 10, 3)
    return f"{num_bytes / 1024**power:.4g} {('KiB', 'MiB', 'GiB')[power - 1]}"


# ---------------------------------------------------------------- the collectives
def collective(op: str, mesh, axis: str):
    """The jitted collective over `axis`: a 1-D global array sharded over every mesh axis in,
    each device's result out (all other axes' groups run theirs at the same time)."""
    import jax
    from jax.sharding import PartitionSpec as P

    from jaxtron.parallel import MESH_AXES

    n = mesh.shape[axis]
    bodies = {
        "all_reduce": lambda x: jax.lax.psum(x, axis),
        "all_gather": lambda x: jax.lax.all_gather(x, axis, axis=0, tiled=True),
        "reduce_scatter": lambda x: jax.lax.psum_scatter(x, axis, scatter_dimension=0, tiled=True),
        # a ring: member i sends to i+1 (mod n), like a pipeline's stage-to-stage shift
        "permute": lambda x: jax.lax.ppermute(x, axis, [(i, (i + 1) % n) for i in range(n)]),
    }
    every = P(MESH_AXES)
    return jax.jit(jax.shard_map(bodies[op], mesh=mesh, in_specs=every, out_specs=every))


def local_count(op: str, size: int, n: int, itemsize: int) -> tuple[int, int]:
    """(elements each device puts in, the size actually measured): `size` rounded down to whole
    elements, and for all-gather and reduce-scatter to a multiple of n of them (as nccl-tests)."""
    count = size // itemsize
    if op in ("all_gather", "reduce_scatter"):
        count -= count % n
    if count == 0:
        raise ConfigError(f"--sizes: {size} B is less than one {itemsize}-byte element per device "
                          f"for {op} over {n} devices; use larger sizes")
    if count >= 2**31:  # the input's values are made from int32 element indices
        raise ConfigError(f"--sizes: {human(size)} is 2^31 or more {itemsize}-byte elements per "
                          f"device; use sizes below {human(2**31 * itemsize)}")
    return (count // n if op == "all_gather" else count), count * itemsize


def input_array(mesh, per_device: int, dtype: str):
    """A global 1-D array, `per_device` elements on each device, made there (never whole on one
    host): device d (its place in the mesh, row-major) holds d*per_device + arange(per_device)."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import PartitionSpec as P

    from jaxtron.parallel import MESH_AXES

    def local():
        index = 0
        for axis in MESH_AXES:
            index = index * mesh.shape[axis] + jax.lax.axis_index(axis)
        start = (index * per_device).astype(jnp.float32)
        return (start + jnp.arange(per_device, dtype=jnp.float32)).astype(dtype)

    return jax.jit(jax.shard_map(local, mesh=mesh, in_specs=(), out_specs=P(MESH_AXES)))()


def seconds_per_call(fn, x, warmup: int, iters: int, in_flight: bool = True) -> float:
    """Mean wall time of `iters` calls, launched back to back (`in_flight`) or each waited for,
    after `warmup` calls."""
    for _ in range(warmup):
        fn(x).block_until_ready()
    start = time.perf_counter()
    for _ in range(iters):
        out = fn(x)
        if not in_flight:
            out.block_until_ready()
    out.block_until_ready()
    return (time.perf_counter() - start) / iters


def hosts_spanned(mesh, axis: str) -> int:
    """How many processes the widest group of `axis` spans (1: within a host)."""
    import numpy as np

    groups = np.moveaxis(mesh.devices, mesh.axis_names.index(axis), -1)
    groups = groups.reshape(-1, mesh.shape[axis])
    return max(len({d.process_index for d in group}) for group in groups)


def measure(mesh, axes: list[str], ops: list[str], sizes: list[int], dtype: str,
            warmup: int, iters: int, shown: Callable[[list[dict]], None] | None = None
            ) -> list[dict]:
    """One row per (op, axis, size): time, algbw and busbw (nccl-tests' definitions); `shown`
    gets the rows so far after each."""
    import jax
    import numpy as np

    for axis in axes:  # every size fits every op before the first is timed
        for op in ops:
            for size in sizes:
                local_count(op, size, mesh.shape[axis], np.dtype(dtype).itemsize)
    rows, cpu = [], mesh.devices.flat[0].platform == "cpu"
    for axis in axes:
        n, hosts = mesh.shape[axis], hosts_spanned(mesh, axis)
        for op in ops:
            fn = collective(op, mesh, axis)
            for size in sizes:
                per_device, nbytes = local_count(op, size, n, np.dtype(dtype).itemsize)
                try:
                    x = input_array(mesh, per_device, dtype)
                    # XLA's CPU collectives deadlock with many calls in flight (each needs every
                    # device's thread at once; a 2-core machine's pool has fewer): one at a time
                    seconds = seconds_per_call(fn, x, warmup, iters, in_flight=not cpu)
                except jax.errors.JaxRuntimeError as e:
                    if not re.search(r"RESOURCE_EXHAUSTED|out of memory", str(e), re.I):
                        raise
                    raise ConfigError(
                        f"--sizes {human(size)}: {op} over {axis} ran out of device memory "
                        f"({str(e).strip().splitlines()[0]}); give smaller --sizes") from None
                algbw = nbytes / seconds / 1e9
                rows.append({"op": op, "axis": axis, "n": n, "hosts": hosts, "bytes": nbytes,
                             "time_us": seconds * 1e6, "algbw_gbps": algbw,
                             "busbw_gbps": algbw * bus_factor(op, n)})
                if shown is not None:
                    shown(rows)
                del x
    return rows


# ---------------------------------------------------------------- output
def format_table(rows: list[dict]) -> str:
    """The rows as a fixed-width table, one line each, under a header line."""
    header = (f"{'op':<15} {'axis':<7} {'n':>4} {'hosts':>5} {'size':>10} {'time (us)':>12} "
              f"{'algbw (GB/s)':>13} {'busbw (GB/s)':>13}")
    lines = [header]
    for i, r in enumerate(rows):
        if i and (r["op"], r["axis"]) != (rows[i - 1]["op"], rows[i - 1]["axis"]):
            lines.append("")
        lines.append(f"{r['op']:<15} {r['axis']:<7} {r['n']:>4} {r['hosts']:>5} "
                     f"{human(r['bytes']):>10} {r['time_us']:>12.1f} {r['algbw_gbps']:>13.2f} "
                     f"{r['busbw_gbps']:>13.2f}")
    return "\n".join(lines)


def plot(rows: list[dict], path: Path, title: str) -> None:
    """Bus bandwidth against size: one subplot per axis, one line per op, log-2 size axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    axes = list(dict.fromkeys(r["axis"] for r in rows))
    ncols = min(len(axes), 2)
    nrows = -(-len(axes) // ncols)
    fig, subplots = plt.subplots(nrows, ncols, figsize=(6.5 * ncols, 4.8 * nrows), squeeze=False)
    for ax in subplots.flat[len(axes):]:
        ax.set_visible(False)
    for ax, axis in zip(subplots.flat, axes):
        mine = [r for r in rows if r["axis"] == axis]
        for op in dict.fromkeys(r["op"] for r in mine):
            points = [(r["bytes"], r["busbw_gbps"]) for r in mine if r["op"] == op]
            ax.plot(*zip(*points), marker="o", markersize=4, label=op)
        hosts = mine[0]["hosts"]
        ax.set_title(f"{axis} (n={mine[0]['n']}, {hosts} host{'s' if hosts > 1 else ''})")
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: human(int(v))))
        ax.tick_params(axis="x", labelrotation=30)
        ax.set_xlabel("message size (nccl-tests size)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        ax.set_ylim(bottom=0)
        ax.grid(True, which="major", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---------------------------------------------------------------- command line
def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = cli.Parser(command="tools/commbench.py", description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", default=[], help="YAML preset(s): its mesh")
    parser.add_argument("--sizes", help="A..B (doubling), a list A,B,C or one size; "
                        "default 1MiB..1GiB on GPUs, 1KiB..256KiB on CPUs")
    parser.add_argument("--axes", default="data,stage,fsdp,tensor",
                        help="mesh axes to measure (default all; size-1 axes are skipped)")
    parser.add_argument("--ops", default=",".join(OPS),
                        help=f"collectives (default {','.join(OPS)})")
    parser.add_argument("--dtype", default="float32", help=f"one of {', '.join(DTYPES)}")
    parser.add_argument("--warmup", type=int, default=5, help="untimed calls per row")
    parser.add_argument("--iters", type=int, default=20, help="timed calls per row")
    parser.add_argument("--json", type=Path, metavar="FILE", help="write the rows as JSON")
    parser.add_argument("--plot", type=Path, metavar="FILE.png", help="plot busbw against size")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="e.g. mesh.fsdp=8")
    return parser.parse_args(argv)


def choose(text: str, options: tuple[str, ...], flag: str) -> list[str]:
    """A comma-separated selection from `options`, checked."""
    picked = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in picked if item not in options]
    if unknown or not picked:
        raise ConfigError(f"{flag}: unknown {unknown[0] if unknown else 'empty selection'!r} "
                          f"(choose from {', '.join(options)})")
    return picked


def check_args(args: argparse.Namespace) -> None:
    """Everything that can be checked before a backend starts."""
    from jaxtron.parallel import MESH_AXES

    args.axes = choose(args.axes, MESH_AXES, "--axes")
    args.ops = choose(args.ops, OPS, "--ops")
    if args.dtype not in DTYPES:
        raise ConfigError(f"--dtype {args.dtype}: choose from {', '.join(DTYPES)}")
    cli.check_counts(args, warmup=0, iters=1)
    if args.sizes is not None:
        args.sizes = parse_sizes(args.sizes)
    if args.json is not None:
        cli.writable_file(args.json, "--json")
    if args.plot is not None:
        cli.writable_file(args.plot, "--plot")
        from matplotlib.backend_bases import FigureCanvasBase

        formats = FigureCanvasBase.get_supported_filetypes()
        if args.plot.suffix[1:].lower() not in formats:
            raise ConfigError(f"--plot {args.plot}: name a file ending in .png, .pdf or .svg "
                              "(a format matplotlib writes)")


def run(args: argparse.Namespace) -> None:
    """Build the mesh, measure, print the table; write --json and --plot."""
    check_args(args)
    from jaxtron.config import load
    from jaxtron.program import xla_flags
    from jaxtron.train import distributed

    cfg = load(args.config, args.overrides)
    xla_flags.apply(cfg.xla)  # before anything starts a backend
    distributed.initialize(None, None, None)  # several Slurm/Open MPI processes: join them
    import jax

    from jaxtron.parallel import make_mesh

    devices = xla_flags.start_backend()  # one that cannot start here: one line, not a trace
    mesh = make_mesh(cfg.mesh, devices)
    sizes = args.sizes or parse_sizes("1MiB..1GiB" if devices[0].platform == "gpu"
                                      else "1KiB..256KiB")
    axes = [a for a in args.axes if mesh.shape[a] > 1]
    main_process = jax.process_index() == 0
    shape = " ".join(f"{a}={s}" for a, s in mesh.shape.items())
    title = f"{len(devices)} x {devices[0].device_kind}, mesh {shape}, {args.dtype}"
    if main_process:
        print(f"commbench: {title}; {cli.plural(args.iters, 'iteration')} after {args.warmup} "
              "warm-up")
        skipped = [a for a in args.axes if mesh.shape[a] == 1]
        if skipped:
            print(f"skipped (size 1): {', '.join(skipped)}")
    if not axes:
        raise ConfigError("every axis chosen has size 1; nothing to measure (set e.g. mesh.fsdp=8)")
    printed: list[str] = []

    def show(rows: list[dict]) -> None:  # each row as it is measured: a stop keeps those
        lines = format_table(rows).splitlines()
        print("\n".join(lines[len(printed):]), flush=True)
        printed[:] = lines

    rows = measure(mesh, axes, args.ops, sizes, args.dtype, args.warmup, args.iters,
                   show if main_process else None)
    if not main_process:
        return
    if args.json:
        from jaxtron.parallel import OPTIONAL_AXES
        shape = {a: n for a, n in mesh.shape.items() if a not in OPTIONAL_AXES or n != 1}
        meta = {"device": devices[0].device_kind, "devices": len(devices), "mesh": shape,
                "dtype": args.dtype, "warmup": args.warmup, "iters": args.iters}
        args.json.write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
        print(f"wrote {args.json}")
    if args.plot:
        plot(rows, args.plot, f"Bus bandwidth by mesh axis: {title}")
        print(f"wrote {args.plot}")


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    return one_line_errors(lambda: run(args))

