"""Checkpoints of a run: Orbax saves and restores (checkpoints.py), the weights and metadata
alone (weights.py), damaged checkpoints set aside (damage.py) and the run directory's lock."""

from jaxtron.checkpoint.checkpoints import (  # noqa: F401 - the names callers take from the package
    DAMAGED_DIR,
    IN_USE,
    LOCK_FILE,
    Checkpoints,
    CheckpointSaveError,
    DataChange,
    RunDirLock,
    none_readable,
    restore_dir,
    restore_from,
)
