"""A run's pieces, made one way for every entry point: training, the dry run, `--compile-for`, the
benchmarks, and the planner (each layout it estimates, and --verify's compiles).

    config -> the attention kernel for the platform -> `auto` remat and microbatches for the
    memory at hand -> optimizer -> plan (every layout check; shapes, shardings, sizes) -> on a
    mesh: the step lowered, and the options it compiles with

Nothing here allocates: a run then restores or creates its state (jaxtron/step/state.py), a dry
run prints the plan, `--compile-for` reads the compiled program."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from jaxtron import parallel
from jaxtron.config import Config
from jaxtron.ops import attention, experts
from jaxtron.plan import autofit
from jaxtron.step import abstract_batch, compile_step
from jaxtron.step.optim import make_optimizer
from jaxtron.step.state import Plan, make_plan


@dataclass(frozen=True)
class Setup:
    """A config resolved for where it runs, and what follows from it before allocation."""

    cfg: Config  # the kernel and the `auto` choices resolved
    chosen: str  # what `auto` chose, as a run says it; "" when nothing was auto
    tx: optax.GradientTransformation
    plan: Plan
    usable: int | None  # bytes one device may use, None when unknown

    def abstract_state(self, mesh: Mesh) -> dict:
        """The state's shapes, dtypes and shardings on `mesh`, nothing allocated."""
        shardings = parallel.named(self.plan.specs, mesh)
        return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                            self.plan.abstract, shardings)

    def lower(self, mesh: Mesh, state: Any = None, batch: Any = None):
        """The train step lowered on `mesh` for `state` and `batch` (default: their abstract
        shapes); under jax.set_mesh(mesh), as the step's activation constraints need."""
        state = self.abstract_state(mesh) if state is None else state
        batch = abstract_batch(self.cfg, mesh) if batch is None else batch
        return compile_step(self.cfg, self.plan, self.tx, mesh).lower(state, batch)

    def options(self, platform: str) -> dict:
        """The XLA options this plan compiles with on `platform` (autofit.compiler_options: a
        memory limit for the scheduler, pipelined gathers off around accumulation)."""
        return autofit.compiler_options(self.cfg, self.plan, self.usable, platform)


def set_up(cfg: Config, num_devices: int, platform: str | None,
           usable: tuple[int | None, str] = (None, "")) -> Setup:
    """`cfg` for `num_devices` devices of `platform` ("gpu", "cpu"; None leaves the attention
    kernel as configured: a plan for any machine), `auto` resolved for `usable` (bytes per
    device and where that was measured, autofit.usable_here). Every check of the layout runs
    here: a ConfigError names what to change."""
    if platform is not None:
        cfg = experts.configure(attention.configure(cfg, platform), platform)
    cfg, chosen = autofit.resolve(cfg, num_devices, *usable)
    tx = make_optimizer(cfg)
    return Setup(cfg, chosen, tx, make_plan(cfg, tx, num_devices), usable[0])
