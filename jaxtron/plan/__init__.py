"""A run's plan: its layout (mesh, schedule, microbatches, remat) and what that costs before
anything compiles: the memory estimate and the choice it drives, the FLOP formulas, the set-up
every entry point builds the same way, and the planner that ranks layouts."""
