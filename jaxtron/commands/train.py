"""`jaxtron train`: config + overrides -> checks -> train (or --dry-run: the plan only;
--compile-for: the H100 program's report). From a checkout, `python launch.py` runs the same.

    jaxtron train                                          # tiny model on the default corpus
    jaxtron train --config llama3_8b mesh.fsdp=8 train.steps=100   # a preset by name, or a path
    jaxtron train --config llama3_70b --dry-run --devices 128 mesh.tensor=8
    jaxtron train --config llama3_8b --compile-for h100 --devices 8 --report r.json
    jaxtron train model.remat=full xla.flags=[--xla_dump_to=/tmp/hlo]  # a remat policy, flags
    jaxtron train --coordinator 10.0.0.1:1234 --num-processes 2 --process-id 0   # and id 1
    srun --ntasks-per-node=8 jaxtron train ...     # Slurm / mpirun: processes found by JAX
    jaxtron train --strict ...                     # a set-up problem stops the run (exit 2)

Before training, the set-up checks of jaxtron doctor run (jaxtron/train/doctor.py): each problem is
one `warning: ...` line naming the fix; with --strict, one `jaxtron train: error: ...` line each
and exit status 2.

Exit status: 0 done; 2 bad input (one line says what to change), or with --strict a set-up
problem; 3 stopped on a non-finite loss
(train.on_nonfinite=stop); 4 a due checkpoint could not be saved (the line says why; the previous
checkpoint is intact), or run.dir was removed while the run went on; 75 preempted by
SIGTERM/SIGINT/SIGHUP after saving a checkpoint (rerun resumes).
Several processes: when one is lost (killed, frozen, its node down), the others stop within
run.peer_timeout_s (60 s) with one line naming it and status 75: the newest checkpoint is intact
and the same command resumes (jaxtron/train/supervisor.py; each process trains in a
supervised child).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

DEFAULT_CONFIG = Path(__file__).resolve().parents[1] / "configs" / "tiny.yaml"
# jaxtron.lifecycle's, which says every status; here too, as a stop may come before it imports
EXIT_PREEMPTED = 75  # SIGTERM/SIGINT/SIGHUP: the current step was checkpointed; rerun to resume


def parse_args(argv: list[str]) -> argparse.Namespace:
    from jaxtron import cli
    from jaxtron.config.presets import preset_names
    from jaxtron.train import distributed

    parser = cli.Parser(
        command="launch.py",
        description="Train a Llama-family model with JAX SPMD. Without --config: the tiny preset "
                    "on the Python standard library's sources.",
        epilog="presets (--config NAME, shipped with jaxtron): " + ", ".join(preset_names())
               + ". overrides: section.key=value, anywhere on the line; sections: model, mesh, "
               "pipeline, xla, data, train, optim, checkpoint, run "
               "(jaxtron/config/schema.py lists every "
               "key). `base:` in a preset names another preset, relative to the preset's file. "
               "Exit status: 0 done, 2 bad input (one line says what to change), 3 stopped on a "
               "non-finite loss, 4 a due checkpoint could not be saved (or run.dir was removed), "
               "75 preempted after a checkpoint or another process lost (rerun to resume).")
    parser.add_argument("--config", action="append", default=[], metavar="PRESET",
                        help="a preset's name (llama3_8b; listed below) or a YAML file's path "
                             "(repeatable; later ones override earlier ones; default: tiny)")
    parser.add_argument("--dry-run", action="store_true",
                        help="validate and print the plan (parameters, memory) without compiling")
    parser.add_argument("--devices", type=int, default=None,
                        help="with --dry-run or --compile-for: this many devices instead of the "
                             "local ones")
    parser.add_argument("--compile-for", metavar="GPU",
                        help="compile the train step for a cluster of this GPU (h100, h200) "
                             "without one, and report its memory, FLOPs, collectives, kernels")
    parser.add_argument("--gpu", choices=("h100", "h200"),
                        help="with --dry-run: compare the memory estimate with this GPU's "
                             "(default: the local device's, if it reports one)")
    parser.add_argument("--gpus-per-host", type=int, default=None,
                        help="with --compile-for: GPUs per host (default 8)")
    parser.add_argument("--report", metavar="FILE.json",
                        help="with --compile-for: the report as JSON")
    parser.add_argument("--hlo", metavar="FILE", help="with --compile-for: the optimized HLO text")
    distributed.add_flags(parser)
    parser.add_argument("--strict", action="store_true",
                        help="set-up problems found before training (jaxtron doctor's checks) "
                             "are errors: exit status 2")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value")
    return parser.parse_intermixed_args(argv)  # overrides may come before, between or after options


class _StartupSignals:
    """SIGTERM/SIGINT/SIGHUP until the training loop takes them over (a checkpoint, then 75): a
    signal stops start-up with 75 too; nothing was trained, so a batch system's requeue loses
    nothing. While modules import it only records (a KeyboardInterrupt inside an extension's
    import becomes an ImportError); then it raises. The loop's handler reads `signalled`."""

    def __init__(self):
        self.signalled: list[int] = []
        self.raising = False

    def __call__(self, signum, frame) -> None:
        if self.raising and _deferred(signum, frame):
            return
        self.signalled.append(signum)
        if self.raising:
            raise KeyboardInterrupt

    def install(self) -> None:
        """In place of Python's own handlers, and of a recorder that ran before (the `jaxtron`
        command's, a shim's: what it recorded counts here)."""
        if threading.current_thread() is not threading.main_thread():
            return
        recorders = []
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            handler = signal.getsignal(sig)
            if getattr(handler, "startup_recorder", False) and handler not in recorders:
                recorders.append(handler)
            elif handler not in (signal.SIG_DFL, signal.default_int_handler):
                continue  # an ignored one (nohup, a background job) stays so
            signal.signal(sig, self)
        self.signalled += [signum for recorder in recorders for signum in recorder.signalled]

    def check(self) -> None:
        """From here on a signal raises; one that came during the imports stops start-up now."""
        self.raising = True
        if self.signalled:
            raise KeyboardInterrupt


