"""The operations the model calls and how each runs on the mesh: projections (fsdp gathers,
collective matmuls, FP8), attention kernels and the context split, the embedding and the head's
chunked loss, the experts. layer_ops.py builds the set once from the config and the mesh."""
