"""A compiled program and how it is read: the train step compiled for a GPU cluster that is not
here, its optimized HLO (kernels, collectives and their overlap, FLOPs) and the XLA flag presets
it compiles with."""
