"""Which features run together. Each feature a run can turn on is named here with the setting
that turns it on, each pair that does not compose is listed once with the reason and what to use
instead, and `check` refuses such a run in this one place, before anything compiles, with one
line (ConfigError, status 2). A new feature adds its row, and a row for each feature it does not
run with."""

from __future__ import annotations

from typing import Callable, Mapping

from jaxtron.config import Config, ConfigError

Sizes = Mapping[str, int]
# feature -> the setting that turns it on, as the user would write it; None where it is off
FEATURES: dict[str, Callable[[Config, Sizes], str | None]] = {
    "pipeline": lambda cfg, sizes: (f"mesh.stage={sizes['stage']}" if sizes.get("stage", 1) > 1
                                    else None),
    # the 1F1B schedules' own backward (PipelineConfig.explicit)
    "ticks": lambda cfg, sizes: (f"pipeline.schedule={cfg.pipeline.schedule}"
                                 if sizes.get("stage", 1) > 1 and cfg.pipeline.explicit
                                 else None),
    "context": lambda cfg, sizes: (f"mesh.context={sizes['context']}"
                                   if sizes.get("context", 1) > 1 else None),
    "experts": lambda cfg, sizes: (f"model.moe.num_experts={cfg.model.moe.num_experts}"
                                   if cfg.model.moe.num_experts else None),
    "mtp": lambda cfg, sizes: (f"model.mtp_depth={cfg.model.mtp_depth}" if cfg.model.mtp_depth
                               else None),
    "fp8_delayed": lambda cfg, sizes: "model.fp8=delayed" if cfg.model.fp8 == "delayed" else None,
    "window": lambda cfg, sizes: (f"model.sliding_window={cfg.model.sliding_window}"
                                  if cfg.model.sliding_window else None),
    "mixed_windows": lambda cfg, sizes: (f"model.global_every={cfg.model.global_every}"
                                         if cfg.model.global_every else None),
    "softcap": lambda cfg, sizes: (f"model.attn_softcap={cfg.model.attn_softcap}"
                                   if cfg.model.attn_softcap else None),
}
# (feature, feature) -> the refusal, formatted with each feature's setting
EXCLUSIONS: dict[tuple[str, str], str] = {
    ("ticks", "mtp"): "{ticks} with {mtp}: the 1F1B ticks run the final norm, LM head and loss "
                      "of each microbatch, not the multi-token-prediction modules; use "
                      "pipeline.schedule=gpipe or circular",
    ("context", "experts"): "{context} with {experts}: context parallelism does not run mixtures "
                            "of experts yet; use mesh.expert, mesh.fsdp and mesh.tensor",
    ("fp8_delayed", "pipeline"): "model.fp8=delayed does not run under a pipeline ({pipeline}): "
                                 "its amax histories would be summed over the pipeline's "
                                 "iterations; use model.fp8=tensorwise",
    ("context", "window"): "{context} with {window}: context parallelism does not apply an "
                           "attention window yet; use mesh.fsdp, mesh.tensor or mesh.stage",
    ("pipeline", "mixed_windows"): "{pipeline} with {mixed_windows}: a pipeline's stages run "
                                   "layers that attend alike; use mesh.fsdp and mesh.tensor, or "
                                   "model.global_every=0",
    ("context", "softcap"): "{context} with {softcap}: context parallelism does not soft-cap "
                            "attention scores; use mesh.fsdp, mesh.tensor or mesh.stage",
}


def check(cfg: Config, sizes: Sizes) -> None:
    """Refuse the first pair of features turned on together that do not compose."""
    settings = {name: on(cfg, sizes) for name, on in FEATURES.items()}
    for (a, b), refusal in EXCLUSIONS.items():
        if settings[a] and settings[b]:
            raise ConfigError(refusal.format(**settings))
