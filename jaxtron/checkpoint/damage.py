"""Damaged checkpoints, recognised from their files before a restore meets them.

Orbax lists every step-named directory under `checkpoints/` as a checkpoint (an unfinished save is
named `<step>.orbax-checkpoint-tmp-*`), whatever is left in it: garbage, a commit marker without
its items, nothing at all. A checkpoint here is sound when its metadata files read as JSON and
every file its OCDBT tree points into is there and long enough; no array data is read.

TensorStore is imported inside files_damage, so that the metadata checks answer at once.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

METADATA = ("state/_METADATA", "meta/metadata")  # what a restore reads first, in that order


def step_dirs(checkpoints_dir: Path) -> list[Path]:
    """Every step directory under `checkpoints_dir` (what Orbax lists), oldest first; none where
    it is missing or cannot be read (too long a path, a file on the way: a run's path checks
    name those)."""
    try:
        found = [p for p in checkpoints_dir.iterdir() if p.name.isdigit() and p.is_dir()]
    except OSError:
        return []
    return sorted(found, key=lambda p: int(p.name))


def meta_damage(step_dir: Path) -> str | None:
    """Why the checkpoint's metadata cannot be read (a file missing, or not JSON), or None."""
    try:
        if not any(step_dir.iterdir()):
            return "its directory is empty"
    except OSError as e:
        return f"its directory cannot be read ({e.strerror})"
    for name in METADATA:
        try:
            json.loads((step_dir / name).read_bytes())
        except FileNotFoundError:
            return f"{name} is missing"
        except (OSError, ValueError) as e:  # UnicodeDecodeError included
            return f"{name} is unreadable ({_first_line(e)})"
    return None


def files_damage(step_dir: Path) -> str | None:
    """Why a checkpoint's arrays cannot be read, or None when every file its OCDBT B+tree points
    into is there and long enough (the tree itself is read, no array data), so a truncated or
    missing data file shows before a restore meets it (OUT_OF_RANGE)."""
    import tensorstore as ts

    state = step_dir.absolute() / "state"
    if not json.loads((state / "_METADATA").read_text()).get("use_ocdbt", True):
        return None  # one file per chunk: nothing here says how long each should be
    if not ((state / "d").is_dir() or any(state.glob("ocdbt.process_*"))):
        return None  # metadata alone (no array was written): nothing to point into
    if not (state / "manifest.ocdbt").is_file():  # the tree's root: no array can be found
        return "state/manifest.ocdbt is missing"
    try:
        base = ts.KvStore.open(f"file://{state}/").result()
        pending = [v["root"]["location"] for v in ts.ocdbt.dump(base).result()["versions"][-1:]
                   if "location" in v["root"]]
        while pending:
            location = pending.pop()
            kind, prefix, name = location.rsplit(":", 2)[0].split(":", 2)
            offset, length = (int(n) for n in location.rsplit(":", 2)[1:])
            file = state / (prefix + name)
            size = file.stat().st_size if file.is_file() else None
            if size is None or size < offset + length:
                held = "is missing" if size is None else f"holds {size:,} bytes"
                return (f"{file.relative_to(step_dir.absolute())} {held}; the checkpoint "
                        f"needs {offset + length:,}")
            if kind == "btreenode":
                pending += _locations(ts.ocdbt.dump(base, location).result())
    except Exception as e:  # noqa: BLE001 - any failure to read the tree is damage
        return _first_line(e)
    return None


def damage(step_dir: Path) -> str | None:
    """Why a checkpoint cannot be restored, as far as its files tell; None when it is sound."""
    return meta_damage(step_dir) or files_damage(step_dir)


def survey(checkpoints_dir: Path, check: Callable[[Path], str | None] = damage
           ) -> tuple[list[Path], dict[Path, str]]:
    """(the sound checkpoints, oldest first; each damaged one with why) under `checkpoints_dir`,
    by `check` (damage, or meta_damage alone)."""
    sound, damaged = [], {}
    for step_dir in step_dirs(checkpoints_dir):
        if why := check(step_dir):
            damaged[step_dir] = why
        else:
            sound.append(step_dir)
    return sound, damaged


def _first_line(e: BaseException) -> str:
    """An error's first line, at most 200 characters."""
    return (str(e).strip().splitlines() or [type(e).__name__])[0][:200]


def _locations(node: Any) -> list[str]:
    """The value and node locations ('value:<dir>:<file>:<offset>:<length>') in a dumped node."""
    if isinstance(node, dict):
        return [loc for v in node.values() for loc in _locations(v)]
    if isinstance(node, list):
        return [loc for v in node for loc in _locations(v)]
    return [node] if isinstance(node, str) and node.startswith(("value:", "btreenode:")) else []
