"""The JAX profiler trace of the steps run.profile_steps names."""

from __future__ import annotations

from pathlib import Path

import jax

from jaxtron import config as config_lib
from jaxtron.train import metrics as metrics_lib


class Profile:
    """A JAX profiler trace (TensorBoard's and Perfetto's formats) of the steps run.profile_steps
    names, into run.dir/profile/ (process 0) or profile/process_<i>/ (run.profile_all_processes)."""

    def __init__(self, cfg: config_lib.RunConfig, run_dir: Path, log: metrics_lib.MetricsWriter,
                 watch: metrics_lib.Stopwatch):
        self.first, self.last = cfg.profile_steps or (0, -1)
        self.dir = run_dir / "profile"
        if cfg.profile_all_processes:
            self.dir = self.dir / f"process_{jax.process_index()}"
        self.enabled = bool(cfg.profile_steps) and (cfg.profile_all_processes or
                                                    jax.process_index() == 0)
        self.log, self.watch = log, watch
        self.traced: list[int] = []  # [first, latest] step of the open trace

    def before(self, step: int, state: dict) -> None:
        """Open the trace before the first traced step fetches its batch; the steps before it
        finish first, so that their work stays out."""
        if self.enabled and not self.traced and self.first <= step <= self.last:
            jax.block_until_ready(state)
            with self.watch.time("profile"):
                jax.profiler.start_trace(self.dir, create_perfetto_trace=True)
            self.traced = [step, step]

    def after(self, step: int, outputs) -> None:
        """Close the trace after the last traced step, once its device work is done."""
        if self.traced:
            self.traced[1] = step
            if step == self.last:
                jax.block_until_ready(outputs)
                self.stop()

    def stop(self) -> None:
        """Write the open trace, if any (also when the loop ends early)."""
        if not self.traced:
            return
        with self.watch.time("profile"):
            jax.profiler.stop_trace()
        first, last = self.traced
        self.traced = []
        self.log.info(f"profile: steps {first}..{last} traced into {self.dir}/plugins/profile/"
                      f"<time>/; view with `tensorboard --logdir {self.dir}` (pip install "
                      "tensorboard tensorboard-plugin-profile), or open its perfetto_trace.json.gz "
                      "in https://ui.perfetto.dev")
