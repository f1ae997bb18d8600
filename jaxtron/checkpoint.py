"""Orbax checkpoints of the whole run: train state, data-iterator position and metadata.

Saves are asynchronous (the loop goes on while arrays are written) and atomic (Orbax writes to a
temporary directory and renames it when complete). A restore reads into abstract targets that
carry the current mesh's shardings, so no second, unsharded copy of the state is ever made.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grain
import jax
import orbax.checkpoint as ocp

from jaxtron.config import CheckpointConfig


class Checkpoints:
    """The run's `checkpoints/` directory: save every `every` steps, keep the latest `keep`."""

    def __init__(self, cfg: CheckpointConfig, run_dir: Path):
        self.every = cfg.every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=cfg.keep, create=True, enable_async_checkpointing=True
        )
        self.manager = ocp.CheckpointManager(
            (run_dir / "checkpoints").absolute(), options=options,
            item_names=("state", "data", "meta"),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def due(self, step: int, last_step: int) -> bool:
        """Save at every `every`-th step and always at the last one."""
        return step == last_step or (self.every > 0 and step % self.every == 0)

    def save(self, step: int, state: dict, batches: grain.DatasetIterator, meta: dict) -> None:
        """Start an async save; `batches` must be positioned at the next batch to train on."""
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state),
            data=grain.checkpoint.CheckpointSave(batches),
            meta=ocp.args.JsonSave(meta),
        ))

    def restore(self, step: int, abstract_state: Any, shardings: Any,
                batches: grain.DatasetIterator) -> tuple[dict, dict]:
        """Read `step` straight into `shardings`, and move `batches` to where it was saved."""
        target = jax.tree.map(
            lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings
        )
        restored = self.manager.restore(step, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(target),
            data=grain.checkpoint.CheckpointRestore(batches),
            meta=ocp.args.JsonRestore(),
        ))
        return restored["state"], restored["meta"]

    def close(self) -> None:
        """Wait for the last async save to be complete on disk."""
        self.manager.wait_until_finished()
        self.manager.close()
