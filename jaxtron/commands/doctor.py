"""Check a machine or cluster's set-up for a run before renting hours on it
(jaxtron/train/doctor.py).

    jaxtron doctor                                          # the tiny default config
    jaxtron doctor --config llama3_8b mesh.fsdp=8 run.dir=/shared/runs/8b
    jaxtron doctor --config llama3_70b --devices 128   # the mesh for 128
    srun --ntasks-per-node=8 jaxtron doctor --config ... --strict    # every host at once
    jaxtron doctor --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0  # and 1

Checks the environment (CUDA_LAUNCH_BLOCKING, jax's GPU allocator variables, proxies that would
carry the coordinator's traffic), jax/jaxlib/CUDA plugin versions, the devices against the mesh,
fsdp or tensor groups spanning hosts, and run.dir (a directory it can write, shared between
hosts, with room for a checkpoint). Several processes join as `jaxtron train`'s do, and process 0
prints every process's problems.

Output: one line per problem, `doctor.py: warning: ...` naming the fix, or `doctor.py: no problems
found`; exit status 0. With --strict: `doctor.py: error: ...` lines on stderr and exit status 2.
Bad input (config, flags): one line on stderr, exit status 2.
"""

from __future__ import annotations

import argparse
import os

from jaxtron import cli, lifecycle
from jaxtron.config import ConfigError, load
from jaxtron.config.presets import PRESETS
from jaxtron.lifecycle import one_line_errors
from jaxtron.program import xla_flags
from jaxtron.train import distributed, doctor

DEFAULT_CONFIG = PRESETS / "tiny.yaml"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.Parser(command="tools/doctor.py", description=__doc__.splitlines()[0])
    parser.add_argument("--config", action="append", default=[],
                        help="YAML preset (repeatable; later files override earlier ones)")
    parser.add_argument("--strict", action="store_true",
                        help="problems are errors: exit status 2 when there is any")
    parser.add_argument("--devices", type=int,
                        help="plan the mesh for this many devices (default: the ones found)")
    distributed.add_flags(parser)
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser.parse_args(argv)


def diagnose(args: argparse.Namespace) -> int:
    """Run every check (joining the other processes first, if any); print; the exit status."""
    cli.check_counts(args, devices=1)
    cfg = load(args.config or [DEFAULT_CONFIG], args.overrides)
    broken = doctor.check_jaxlib(doctor.installed_versions())
    if broken:  # jax will not import, and every other check needs it
        return finish(broken, args.strict, show=True)

    distributed.initialize(args.coordinator, args.num_processes, args.process_id)
    try:
        xla_flags.start_backend()
    except ConfigError as e:  # the other checks need a device; the environment's do not
        environment = doctor.check_launch_blocking(os.environ) + doctor.check_allocator(os.environ)
        return finish([str(e), *environment], args.strict, show=True)
    import jax

    problems = doctor.check_all(cfg, os.environ, devices=args.devices or 0,
                                coordinator=args.coordinator)
    return finish(problems, args.strict, show=jax.process_index() == 0)


def finish(problems: list[str], strict: bool, show: bool) -> int:
    """Print the problems (or that there are none); the exit status."""
    status = doctor.report(problems, strict, f"{lifecycle.script_name()}: ", show)
    if show and not problems:
        print(f"{lifecycle.script_name()}: no problems found")
    return status


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    return one_line_errors(lambda: diagnose(args))

