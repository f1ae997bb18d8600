"""What every command line shares: its parser (usage errors in one line, exit status 2), the
checks of the paths it writes, and a few words of output. How a command starts, stops and exits
is jaxtron/lifecycle.py's."""

from __future__ import annotations

import argparse
import difflib
import os
import re
import sys
from pathlib import Path

from jaxtron import lifecycle
from jaxtron.config import ConfigError


class Parser(argparse.ArgumentParser):
    """argparse whose usage errors are one line naming the command's --help, and exit status 2.
    `command` is how to run it from a checkout ('tools/plan.py'; a subcommand's adds its name);
    started as `jaxtron plan` (jaxtron.commands), the lines name that instead."""

    def __init__(self, *args, command: str, **kwargs):
        invoked = lifecycle.invoked_as()  # `jaxtron plan`: its lines name that, not plan.py
        if invoked:
            self.run_as = " ".join([invoked, *command.split()[1:]])
        else:
            lifecycle.name_command(Path(command.split()[0]).name)
            self.run_as = f"python {command}"
        kwargs.setdefault("prog", lifecycle.script_name())  # as a shell shows it, in-process too
        kwargs.setdefault("allow_abbrev", False)  # `jaxtron train --gpus 8` was --gpus-per-host 8
        super().__init__(*args, **kwargs)
        self._argv: list[str] = []

    def parse_known_args(self, args=None, namespace=None):
        self._argv = list(sys.argv[1:] if args is None else args)  # for error()'s suggestion
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        print(f"{lifecycle.script_name()}: error: {message}{self._suggestion(message)} (see "
              f"{self.run_as} --help)", file=sys.stderr)
        sys.exit(lifecycle.EXIT_USAGE)

    def _suggestion(self, message: str) -> str:
        """For an option this command does not have: the name it has here (SYNONYMS: '; --gpus
        is --devices here'), or the nearest of its own ('; did you mean --dry-run?'); else ''."""
        unknown = re.match(r"unrecognized arguments: (.*)", message)
        words = unknown.group(1).split() if unknown else self._argv  # (a required one missing)
        own = [option for option in self._option_string_actions if option.startswith("--")]
        for word in words:
            flag = word.split("=")[0]
            if not flag.startswith("--") or flag in own:
                continue
            if SYNONYMS.get(flag) in own:
                return f"; {flag} is {SYNONYMS[flag]} here"
            if near := difflib.get_close_matches(flag, own, n=1, cutoff=0.75):
                return f"; did you mean {near[0]}?"
        return ""


# What other tools name the options every command here shares (the devices of the job, the GPUs
# per host): the names they have here.
SYNONYMS = {"--gpus": "--devices", "--num-gpus": "--devices", "--num-devices": "--devices",
            "--world-size": "--devices", "--gpus-per-node": "--gpus-per-host",
            "--devices-per-host": "--gpus-per-host", "--nproc-per-node": "--gpus-per-host"}


def writable_file(path: str | Path, what: str = "") -> Path:
    """`path` as a file the command can write, checked before the work that produces it (a long
    compile, a benchmark), not after; a ConfigError naming `what` (e.g. '--out') otherwise. An
    existing file is left as it is; a probe file is removed again."""
    target = Path(path)
    name = f"{what} {path}" if what else str(path)
    if target.is_dir():
        raise ConfigError(f"{name} is a directory; name a file")
    if not target.parent.is_dir():
        missing = next(p for p in (target.parent, *target.parent.parents) if not p.is_dir())
        if missing.exists():
            raise ConfigError(f"{name}: {missing} is a file, not a directory")
        raise ConfigError(f"{name}: directory {missing} does not exist; create it first")
    existed = target.exists()
    try:
        target.touch()
    except OSError as e:
        raise ConfigError(f"cannot write {name}: {e.strerror}") from None
    if not existed:
        target.unlink()  # nothing empty left behind if the work fails
    return target


def check_run_dir(path: str, key: str = "run.dir") -> None:
    """run.dir (or the directory config key `key` names) is, or can become, a directory this
    process can write in: a ConfigError naming the fix otherwise. Creates nothing (a probe file
    in the nearest existing parent is removed again)."""
    if not str(path).strip():
        raise ConfigError(f"{key} is empty; name a directory (e.g. {key}=runs/NAME)")
    target = Path(path)
    try:
        is_file = target.exists() and not target.is_dir()
    except OSError as e:  # a name longer than the filesystem allows
        raise ConfigError(f"{key}={path} cannot be used ({e.strerror}); choose a shorter "
                          "path") from None
    if is_file:
        raise ConfigError(f"{key}={path} is a file; set {key} to a directory (a new one, or "
                          "a run to resume)")
    if key == "run.dir" and target.is_dir():
        _check_is_a_run(target, path)
    existing = target
    while not existing.exists():
        existing = existing.parent
    try:
        if not existing.is_dir():
            raise NotADirectoryError(20, "Not a directory")
        probe = existing / f".jaxtron-write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as e:
        raise ConfigError(f"{key}={path} cannot be written ({e.strerror}); choose a directory "
                          "you can write") from None


RUN_FILES = ("config.yaml", "checkpoints", "metrics.jsonl", "goodput.json")  # what a run writes


def _check_is_a_run(directory: Path, path: str) -> None:
    """A run.dir that holds files but no run's (a source tree, a dataset) is not written into."""
    names = sorted(p.name for p in directory.iterdir() if not p.name.startswith("."))
    if names and not any(name in RUN_FILES for name in names):
        shown = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        raise ConfigError(f"run.dir={path} holds other files ({shown}) and no run; set run.dir to "
                          "a new or empty directory, or to a run to resume")


def check_counts(args: argparse.Namespace, **least: int) -> None:
    """Each named option of `args` (attribute=its minimum) at least its minimum: else a
    ConfigError naming the first that is not, as given (`--top -3 must be at least 1`). Options
    left at None (not given) pass."""
    for name, minimum in least.items():
        value = getattr(args, name)
        if value is not None and value < minimum:
            raise ConfigError(f"--{name.replace('_', '-')} {value} must be at least {minimum}")


def plural(n: int, noun: str) -> str:
    """'1 device', '8 devices'."""
    return f"{n} {noun}{'' if n == 1 else 's'}"
