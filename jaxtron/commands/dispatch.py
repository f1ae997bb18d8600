"""jaxtron's commands, one module each. Installed, they run as `jaxtron COMMAND [ARGS]` (the
console script of pyproject.toml's [project.scripts]); from a checkout, `python tools/COMMAND.py
[ARGS]` runs the same (`python launch.py` for train: a shim that first checks this Python has
jaxtron). COMMANDS lists them; `jaxtron --help` prints it.

This module imports none of them: `run` records SIGINT and SIGTERM while the one asked for
imports (jax takes a second or two), then calls its main(argv)."""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from typing import NamedTuple

from jaxtron import lifecycle


class Command(NamedTuple):
    module: str  # jaxtron.commands.<module>, and tools/<module>.py
    summary: str
    cpu: bool = False  # computes on this machine's CPU whatever JAX_PLATFORMS says
    # main(argv, own): whether argv is this process's command line, which a run of several
    # processes runs again in a supervised child (jaxtron/train/supervisor.py)
    supervised: bool = False

    @property
    def shim(self) -> str:
        """The file that runs it from a checkout."""
        return "launch.py" if self.module == "train" else f"tools/{self.module}.py"


COMMANDS = {
    "train": Command("train", "train a model (--dry-run: its plan; --compile-for: its GPU "
                     "program)", supervised=True),
    "prepare-data": Command("prepare_data", "raw text -> tokenized ArrayRecord shards"),
    "convert-hf": Command("convert_hf", "Hugging Face checkpoints to jaxtron's and back"),
    "generate": Command("generate", "continue a prompt with a model, to check it by eye"),
    "inspect-ckpt": Command("inspect_ckpt", "what a checkpoint holds, without loading it"),
    # Estimates and --verify's compiles are for GPUs elsewhere, computed on this CPU: a GPU here
    # would only lose memory, and with no backend of its own CUDA's plugin registers for compiles.
    "plan": Command("plan", "rank the layouts of a model on a GPU cluster", cpu=True),
    "doctor": Command("doctor", "check a machine or cluster's set-up for a run"),
    "bench": Command("bench", "train-step benchmark: tokens/s, MFU, memory, with a peer"),
    "bench-data": Command("bench_data", "input-pipeline throughput of one host"),
    "commbench": Command("commbench", "collective bandwidth over each mesh axis"),
    "plot": Command("plot", "training curves of runs as PNGs"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    return "\n".join(["usage: jaxtron COMMAND [ARGS]   (jaxtron COMMAND --help for its own)", "",
                      "commands:", *(f"  {name:<{width}}  {command.summary}"
                                     for name, command in COMMANDS.items())])


def main(argv: list[str] | None = None) -> int:
    """The `jaxtron` console script."""
    own = argv is None  # this process's command line
    argv = sys.argv[1:] if own else argv
    if argv[:1] in (["-h"], ["--help"]):
        print(usage())
        return 0
    if not argv or argv[0] not in COMMANDS:
        said = argv[0] if argv else ""
        near = difflib.get_close_matches(said.replace("_", "-"), COMMANDS, 1, 0.6)
        hint = f"; did you mean {near[0]}?" if near else f"; one of {', '.join(COMMANDS)}"
        print(f"jaxtron: error: {f'no command {said!r}' if said else 'a command is needed'}{hint}"
              " (see jaxtron --help)", file=sys.stderr)
        return lifecycle.EXIT_USAGE
    return run(argv[0], argv[1:], f"jaxtron {argv[0]}", own=own)


def run(name: str, argv: list[str] | None = None, invoked: str | None = None,
        own: bool | None = None) -> int:
    """Command `name` with `argv` (default: this process's), started as `invoked` (its lines
    name that; None: tools/<module>.py or launch.py, as sys.argv[0] says). `own`: argv is this
    process's command line (default: when argv is None)."""
    own = argv is None if own is None else own
    command = COMMANDS[name]
    if command.cpu and os.environ.get("JAX_PLATFORMS") != "cpu":
        # Said before jax loads its plugins, so that CUDA's registers for compiles only
        # (xla_flags.load_plugins_quietly; tools/plan.py says it first). Where jaxtron's own
        # import loaded them already for the platforms asked, the command starts again.
        os.environ["JAX_PLATFORMS"] = "cpu"
        if "jax" in sys.modules:
            os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])
    lifecycle.start_command(invoked)
    module = importlib.import_module(f"jaxtron.commands.{command.module}")
    argv = sys.argv[1:] if argv is None else argv
    return module.main(argv, own=own) if command.supervised else module.main(argv)
