"""The run directory: the paths a start checks before it writes anything (a refused start leaves
them as they were), what a start refused later removes again, a run.dir removed while the run
goes on, and the commands a finished run points to.
"""

from __future__ import annotations

import os
import shlex
import shutil
from pathlib import Path

from jaxtron import cli
from jaxtron.checkpoint import CheckpointSaveError, weights
from jaxtron.checkpoint.lock import LOCK_FILE
from jaxtron.config import Config, ConfigError
from jaxtron.data import prepared
from jaxtron.train.start import check_optimizer, check_start


def check_paths(cfg: Config) -> None:
    """The paths a run writes or reads, checked before anything is written (a refused start
    leaves them as they were): run.dir can be a directory; its newest checkpoint, or else
    checkpoint.restore, holds this model; run.compile_cache can be a directory."""
    cli.check_run_dir(cfg.run.dir)
    if (holder := weights.checkpoints_holding(Path(cfg.run.dir))) is not None:
        raise ConfigError(f"run.dir={cfg.run.dir} is inside the checkpoints directory {holder}, "
                          "whose old checkpoints a run deletes (or moves aside) with what is in "
                          f"them; set run.dir to a directory outside it")
    check_start(Path(cfg.run.dir), cfg.model, cfg.checkpoint.restore,
                prepared.tokenizer_check(cfg.data, cfg.model.vocab_size), cfg.optim.name)
    c = cfg.checkpoint
    if c.restore and not c.weights_only and not weights.run_checkpoints(Path(cfg.run.dir)):
        meta = weights.read_meta(restored := weights.locate(c.restore)[1])
        if meta.get("layout") == weights.LAYERED:  # jaxtron convert-hf import's output
            raise ConfigError(weights.imported_only(c.restore))
        check_optimizer(meta, cfg.optim.name, f"checkpoint.restore={c.restore}", c.restore)
        at = meta.get("step", -1)
        if at >= cfg.train.steps:  # it would start, say "nothing to do", and leave a run.dir
            raise ConfigError(f"checkpoint.restore={c.restore} is at step {at}, not before "
                              f"train.steps={cfg.train.steps}; raise train.steps, or fine-tune "
                              f"from its weights with checkpoint.weights_only=true ({restored})")
    if cfg.run.compile_cache:
        cache = Path(cfg.run.compile_cache)
        existing = next(path for path in (cache, *cache.parents) if path.exists())
        if not existing.is_dir():
            where = "is a file" if existing == cache else f"is under a file, {existing}"
            raise ConfigError(f"run.compile_cache={cfg.run.compile_cache} {where}; set it to a "
                              "directory (JAX keeps a file per compiled program in it), or to ''")
        cli.check_run_dir(cfg.run.compile_cache, "run.compile_cache")


def remove_added(run_dir: Path, held: set[str]) -> None:
    """Remove what a refused start added to run.dir (its log files, an empty checkpoints
    directory), so that run.dir is as it was; the lock file stays (another start may hold it)."""
    if not run_dir.is_dir():
        return
    for name in set(os.listdir(run_dir)) - held - {LOCK_FILE}:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)




def check_kept(run_dir: Path) -> None:
    """run.dir removed while the run compiled or trained (a clean-up script, a user's rm):
    nothing it trains could be saved, so it stops in one line (status 4) rather than train for
    nothing. It is not made again: its checkpoints and logs are gone, and whoever removed it
    meant it gone."""
    if not run_dir.is_dir():
        raise CheckpointSaveError(f"run.dir {run_dir} was removed while the run went on; nothing "
                                  "it trains could be saved there: run the same command to start "
                                  "again")




def next_commands(run_dir: str) -> str:
    """The commands that use a trained run, as a finished run's last line."""
    where = shlex.quote(run_dir)
    return (f"next: jaxtron generate {where} --prompt TEXT (continue a prompt); jaxtron "
            f"convert-hf export {where} OUT_DIR (a Hugging Face model); jaxtron plot {where} "
            "(the loss curves)")
