"""Where a run's input resumes: the layout a saved input position is exact for, and why another
layout's is not (the config keys that changed); the position each process's checkpoint holds."""

from __future__ import annotations

import json
from pathlib import Path


class InexactResumeWarning(UserWarning):
    """A saved input position could not be restored exactly (another layout)."""


# A layout field -> the config key that sets it, as a warning names it.
_KEYS = {"workers": "data.workers", "source": "data.source", "mixture": "data.mixture",
         "seq_len": "train.seq_len", "batch_size": "train.batch_size", "seed": "train.seed"}


def resume_warning(saved: dict, layout: dict) -> str | None:
    """Why a saved input position (a checkpoint's) cannot be resumed exactly with `layout`, the
    fields that changed first; None when it can."""
    if {k: saved.get(k) for k in layout} == layout:
        return None
    return (f"data: {_changes(saved, layout)} since the checkpoint: the input cannot resume "
            "exactly, and the batches from here on differ from an uninterrupted run's (the "
            f"stream restarts near item {saved['start'] + saved['consumed']:,}, skipping what "
            "the old run held in packing buffers)")


def _shown(value) -> str:
    """A layout value as a config would say it: a mixture as `path (weight), ...`."""
    if isinstance(value, list):
        return "[" + ", ".join(f"{path} ({weight:g})" for path, weight in value) + "]"
    return str(value)


def _changes(saved: dict, now: dict) -> str:
    """The layout fields that differ as `key old -> new` (a pipeline saved as a string by older
    checkpoints compares as a whole)."""
    pairs = [("workers", saved.get("workers"), now["workers"])]
    old, new = saved.get("pipeline"), now["pipeline"]
    if isinstance(old, dict):
        pairs += [(key, old.get(key), new.get(key)) for key in dict.fromkeys([*old, *new])]
    else:
        pairs.append(("pipeline", old, " ".join(f"{k}={v}" for k, v in new.items())))
    return ", ".join(f"{_KEYS.get(key, key)} {_shown(a)} -> {_shown(b)}" for key, a, b in pairs
                     if a != b)


def saved_iterator_state(directory: Path, process_index: int, process_count: int) -> dict:
    """The state Grain's checkpoint handler saved in `directory` for this process; process 0's
    when the run had another process count (that handler itself would fail then)."""
    mine = Path(directory) / f"process_{process_index}-of-{process_count}.json"
    files = [mine] if mine.is_file() else sorted(Path(directory).glob("process_0-of-*.json"))
    if not files:
        raise FileNotFoundError(f"no saved input position in {directory}")
    return json.loads(files[0].read_text())
