"""The per-device memory of a train step, estimated from the plan alone (nothing compiled).

The peak of a step is in the backward pass: the state, the gradients, every activation saved for
the backward, and the working set of the layer being differentiated. The terms, per device (b rows
per device per microbatch, T the sequence, t = mesh.tensor, A = b * N/t * T^2 attention scores):

  params, opt_state     the state as sharded (plan.bytes_per_device)
  grads                 the gradients, in the parameters' dtype and sharding
  grad_accumulation     microbatches: the running sum and this microbatch's stacked gradients
                        (2x params), and the LM head's logits no longer overlapped with the layers
  weights_gathered      two layers' weights gathered over fsdp in the compute dtype (the one in
                        use and the next one's prefetch), and the embedding and head tables
  saved_activations     what autodiff keeps per layer run, by remat policy (with a pipeline, every
                        iteration's layers)
  attention             the XLA attention's working set: float32 scores and their gradient, bf16
                        probabilities, the mask: 11 bytes per score; 15 where weights move every
                        layer, since the scheduler overlaps two layers' backward
  sequence_parallel     t > 1: the full-sequence [b, T, D] inputs and partial sums around the
                        all-gathers and reduce-scatters
  logits                float32 logits [b, T, V/t] and their gradient; on one device they come
                        after the layers' backward and reuse its memory
  pipeline_buffers      the stage buffers [M, b, T/t, D] and the moving state
  pipeline_weight_copies  the stage's weights kept once per pipeline iteration (see below)
  workspace             cuBLAS / cuDNN scratch and small buffers

The coefficients are read off XLA's buffer assignment for H100 (`launch.py --compile-for h100`,
`--xla_dump_to`); `tests/test_aot.py` compiles layouts of small and large models and holds the sum
within 15% of the compiled peak, so a change to the step that moves the peak shows up there.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxtron import parallel, pipeline
from jaxtron.config import Config

WORKSPACE = 16 * 2**20  # cuBLAS / cuDNN scratch and small buffers: what a tiny model's step holds


def _rows(cfg: Config, sizes: dict[str, int], axes: tuple[str, ...]) -> int:
    """Sequences per device per microbatch when the batch is split over `axes`."""
    ways = 1
    for axis in axes:
        ways *= sizes[axis]
    return max(cfg.train.batch_size // cfg.train.microbatches // ways, 1)


def estimate(cfg: Config, plan) -> dict[str, int]:
    """Bytes per device of every large term of the step (see the module docstring)."""
    m, t, sizes = cfg.model, cfg.train, plan.mesh_sizes
    tp, stages = sizes["tensor"], sizes["stage"]
    act = jnp.dtype(m.dtype).itemsize
    params = plan.bytes_per_device("params")
    b = _rows(cfg, sizes, ("data", "fsdp"))
    b_io = _rows(cfg, sizes, ("data", "fsdp", "stage")) if stages > 1 else b
    seq, d, v = t.seq_len, m.d_model, m.vocab_size
    tables = 1 if m.tie_embeddings else 2
    layer_weights = (2 * d * m.num_heads * m.head_size + 2 * d * m.num_kv_heads * m.head_size
                     + 3 * d * m.mlp_dim) // tp
    slab = b * seq * d * act // tp  # one layer's input [b, T/t, D]
    sharded = sizes["fsdp"] * tp * stages > 1  # weights move in every layer
    scores = b * m.num_heads * seq * seq // tp  # one layer's attention scores [b, N/t, T, T]
    logits = b_io * seq * v // tp  # [b, T, V/t]
    # Single device: the LM head's buffers and a layer's backward come one after the other and
    # share memory; with collectives the scheduler overlaps them (and two layers' attention).
    attention = scores * (15 if sharded else 11)
    if m.remat == "none":  # the saved scores are the working set; only their gradient is new
        attention = scores * 4
    head = 4 * logits if math.prod(sizes.values()) > 1 else max(8 * logits - attention, 0)
    # Sequence parallelism: the full-sequence [b, T, D] input of attention and the MLP, and their
    # partial sums before the reduce-scatter, forward and backward.
    sequence_parallel = 6 * b * seq * d * act if tp > 1 else 0
    gathered = 2 * layer_weights * act + (3 * tables * v * d // tp if sizes["fsdp"] > 1 else 0)
    return {
        "params": params,
        "opt_state": plan.bytes_per_device("opt_state"),
        "grads": params,
        # microbatches: the running sum and this microbatch's stacked gradients; the head's
        # logits are no longer overlapped with the layers
        "grad_accumulation": 2 * params + 4 * logits if plan.accumulation > 1 else 0,
        "weights_gathered": gathered,
        "saved_activations": _layer_runs(cfg, sizes) * _saved_per_layer(cfg, b, tp, slab),
        "attention": attention,
        "sequence_parallel": sequence_parallel,
        "logits": head,
        **_pipeline_bytes(cfg, plan, slab),
        "workspace": WORKSPACE,
    }


def _saved_per_layer(cfg: Config, b: int, tp: int, slab: int) -> int:
    """Bytes autodiff keeps per layer for the backward, by remat policy."""
    m, seq = cfg.model, cfg.train.seq_len
    act = jnp.dtype(m.dtype).itemsize
    q = b * seq * m.num_heads * m.head_size * act // tp
    kv = 2 * b * seq * m.num_kv_heads * m.head_size * act // tp
    mlp = b * seq * m.mlp_dim * act // tp
    if m.remat == "full":
        return slab
    if m.remat == "save_attn_out":
        return slab + q
    if m.remat == "save_qkv_out":
        return slab + 2 * q + kv
    if m.remat in ("save_dots", "offload_dots"):  # q, k, v, o, gate, up, down projections
        kept = q + kv + 2 * slab + 2 * mlp
        return slab if m.remat == "offload_dots" else slab + kept
    # none: everything, the attention's float32 scores, bf16 probabilities and mask included
    scores = b * m.num_heads * seq * seq * (4 + act + 1) // tp
    return 4 * slab + 3 * q + kv + 4 * mlp + scores


def _layer_runs(cfg: Config, sizes: dict[str, int]) -> int:
    """Layer applications one device keeps activations of: its layers, or with a pipeline every
    iteration's L/(S*R) layers (all M*R + S - 1 iterations are alive at the backward's start)."""
    pipe = pipeline.from_config(cfg, sizes["stage"])
    if pipe is None:
        return cfg.model.num_layers
    return pipe.iterations * (cfg.model.num_layers // (pipe.stages * pipe.repeats))


def _pipeline_bytes(cfg: Config, plan, slab: int) -> dict[str, int]:
    """The stage buffers ([M, b, T/t, D] in and out, plus the moving state), and the copies of
    the stage's weights that the backward keeps: one repeat's layer group, in the parameter dtype,
    per iteration (the group is picked with a dynamic index on the iteration's repeat, so autodiff
    saves the picked weights as a residual of every iteration)."""
    pipe = pipeline.from_config(cfg, plan.mesh_sizes["stage"])
    if pipe is None:
        return {"pipeline_buffers": 0, "pipeline_weight_copies": 0}
    layers = parallel.bytes_per_device(plan.abstract["params"]["layers"],
                                       plan.specs["params"]["layers"], plan.mesh_sizes)
    return {"pipeline_buffers": (pipe.microbatches + 2) * slab,
            "pipeline_weight_copies": pipe.iterations * layers // pipe.repeats}
