"""Run configuration: the typed schema (schema.py; its model section, model.py), the presets and
overrides as written (presets.py), and the one error bad input raises (errors.py)."""

from jaxtron.config.schema import (  # noqa: F401 - the names callers take from the package
    FLAT_MOE,
    SOURCES,
    CheckpointConfig,
    Config,
    ConfigError,
    DataConfig,
    DatasetEntry,
    MeshConfig,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    PipelineConfig,
    RunConfig,
    TrainConfig,
    XlaConfig,
    check_warnings,
    load,
    model_config,
    nested,
    to_yaml,
)
