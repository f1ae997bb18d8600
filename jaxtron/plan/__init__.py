"""What a step costs before it runs: the memory estimate and the remat/microbatch choice it
drives, the compile for GPUs that are not here and the reading of its HLO (FLOPs, collectives),
the layout planner, the XLA flag presets, and the benchmarks against the compiled step."""