def _deferred(signum, frame) -> bool:
    from jaxtron.lifecycle import deferred  # imported by then (raising starts after the imports)

    return deferred(signum, frame)


def main(argv: list[str] | None = None, own: bool | None = None) -> int:
    """Train; the exit status. `own`: `argv` is this process's command line (default: when argv
    is None, sys.argv's), which a run of several processes runs again in a supervised child;
    called in-process with other arguments (tests), it trains here."""
    own = argv is None if own is None else own
    signals = _StartupSignals()
    signals.install()
    if os.environ.get("JAXTRON_SUPERVISOR"):  # distributed.SUPERVISED, before the imports
        from jaxtron.train.supervisor import follow_parent

        follow_parent()
    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)  # imports jax: a second or two
        from jaxtron.checkpoint import CheckpointSaveError
        from jaxtron.lifecycle import EXIT_NONFINITE, EXIT_SAVE_FAILED, one_line_errors
        from jaxtron.train.distributed import end_if_lost
        from jaxtron.train.loop import NonFiniteError, Preempted

        signals.check()
    except KeyboardInterrupt:
        return _stopped_at_start()
    if own and (status := _supervised(args)) is not None:
        return status
    statuses = {NonFiniteError: EXIT_NONFINITE, CheckpointSaveError: EXIT_SAVE_FAILED}
    try:
        return _leave_peers(one_line_errors(lambda: run(args), statuses=statuses))
    except Preempted as e:
        print(f"{e}: checkpoint saved, run the same command to resume", file=sys.stderr)
        return EXIT_PREEMPTED
    except KeyboardInterrupt:
        return _stopped_at_start()
    except Exception as e:
        end_if_lost(e)  # a collective that lost its peer: one line, 75 (distributed.LOST_PEER)
        raise


def _supervised(args: argparse.Namespace) -> int | None:
    """Several processes train in a supervised child (jaxtron/train/supervisor.py): its status."""
    from jaxtron.train.supervisor import supervise_launch

    return supervise_launch(args, args.config or [DEFAULT_CONFIG])


def _leave_peers(status: int) -> int:
    """An error exit of one process of several (its line is out) skips jax.distributed's shutdown
    barrier: the others are held in a collective or a save's barrier and never reach it, so it
    would hold this process 30 s, then abort it (status -6, a C++ stack) instead of `status`.
    They stop on its missing heartbeat instead (within run.peer_timeout_s)."""
    import jax

    from jaxtron.train import distributed

    if status and jax.distributed.is_initialized():
        distributed.announce_exit(status)  # the others' failing collectives: not a lost peer
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)
    return status


def _stopped_at_start() -> int:
    print("stopped by a signal before training started (nothing to save); run the same "
          "command to start", file=sys.stderr)
    if any(t.name == "compile" and t.is_alive() for t in threading.enumerate()):
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(EXIT_PREEMPTED)  # an exit that waited would abort inside XLA's compile
    return EXIT_PREEMPTED


