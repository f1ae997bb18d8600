"""The per-device memory of a train step on GPUs, estimated from the plan alone (nothing compiled).

The state, the gradients and the activations saved for the backward are alive through the whole
backward; on top of them come, one after the other, the LM head and loss's working set and each
layer's backward, and the larger of the two sets the peak. The terms, per device (b rows per
device per microbatch, T the sequence, t = mesh.tensor):

  params, opt_state     the state as sharded (plan.bytes_per_device)
  grads                 the gradients, in the parameters' dtype and sharding
  grad_accumulation     microbatches: the running sum and this microbatch's stacked gradients
                        (2x params) and the tables' float32 gradients summed whole
  saved_activations     what autodiff keeps per layer run, by remat policy and attention kernel
                        (with a pipeline, every iteration's layers)
  pipeline_buffers      the output buffer [M, b, T/t, D], the inputs spread over the stages
                        [M/S, b, T/t, D], and the moving state
  pipeline_weight_grads the float32 gradients of the stage weights: the running sum and this
                        iteration's (pipeline.grad_sum=whole: the sum whole over fsdp, and this
                        iteration's in the compute dtype)
  pipeline_gathered_weights the stage's weights whole over fsdp in the compute dtype, gathered
                        once per pass and kept through its iterations, forward and backward
  layer_backward        attention's working set (cuDNN: the [b, 1, T, S] mask; XLA: float32
                        scores, their gradient, bf16 probabilities: 11-15 bytes per score), two
                        layers' gathered weights, sequence parallelism's full-sequence [b, T, D]
                        buffers (t > 1), and the tables gathered with their gradients where
                        fsdp or stage split them
  lm_head_and_loss      float32 logits of the loss chunks [b, chunk, V/t] and the same tables
  workspace             cuBLAS / cuDNN scratch and small buffers

`model.attention=auto` is taken as it resolves on GPUs (cuDNN, inside pipeline stages too; XLA in
float32). The coefficients are read off XLA's buffer assignment for H100 (`launch.py --compile-for
h100`, `--xla_dump_to`); `tests/test_aot.py` compiles layouts of small and large models and holds
the sum within 15% of the compiled peak, so a change to the step that moves the peak shows there.
"""

from __future__ import annotations

import math

import jax.numpy as jnp

from jaxtron import attention, parallel, pipeline
from jaxtron.config import Config
from jaxtron.vocab import chunks as loss_chunks

WORKSPACE = 16 * 2**20  # cuBLAS / cuDNN scratch and small buffers: what a tiny model's step holds


