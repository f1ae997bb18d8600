"""Rank the layouts of a model on a GPU cluster before renting it: memory per GPU and step time.

    jaxtron plan --config llama3_70b --devices 128 --gpus-per-host 8
    jaxtron plan --config llama3_8b --devices 16 --json plan.json --verify 3
    jaxtron plan --config llama3_70b --devices 128 train.batch_size=512 \\
        train.seq_len=4096 --remat full,save_attn_out --find "TP8 PP2" --find "TP8 PP8 DP2"

Every mesh (data x fsdp x tensor x stage), pipeline schedule, microbatch count, remat policy and
pipeline gradient sum the config's checks accept is estimated (jaxtron/plan/planner.py says how,
with its constants and their sources): the dry run's per-GPU memory against what jax may use
(XLA_PYTHON_CLIENT_MEM_FRACTION if set, else xla.mem_fraction), and a step time from compute, the
pipeline bubble and the communication each axis implies over NVLink or the network. The best few
are printed with the terms that cost each most against the one above; `--find PARTS` shows where
the best layout named by those parts ranks, and why; `--only PARTS` ranks only the layouts named
by those parts (a cluster whose mesh is fixed); `--json FILE` writes the whole ranked list.
`--verify N` compiles the best N for the real GPU topology (as `jaxtron train --compile-for` does,
with the GPU flag preset; a few minutes for a large model), prints each estimate beside the
compiled peak and the step time from what the program does, and recommends the fastest whose
compiled peak leaves 10% free, with its overrides. Bad input: one line, exit 2.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

import jax

from jaxtron import cli
from jaxtron import config as config_lib
from jaxtron.config import ConfigError
from jaxtron.lifecycle import one_line_errors
from jaxtron.model import REMAT_POLICIES
from jaxtron.plan import planner
from jaxtron.plan.autofit import AUTO, POLICIES, SPARE
from jaxtron.program import aot


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.Parser(command="tools/plan.py", description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", default=[], help="YAML preset (repeatable)")
    parser.add_argument("--devices", type=int, required=True, help="GPUs in the job")
    parser.add_argument("--gpus-per-host", type=int, default=8)
    parser.add_argument("--gpu", default="h100", choices=sorted(planner.ACHIEVABLE_TFLOPS))
    parser.add_argument("--remat",
                        help="comma-separated remat policies to try (default: those "
                             "model.remat=auto chooses from, and the config's own)")
    parser.add_argument("--top", type=int, default=5, help="layouts to print")
    parser.add_argument("--json", type=Path, help="write the ranked list here")
    parser.add_argument("--verify", type=int, default=0, metavar="N",
                        help="compile the best N layouts for the GPUs and compare peaks")
    parser.add_argument("--find", action="append", default=[], metavar="PARTS",
                        help="where the best layout whose name has all these parts ranks, and why "
                             "it loses to the one above it, e.g. --find 'TP8 PP2' --find 'TP8 "
                             "PP8 DP2' (repeatable)")
    parser.add_argument("--only", metavar="PARTS",
                        help="rank only the layouts whose name has all these parts: a cluster's "
                             "fixed mesh, e.g. --only 'TP8 PP8 DP2' (--verify then compiles the "
                             "best of these)")
    parser.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    return parser.parse_args(argv)


def _remats(args: argparse.Namespace, cfg) -> list[str]:
    if args.remat is None:  # every policy auto chooses from, as meshes: a preset's pin included
        return list(dict.fromkeys([*POLICIES, *([] if cfg.model.remat == AUTO
                                                  else [cfg.model.remat])]))
    names = [r.strip() for r in args.remat.split(",")]
    if "" in names:
        what = "is empty" if len(names) == 1 else f"'{args.remat}' has an empty item"
        raise ConfigError(f"--remat {what}; name policies separated by commas, e.g. --remat "
                          "full,save_dots")
    if len(set(names)) < len(names):
        twice = next(r for r in names if names.count(r) > 1)
        raise ConfigError(f"--remat {args.remat} names {twice} twice; name each policy once")
    unknown = [r for r in names if r not in REMAT_POLICIES]
    if unknown:
        raise ConfigError(f"--remat {unknown[0]} is not one of {', '.join(REMAT_POLICIES)}")
    return names


def _check(args: argparse.Namespace) -> None:
    cli.check_counts(args, devices=1, gpus_per_host=1, top=1, verify=0)
    if args.devices > args.gpus_per_host and args.devices % args.gpus_per_host:
        raise ConfigError(f"--devices {args.devices} is not a whole number of hosts of "
                          f"--gpus-per-host {args.gpus_per_host}")


def print_ranking(ranked: list[planner.Layout], top: int, usable: int) -> None:
    """The best `top`, each with why it loses to the one above."""
    fits = sum(x.fits for x in ranked)
    print(f"{len(ranked)} layouts estimated, {fits} fit; the best {min(top, len(ranked))} "
          "(TP tensor, PP stages, R circular repeats, EP experts, CP context, FSDP, DP data, "
          "M microbatches per pass):")
    if not fits:
        print(f"none fits in {1 - SPARE:.0%} of the {usable / 2**30:.1f} GiB jax may use per GPU; "
              f"the smallest needs {min(x.peak_bytes for x in ranked) / 2**30:.1f} GiB: use more "
              "GPUs (--devices)")
    for i, layout in enumerate(ranked[:top]):
        print(f"{i + 1}. {_line(layout)}")
        if i:
            print(f"   below #{i}: {planner.why_slower(layout, ranked[i - 1], usable)}")


def _line(layout: planner.Layout) -> str:
    parts = ", ".join(f"{k} {planner.duration(v)}" for k, v in layout.parts.items()
                      if v >= 0.001 * layout.step_seconds)
    crossing = (f"; {' and '.join(layout.crossing)} "
                f"{'cross' if len(layout.crossing) > 1 else 'crosses'} nodes" if layout.crossing
                else "")
    return (f"{layout.name()}: {planner.duration(layout.step_seconds)} per step, "
            f"{layout.peak_bytes / 2**30:.1f} GiB per GPU ({parts}){crossing}")


def check_find(queries: list[str], flag: str = "--find") -> None:
    """Each --find (--only) part is one a layout's name can have (planner.NAME_PART: every part
    the ranking prints)."""
    for query in queries:
        if bad := [p for p in query.split() if not re.fullmatch(planner.NAME_PART, p)]:
            raise ConfigError(f"{flag} {query}: '{bad[0]}' is not a layout part (TP8, PP2, "
                              "gpipe, circular, R2, EP2, CP2, FSDP16, DP2, M8, remat=full, "
                              "grad_sum=whole)")


def print_found(ranked: list[planner.Layout], queries: list[str], usable: int) -> None:
    """For each query, the best layout whose name has all its parts, in rank order, each with
    why it loses to the one found above it (the first: to #1)."""
    found = []
    for query in queries:
        index = next((i for i, x in enumerate(ranked)
                      if set(query.split()) <= set(x.name().split())), None)
        if index is None:
            print(f"--find {query}: no layout has all of these parts")
        else:
            found.append((index, query))
    above = (0, "#1")
    for index, query in sorted(found):
        print(f"--find {query}: #{index + 1}. {_line(ranked[index])}")
        if index > above[0]:
            where = "#1" if above[1] == "#1" else f"{above[1]} (#{above[0] + 1})"
            print(f"   below {where}: "
                  f"{planner.why_slower(ranked[index], ranked[above[0]], usable)}")
        above = (index, f"'{query}'")


# Compiled step times this close to the fastest are the same step: the estimate of exposed
# traffic is not finer than this
SAME_STEP = 0.005


def verify(cfg, ranked: list[planner.Layout], count: int, args: argparse.Namespace,
           usable: int) -> None:
    """Compile the best `count` that fit: each compiled peak beside its estimate, and the step
    time again from what the compiled program does (planner.compiled_step). Then the one to run:
    the fastest by that time among those whose compiled peak leaves SPARE free; of those within
    SAME_STEP of the fastest, the smallest compiled peak (Mixtral 8x7B on 16 H100s: remat=full
    and save_attn_out compile to the same kernels, 16.1 s both, at 61.5 and 63.3 GiB)."""
    kept = []
    for layout in [x for x in ranked if x.fits][:count]:
        candidate = planner.configure(cfg, layout.mesh, layout.schedule, layout.repeats,
                                      layout.microbatches, layout.remat, layout.grad_sum)
        report = aot.compile_for(candidate, args.gpu, args.devices, args.gpus_per_host)
        peak = report["memory"]["peak_bytes"]
        parts = planner.compiled_step(layout, report, args.gpu)
        seconds = sum(parts.values())
        keeps = peak <= usable * (1 - SPARE)
        exposed = ", ".join(f"{axes} {planner.duration(parts[axes])}"
                            for axes in report["exposed_bytes_per_axis"]
                            if parts[axes] >= 0.001 * seconds)
        print(f"verify {layout.name()}: estimate {layout.peak_bytes / 2**30:.1f} GiB, compiled "
              f"{peak / 2**30:.1f} GiB ({layout.peak_bytes / peak - 1:+.1%})"
              f"{'' if keeps else f', less than {SPARE:.0%} of the usable memory free'}; "
              f"{planner.duration(seconds)} per step from the compiled program (compute "
              f"{planner.duration(parts['compute'])}, exposed {exposed or 'nothing'}), estimate "
              f"{planner.duration(layout.step_seconds)}; compiled in "
              f"{report['compile_seconds']:.0f} s", flush=True)
        if keeps:
            kept.append((seconds, peak, layout))
    if kept:
        fastest = min(seconds for seconds, _, _ in kept)
        best = min((x for x in kept if x[0] <= fastest * (1 + SAME_STEP)), key=lambda x: x[1])[2]
        print(f"recommended: {best.name()}: {best.overrides()}")
    else:
        print(f"none of the {count} verified leaves {SPARE:.0%} free compiled: verify more "
              "(--verify N) or use more GPUs")


def run(args: argparse.Namespace) -> None:
    _check(args)
    check_find(args.find)
    check_find([args.only] if args.only else [], "--only")
    jax.config.update("jax_platforms", "cpu")  # as run as a command (see the top): in-process too
    if args.json:
        cli.writable_file(args.json, "--json")
    cfg = aot.for_gpus(config_lib.load(args.config, args.overrides))
    if args.verify:  # compiled as the run would compile it: the GPU flags, no CUDA runtime
        aot.check_target(args.gpu, args.devices, args.gpus_per_host, "--verify")  # before ranking
        cfg, _ = aot.gpu_program(cfg)
    # What jax may allocate: XLA_PYTHON_CLIENT_MEM_FRACTION as the job will set it.
    usable = int(aot.capacity_bytes(args.gpu) * aot.usable_fraction(cfg))
    ranked = planner.evaluate(cfg, args.devices, args.gpus_per_host, args.gpu, usable,
                              _remats(args, cfg))
    if not ranked:
        raise ConfigError(f"no layout of this model divides {args.devices} GPUs; check "
                          "train.batch_size and the model's heads and layers")
    if args.only:
        ranked = [x for x in ranked if set(args.only.split()) <= set(x.name().split())]
        if not ranked:
            raise ConfigError(f"--only {args.only}: no layout of this model on {args.devices} "
                              "GPUs has all of these parts; drop one, or see the ranking without")
    print_ranking(ranked, args.top, usable)
    print_found(ranked, args.find, usable)
    if args.json:
        args.json.write_text(json.dumps([x.as_json() for x in ranked], indent=1))
        print(f"wrote {len(ranked)} layouts to {args.json}")
    if args.verify:
        verify(cfg, ranked, args.verify, args, usable)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return one_line_errors(lambda: run(args))