def run(args: argparse.Namespace) -> int | None:
    """Check the options, load the config, set XLA's flags, then plan (--dry-run), or check the
    paths, join the processes, check the set-up and train."""
    import jax  # importing starts no backend: XLA_FLAGS may still be set below

    from jaxtron import lifecycle, parallel
    from jaxtron.config import load, to_yaml
    from jaxtron.program import xla_flags
    from jaxtron.train import distributed, doctor
    from jaxtron.train.dry_run import dry_run, nothing_to_do
    from jaxtron.train.loop import train
    from jaxtron.train.run_dir import check_paths

    _check_options(args)
    cfg = load(args.config or [DEFAULT_CONFIG], args.overrides)
    if args.compile_for:
        compile_for(cfg, args)
        return
    # XLA reads its flags once, when the first backend starts: set them before anything
    # touches a device, dry runs included (a misspelled flag stops here, in one line).
    flags = xla_flags.apply(cfg.xla)
    if args.dry_run:  # a plan needs no other process: it never joins them
        xla_flags.start_backend()  # JAX_PLATFORMS naming a backend that cannot start: one line
        dry_run(cfg, args.devices or jax.device_count(), args.gpu, flags)
        return
    if finished := nothing_to_do(cfg):  # run.dir may be read-only now: write nothing (each process)
        print(finished, flush=True)
        return None
    check_paths(cfg)  # before the processes join: a refused start writes nothing
    lifecycle.outlive_readers()  # `| head` or a closed terminal must not end a run
    # Join the other processes (if any) before anything touches a jax device: train() checks
    # the mesh against the global device count, and logs the flags once its checks pass.
    distributed.initialize(args.coordinator, args.num_processes, args.process_id,
                           cfg.run.peer_timeout_s)
    xla_flags.start_backend()  # the first device touched: a backend that cannot start, one line
    distributed.check_same_config(to_yaml(cfg))  # processes that differ would part, then hang
    parallel.mesh_shape(cfg.mesh, jax.device_count())  # an error here, not a warning then one
    hosts = doctor.Hosts.here()  # a collective: where every process runs, counted once
    if status := preflight(cfg, args, hosts):
        return status
    train(cfg, paths_checked=True, hosts=hosts)
    return None


def _check_options(args: argparse.Namespace) -> None:
    """Options that do not go together, or do nothing where they were given."""
    from jaxtron.config import ConfigError

    if args.devices is not None and args.devices < 1:
        raise ConfigError(f"--devices {args.devices} must be at least 1")
    if args.strict and (args.dry_run or args.compile_for):
        raise ConfigError("--strict applies to training runs; to check a set-up without training, "
                          "run jaxtron doctor --strict")
    if args.gpu and not args.dry_run:
        raise ConfigError(f"--gpu {args.gpu} only applies to --dry-run (its memory verdict); "
                          + ("--compile-for names the GPU itself" if args.compile_for else
                             f"add --dry-run, or drop --gpu {args.gpu} to train"))
    if not args.compile_for and (args.report or args.hlo):
        raise ConfigError("--report and --hlo only apply to --compile-for")
    if not (args.compile_for or args.dry_run) and args.devices is not None:
        raise ConfigError("--devices only applies to --dry-run and --compile-for")
    if not args.compile_for and args.gpus_per_host is not None:
        raise ConfigError("--gpus-per-host only applies to --compile-for (the hosts it compiles "
                          "for); a run finds its own")
    if args.gpus_per_host is None:
        args.gpus_per_host = 8
    if (args.coordinator, args.num_processes, args.process_id) != (None, None, None):
        from jaxtron.train import distributed  # a dry run checks them as the run would

        distributed.check_flags(args.coordinator, args.num_processes, args.process_id)


def preflight(cfg, args: argparse.Namespace, hosts) -> int:
    """jaxtron doctor's checks (a collective with several processes); process 0 prints the
    problems. The exit status: 2 under --strict when there is any, else 0."""
    import jax

    from jaxtron.train import doctor

    problems = doctor.check_all(cfg, os.environ, hosts, coordinator=args.coordinator, disk=False,
                                gpu=jax.devices()[0].platform == "gpu")  # GPU settings: GPUs only
    return doctor.report(problems, args.strict, show=jax.process_index() == 0)


def compile_for(cfg, args: argparse.Namespace) -> None:
    """Compile the train step for --devices GPUs of --compile-for on this machine and report."""
    import json

    from jaxtron.config import ConfigError

    if args.dry_run:
        raise ConfigError("--compile-for and --dry-run are two different reports; give one")
    if args.devices is None:
        raise ConfigError("--compile-for needs --devices N, the GPUs of the cluster to compile for")
    from jaxtron import cli
    from jaxtron.program import aot

    aot.check_target(args.compile_for, args.devices, args.gpus_per_host)
    outputs = {path: cli.writable_file(path) for path in (args.report, args.hlo) if path}
    cfg, flags = aot.gpu_program(cfg)
    setup = aot.set_up_for(cfg, args.compile_for, args.devices)  # layout: one line
    chosen = f"\n{setup.chosen}" if setup.chosen else ""
    print(f"xla flags: {' '.join(flags) or 'none'}{chosen}", flush=True)
    report = aot.compile_for(setup, args.compile_for, args.devices, args.gpus_per_host, args.hlo)
    print("\n".join(aot.format_report(report)))
    if args.report:
        with outputs[args.report].open("w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