def _rows(cfg: Config, sizes: dict[str, int], axes: tuple[str, ...]) -> int:
    """Sequences per device per microbatch when the batch is split over `axes`."""
    ways = 1
    for axis in axes:
        ways *= sizes[axis]
    return max(cfg.train.batch_size // cfg.train.microbatches // ways, 1)


def estimate(cfg: Config, plan) -> dict[str, int]:
    """Bytes per device of every large term of the step on GPUs (see the module docstring)."""
    m, t, sizes = cfg.model, cfg.train, plan.mesh_sizes
    tp, stages = sizes["tensor"], sizes["stage"]
    kernel = attention.resolve(m.attention, "gpu", m.dtype)
    act = jnp.dtype(m.dtype).itemsize
    params = plan.bytes_per_device("params")
    b = _rows(cfg, sizes, ("data", "fsdp"))
    seq, d, v = t.seq_len, m.d_model, m.vocab_size
    layer_weights = (2 * d * m.num_heads * m.head_size + 2 * d * m.num_kv_heads * m.head_size
                     + 3 * d * m.mlp_dim) // tp
    slab = b * seq * d * act // tp  # one layer's input [b, T/t, D]
    tables = (1 if m.tie_embeddings else 2)
    many = math.prod(sizes.values()) > 1
    # The backward of a layer: attention's working set, the sequence-parallel [b, T, D] inputs
    # and partial sums around the tensor collectives, two layers' gathered weights.
    layer = (_attention_bytes(cfg, kernel, b, sizes) + 2 * layer_weights * act
             + (12 * b * seq * d * act if tp > 1 else 0))
    # The embedding and head tables, where fsdp or stage split them: gathered in bf16, and their
    # gradients (4 bytes per entry in all, measured), alive from the LM head's backward through
    # the layers'.
    split = sizes["fsdp"] * stages > 1
    table_bytes = 4 * tables * v * d // tp if split else 0
    layer += table_bytes
    head = _head_bytes(cfg, sizes) + table_bytes
    return {
        "params": params,
        "opt_state": plan.bytes_per_device("opt_state"),
        "grads": params,
        # microbatches: the running sum and this microbatch's stacked gradients, and the float32
        # gradients of the embedding and head tables summed whole
        "grad_accumulation": (2 * params + 4 * tables * v * d // tp
                              if plan.accumulation > 1 else 0),
        "saved_activations": (_layer_runs(cfg, sizes)
                              * _saved_per_layer(cfg, kernel, b, tp, slab, many)),
        **_pipeline_bytes(cfg, plan, slab),
        # The layers' backward and the LM head's come one after the other: the larger counts.
        "layer_backward": layer if layer >= head else 0,
        "lm_head_and_loss": head if head > layer else 0,
        "workspace": WORKSPACE,
    }


def _attention_bytes(cfg: Config, kernel: str, b: int, sizes: dict[str, int]) -> int:
    """One layer's attention working set in the backward. cuDNN: the [b, 1, T, S] mask and its
    float32 bias. XLA: float32 scores and their gradient, bf16 probabilities, the mask: 11 bytes
    per score, 15 where weights move every layer (the scheduler overlaps two layers)."""
    m, seq, tp = cfg.model, cfg.train.seq_len, sizes["tensor"]
    if kernel == "cudnn":
        return 4 * b * seq * seq
    scores = b * m.num_heads * seq * seq // tp
    if m.remat == "none":  # the saved scores are the working set; only their gradient is new
        return 4 * scores
    return scores * (15 if sizes["fsdp"] * tp * sizes["stage"] > 1 else 11)


def _head_bytes(cfg: Config, sizes: dict[str, int]) -> int:
    """The LM head and loss: float32 logits of loss chunks [b, chunk, V/t]: three in flight where
    the chunk loop is double-buffered around collectives, two for one chunk, one on a single
    device."""
    m, t, tp = cfg.model, cfg.train, sizes["tensor"]
    ways = sizes["data"] * sizes["fsdp"] * sizes["stage"]
    rows = max(t.batch_size // (cfg.pipeline.passes if sizes["stage"] > 1 else t.microbatches)
               // ways, 1)
    chunks = loss_chunks(t.seq_len, t.loss_chunk)
    logits = rows * (t.seq_len // chunks) * m.vocab_size // tp * 4
    if math.prod(sizes.values()) == 1:
        return logits
    return (3 if chunks > 1 else 2) * logits


def _saved_per_layer(cfg: Config, kernel: str, b: int, tp: int, slab: int, many: bool) -> int:
    """Bytes autodiff keeps per layer for the backward, by remat policy. With the cuDNN kernel,
    XLA keeps more per layer where collectives run (`many` devices) than on one device: the
    numbers are read off compiled programs."""
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
    if m.remat in ("save_dots", "offload_dots"):  # the projections' and MLP's matmul outputs
        kept = q + kv + 2 * slab + 2 * mlp if kernel == "xla" or many else q + mlp
        return slab if m.remat == "offload_dots" else slab + kept
    everything = 4 * slab + 3 * q + kv + 4 * mlp  # none: every intermediate
    if kernel == "cudnn":  # float32 norms and activations besides; no scores (softmax stats)
        return 3 * everything // 2 if many else 2 * everything
    # the XLA attention's float32 scores, bf16 probabilities and mask are kept too
    return everything + b * m.num_heads * seq * seq * (4 + act + 1) // tp


def _layer_runs(cfg: Config, sizes: dict[str, int]) -> int:
    """Layer applications one device keeps activations of: its layers, or with a pipeline every
    iteration's L/(S*R) layers (all M*R + S - 1 iterations are alive at the backward's start)."""
    pipe = pipeline.from_config(cfg, sizes["stage"])
    if pipe is None:
        return cfg.model.num_layers
    return pipe.iterations * (cfg.model.num_layers // (pipe.stages * pipe.repeats))


def _pipeline_bytes(cfg: Config, plan, slab: int) -> dict[str, int]:
    """The stage buffers (the outputs [M, b, T/t, D], the inputs spread M/S per stage, the moving
    state), and the float32 gradients of the stage weights: each iteration's beside their running
    sum (reduced over `data` in every iteration, not once per step; measured as two copies of the
    stage's weights in the 70B preset's buffer assignment, gpipe and circular)."""
    pipe = pipeline.from_config(cfg, plan.mesh_sizes["stage"])
    if pipe is None:
        return {"pipeline_buffers": 0, "pipeline_weight_grads": 0, "pipeline_gathered_weights": 0}
    layers = parallel.bytes_per_device(plan.abstract["params"]["layers"],
                                       plan.specs["params"]["layers"], plan.mesh_sizes)
    spread = -(-pipe.microbatches // pipe.stages)  # the inputs, spread K per stage
    fsdp = plan.mesh_sizes["fsdp"]
    compute = jnp.dtype(cfg.model.dtype).itemsize / jnp.dtype(cfg.model.param_dtype).itemsize
    if pipe.grad_sum == "whole" and fsdp > 1:
        # The running float32 sum whole over fsdp, and this iteration's gradient of the whole
        # stage in the compute dtype (70B, TP8/PP2/FSDP8 on 128 H100s, M=16 and 64: 23.6 and
        # 25.8 GiB over the sharded sum's peak, against 1.5 x 16.3 GiB here).
        grads = layers * fsdp + int(layers * fsdp * compute)
    else:  # With passes (accumulation around the pipeline) the pass's sum is grad_accumulation's.
        grads = 2 * layers if plan.accumulation == 1 else 0
    return {"pipeline_buffers": (pipe.microbatches + 2 + spread) * slab,
            "pipeline_weight_grads": grads,
            # the stage's weights gathered over fsdp once per pass, in the compute dtype
            "pipeline_gathered_weights": int(layers * fsdp * compute) if fsdp > 1 else 0}
