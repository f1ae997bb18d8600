"""What each mesh axis does and where it belongs, outermost first: the mesh's axes are these
(parallel.MESH_AXES), and the README's axis table is made from them (scripts/doc_tables.py)."""

# Outermost to innermost: axes late in the order get neighbouring devices (NVLink within a node),
# so tensor, expert, context and fsdp traffic stays on the fastest links and data/stage cross nodes.
AXIS_ROLES = {
    "data": ("pure data parallelism: replicated weights, all-reduced gradients", "across nodes"),
    "stage": ("pipeline parallelism over stacked layers: `gpipe`, `circular` (interleaved), "
              "`1f1b`, `interleaved_1f1b` or `zb_h1` schedule", "across nodes"),
    "fsdp": ("ZeRO-3: weights, gradients and optimizer state sharded, batch split too",
             "within or across nodes"),
    "context": ("each sequence split (context parallelism, load-balanced for causal masks), "
                "K/V gathered inside attention; weights sharded over it too (ZeRO-3)",
                "within a node"),
    "expert": ("a mixture of experts' experts split over it (tokens go round the expert ring), "
               "the other weights and the batch as `fsdp`", "within a node"),
    "tensor": ("Megatron tensor parallelism over heads and MLP columns/rows, sequence-parallel "
               "between blocks", "within a node (NVLink)"),
}
