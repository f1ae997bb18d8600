"""Llama-family decoder in Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU, scanned layers.

Covers Llama 2/3 (Llama-3 RoPE scaling), Mistral and Qwen2 (QKV bias, tied embeddings) shapes.
Weights and activations carry logical axis names only; `parallel.RULES` decides how they are
sharded, and the operations set (jaxtron/ops/layer_ops.py) how each operation runs on the mesh.
`Transformer.decode` runs the same modules over a KV cache, for generation
(jaxtron/model/generate.py).

Shape key: B batch, T sequence, D d_model, N query heads, K kv heads, H head size, F mlp width,
V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from jaxtron.config import ModelConfig
from jaxtron.model import families, moe, windows
from jaxtron.model.layers import RMSNorm, apply_rope, rope_frequencies
from jaxtron.model.layers import param as _param
from jaxtron.model.settings import REMAT_POLICIES
from jaxtron.ops import attention as attention_lib
from jaxtron.ops import fp8, layer_ops, vocab
from jaxtron.ops.layer_ops import LayerOps
from jaxtron.parallel import constrain

# The most layers of a stack that XLA unrolls whole (`_run_stack`), read off H100 compiles with
# the gpu preset's loop double buffering (xla_flags.XLA_PRESETS): stacks of 2 and 3 layers came
# out unrolled, of 4 and 8 as loops
UNROLLED_STACK = 3


BATCH_SEQ = ("act_batch", "act_seq")  # between blocks: sequence split over tensor (RULES)
# inside attention/MLP: heads or mlp split, the context rank's positions whole
BATCH_WHOLE_SEQ = ("act_batch", "act_ctx")
IO_SEQ = ("act_batch_io", "act_seq")  # embedding and LM head: the pipeline stages split the batch


class Attention(nnx.Module):
    """Grouped-query attention: q, k, v projections (biases with model.qkv_bias, per-head norms
    of class `norm` with model.qk_norm), RoPE, the attention kernel, the output projection."""

    norm: type = RMSNorm

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, n, k, h = cfg.d_model, cfg.num_heads, cfg.num_kv_heads, cfg.head_size
        self.cfg = cfg
        self.wq = _param(rngs, cfg, (d, n, h), ("embed", "heads", "head_dim"))
        self.wk = _param(rngs, cfg, (d, k, h), ("embed", "kv_heads", "head_dim"))
        self.wv = _param(rngs, cfg, (d, k, h), ("embed", "kv_heads", "head_dim"))
        self.wo = _param(rngs, cfg, (n, h, d), ("heads", "head_dim", "embed"))
        if cfg.qk_norm:
            self.q_norm, self.k_norm = self.norm(cfg, rngs, h), self.norm(cfg, rngs, h)
        if cfg.qkv_bias:
            self.bq = _param(rngs, cfg, (n, h), ("heads", "head_dim"), value=0.0)
            self.bk = _param(rngs, cfg, (k, h), ("kv_heads", "head_dim"), value=0.0)
            self.bv = _param(rngs, cfg, (k, h), ("kv_heads", "head_dim"), value=0.0)
        for name, value in fp8.histories(cfg.fp8, cfg.fp8_history, 2, 4).items():  # q/k/v, o
            setattr(self, name, value)

    def _projections(self, x_BTD, ops: LayerOps) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q[B, T, N, H], k and v [B, T, K, H], heads split over tensor, sequence whole."""
        q, k, v = ops.project_in(x_BTD, (self.wq, self.wk, self.wv), fp8.sites(self, 0, range(3)))
        if self.cfg.qkv_bias:
            q, k, v = (y + ops.weight(b) for y, b in zip((q, k, v), (self.bq, self.bk, self.bv)))
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return (constrain(q, (*BATCH_WHOLE_SEQ, "act_heads", None)),
                constrain(k, (*BATCH_WHOLE_SEQ, "act_kv_heads", None)),
                constrain(v, (*BATCH_WHOLE_SEQ, "act_kv_heads", None)))

    def _rotated(self, x_BTD, positions_BT, inv_freq, ops: LayerOps
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """q, k, v with RoPE at `positions` on q and k, tagged for the remat policies."""
        q_BTNH, k_BTKH, v_BTKH = self._projections(x_BTD, ops)
        v_BTKH = checkpoint_name(v_BTKH, "value_proj")
        q_BTNH = checkpoint_name(apply_rope(q_BTNH, positions_BT, inv_freq), "query_proj")
        k_BTKH = checkpoint_name(apply_rope(k_BTKH, positions_BT, inv_freq), "key_proj")
        return q_BTNH, k_BTKH, v_BTKH

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, inv_freq, ops: LayerOps,
                 local: jax.Array | bool = False) -> jax.Array:
        """`local`: whether this layer attends within model.sliding_window (windows.py), a bool,
        or traced where the layers of a scanned stack differ (then both kernels are compiled
        and a `lax.cond` runs one)."""
        q_BTNH, k_BTKH, v_BTKH = self._rotated(x_BTD, positions_BT, inv_freq, ops)
        window, softcap, sinks = self.cfg.sliding_window, self.cfg.attn_softcap, self._sinks()
        if isinstance(local, bool):
            out_BTNH = ops.attend(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT,
                                  window=window if local else 0, softcap=softcap, sinks=sinks)
        else:
            out_BTNH = ops.attend_either(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, local, window,
                                         softcap, sinks)
        return self._output(out_BTNH, ops)

    def decode(self, x_BTD, start, inv_freq, k_BSKH, v_BSKH, ops: LayerOps,
               local: jax.Array | bool = False):
        """(output, k and v caches) for T tokens at positions and cache slots start..start+T-1:
        their keys and values are written there, then the queries read the cache (within the
        window where `local`)."""
        positions_BT = jnp.broadcast_to(start + jnp.arange(x_BTD.shape[1]), x_BTD.shape[:2])
        q_BTNH, k_BTKH, v_BTKH = self._rotated(x_BTD, positions_BT, inv_freq, ops)
        at = (0, start, 0, 0)
        k_BSKH = jax.lax.dynamic_update_slice(k_BSKH, k_BTKH.astype(k_BSKH.dtype), at)
        v_BSKH = jax.lax.dynamic_update_slice(v_BSKH, v_BTKH.astype(v_BSKH.dtype), at)
        window = jnp.where(local, self.cfg.sliding_window, 0)
        out_BTNH = attention_lib.cached_attention(q_BTNH, k_BSKH, v_BSKH, start, window,
                                                  self.cfg.attn_softcap, self._sinks())
        return self._output(out_BTNH, ops), k_BSKH, v_BSKH

    def _sinks(self) -> jax.Array | None:
        """Each head's sink logit [N] in the softmax (gpt-oss's), None for none."""
        return None

    def _output(self, out_BTNH, ops: LayerOps) -> jax.Array:
        """The heads' outputs projected back to the model width [B, T, D]."""
        out_BTNH = checkpoint_name(constrain(out_BTNH, (*BATCH_WHOLE_SEQ, "act_heads", None)),
                                   "attn_out")
        return ops.project_out(out_BTNH, self.wo, self._output_sites())

    def _output_sites(self) -> fp8.Sites | None:
        """The FP8 histories of the output projection: input 1, weight 3 (after q, k, v)."""
        return fp8.sites(self, 1, range(3, 4))


class MLP(nnx.Module):
    """SwiGLU: down(silu(x W_gate) * (x W_up)), model.mlp_dim wide or `width` (DeepSeek's
    shared experts); another gate `activation` in a subclass (Gemma's GeGLU)."""

    activation = staticmethod(jax.nn.silu)

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, width: int = 0):
        d, f = cfg.d_model, width or cfg.mlp_dim
        self.cfg = cfg
        self.w_gate = _param(rngs, cfg, (d, f), ("embed", "mlp"))
        self.w_up = _param(rngs, cfg, (d, f), ("embed", "mlp"))
        self.w_down = _param(rngs, cfg, (f, d), ("mlp", "embed"))
        for name, value in fp8.histories(cfg.fp8, cfg.fp8_history, 2, 3).items():  # gate/up, down
            setattr(self, name, value)

    def __call__(self, x_BTD: jax.Array, ops: LayerOps) -> jax.Array:
        gate_BTF, up_BTF = ops.project_in(x_BTD, (self.w_gate, self.w_up),
                                          fp8.sites(self, 0, range(2)))
        h_BTF = constrain(self.activation(gate_BTF) * up_BTF, (*BATCH_WHOLE_SEQ, "act_mlp"))
        return ops.project_out(h_BTF, self.w_down, fp8.sites(self, 1, range(2, 3)))


class Block(nnx.Module):
    """Pre-norm decoder layer: x + attn(norm(x)), then x + mlp(norm(x)); the MLP a mixture of
    experts when model.moe.num_experts > 0 (jaxtron/model/moe.py). A family with other
    attention or MLP modules (same calls) names them in a subclass: `attention`, `mixer`."""

    attention: type = None  # the attention module's class; None: grouped-query `Attention`
    mixer: type = None  # the MLP's class; None: moe.MoE with experts, else `MLP`
    norm: type = RMSNorm  # the norms' class

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = self.norm(cfg, rngs)
        self.attn = (self.attention or Attention)(cfg, rngs)
        self.mlp_norm = self.norm(cfg, rngs)
        self.mlp = (self.mixer or (moe.MoE if cfg.moe.num_experts else MLP))(cfg, rngs)

    def __call__(self, x_BTD, positions_BT, segment_ids_BT, inv_freq, ops: LayerOps,
                 local: jax.Array | bool = False) -> tuple[jax.Array, dict]:
        """(x [B, T, D], the MoE router's sums, moe.STAT_KEYS; {} for a dense layer). `local`:
        attention within the window (Attention)."""
        h_BTD = ops.whole_seq(self.attn_norm(x_BTD))
        x_BTD = x_BTD + self.attn(h_BTD, positions_BT, segment_ids_BT, inv_freq, ops, local)
        x_BTD = constrain(x_BTD, (*BATCH_SEQ, "act_embed"))
        y_BTD, stats = self._mlp(ops.whole_seq(self.mlp_norm(x_BTD)), segment_ids_BT, ops)
        return constrain(x_BTD + y_BTD, (*BATCH_SEQ, "act_embed")), stats

    def _mlp(self, h_BTD, segment_ids_BT, ops: LayerOps) -> tuple[jax.Array, dict]:
        if isinstance(self.mlp, moe.MoE):
            return self.mlp(h_BTD, segment_ids_BT, ops)
        return self.mlp(h_BTD, ops), {}

    def decode(self, x_BTD, start, inv_freq, k_BSKH, v_BSKH, ops: LayerOps,
               local: jax.Array | bool = False):
        """The same layer over a KV cache (Attention.decode): (x, k and v caches)."""
        out_BTD, k_BSKH, v_BSKH = self.attn.decode(self.attn_norm(x_BTD), start, inv_freq,
                                                   k_BSKH, v_BSKH, ops, local)
        x_BTD = x_BTD + out_BTD
        return x_BTD + self._mlp(self.mlp_norm(x_BTD), None, ops)[0], k_BSKH, v_BSKH


class Transformer(nnx.Module):
    """Embedding, the stacks of layers (`stacks`), final norm and LM head. A family whose layers
    differ subclasses it with its own `stacks`, `cache_heads` and `projections`."""

    # the projections' weights: model.weights_ahead fetches them in the compute dtype, the
    # other weights split over `embed` (a router's) as stored (ops/ahead.py)
    projections = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")
    norm: type = RMSNorm  # the final norm's class

    @staticmethod
    def rope(cfg: ModelConfig) -> Any:
        """What the layers' attention takes as its RoPE frequencies (`inv_freq`): one array of
        inverse frequencies [H/2] here; a family with other bases per layer kind, its own."""
        return rope_frequencies(cfg)

    @staticmethod
    def stacks(cfg: ModelConfig) -> tuple[tuple[str, int, type], ...]:
        """The stacks of layers in order, each scanned: (attribute, layers, block class). The
        last is `layers`, the one a pipeline's stages may split; the ones before run whole."""
        return (("layers", cfg.num_layers, Block),)

    @staticmethod
    def cache_heads(cfg: ModelConfig) -> tuple[int, int, int]:
        """What a layer's KV cache holds per slot: (heads, key size, value size)."""
        return cfg.num_kv_heads, cfg.head_size, cfg.head_size

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embed = _param(rngs, cfg, (cfg.vocab_size, cfg.d_model), ("vocab", "embed"))
        stacks = self.stacks(cfg)
        for i, (name, count, block) in enumerate(stacks):  # only the last splits over stages
            axis = "layers" if i == len(stacks) - 1 else "stack"
            setattr(self, name, stacked(block, cfg, count, rngs, axis))
        self.final_norm = self.norm(cfg, rngs)
        if not cfg.tie_embeddings:
            self.lm_head = _param(rngs, cfg, (cfg.d_model, cfg.vocab_size), ("embed", "vocab"))

    def __call__(self, tokens_BT, positions_BT, segment_ids_BT, ops: LayerOps | None = None
                 ) -> jax.Array:
        """Token ids -> float32 logits[B, T, V] in natural order (whole: for inspection and
        parity checks; the train step's loss takes `hidden` and `head` and never holds them all
        at once). `ops`: the operations set (none: the ambient mesh's, layer_ops.here)."""
        ops = ops or layer_ops.here(self.cfg)
        x_BTD, _, _ = self.hidden({"tokens": tokens_BT, "positions": positions_BT,
                                   "segment_ids": segment_ids_BT}, ops)
        return ops.unbalance(self._logits(x_BTD))

    def decode(self, tokens_BT, cache: dict, start) -> tuple[jax.Array, dict]:
        """(float32 logits [B, T, V], the updated cache) of tokens [B, T] at positions and cache
        slots start..start+T-1 of each row's one sequence, attending to the cache's earlier
        slots (`init_cache`): the prompt in one call, then one token per call. The same modules
        and weights as the training forward; no segments, no remat, never under a mesh, and
        attention in the XLA reference math whatever model.attention says."""
        ops = layer_ops.build(self.cfg, None)
        x_BTD = self._embed(tokens_BT, ops)
        inv_freq = self.rope(self.cfg)
        updated, first = {}, 0
        for name, count, _ in self.stacks(self.cfg):
            graphdef, stacked = nnx.split(getattr(self, name))
            local_L = jnp.broadcast_to(windows.stack_kinds(self.cfg, first, count), (count,))
            first += count

            def body(x_BTD, layer, graphdef=graphdef):
                state, k_BSKH, v_BSKH, local = layer
                x_BTD, k_BSKH, v_BSKH = nnx.merge(graphdef, state).decode(
                    x_BTD, start, inv_freq, k_BSKH, v_BSKH, ops, local)
                return x_BTD, (k_BSKH, v_BSKH)

            x_BTD, (k, v) = jax.lax.scan(body, x_BTD, (stacked, cache[name]["k"],
                                                       cache[name]["v"], local_L))
            updated[name] = {"k": k, "v": v}
        return self._logits(self.final_norm(x_BTD)), updated

    def hidden(self, batch: dict, ops: LayerOps) -> tuple[jax.Array, dict, dict]:
        """A batch of [B, T] arrays in natural order (tokens, positions, segment_ids; others,
        such as targets, ride along) -> (the final-normed hidden states [B, T, D] that the LM
        head reads, the batch in their order (`ops.balance`), the MoE layers' router sums
        stacked [L, ...] per moe.STAT_KEYS, {} for a dense model)."""
        x_BTD, batch, run_group, stacked = self._to_layers(batch, ops)
        x_BTD, stats = ops.run_layers(run_group, stacked, x_BTD, batch["positions"],
                                      batch["segment_ids"], rows=moe.PER_ROW)
        stats = self._after_layers(x_BTD, batch, stats, ops)
        return self.final_norm(constrain(x_BTD, (*IO_SEQ, "act_embed"))), batch, stats

    def staged_loss(self, batch: dict, ops: LayerOps, chunk: int
                    ) -> tuple[jax.Array, jax.Array, dict, dict]:
        """(the summed objective, the summed cross-entropy over batch["segment_ids"] != 0, the
        router sums moe.step_sums of the batch ({} for a dense model), the batch in the order
        the model ran on) with the last stack through a 1F1B pipeline (ops.pipe.explicit),
        which runs the final norm, the LM head, the loss and the router's objective of each
        microbatch itself (parallel/one_f_one_b.py). Without multi-token prediction
        (parallel/features.py)."""
        x_BTD, batch, run_group, stacked = self._to_layers(batch, ops)
        norm_graph, norm_state = nnx.split(self.final_norm)
        cfg = self.cfg

        def tail(params, x_bTD, targets_bT, mask_bT, strided=False):
            norm, head = params
            x_bTD = nnx.merge(norm_graph, norm)(x_bTD)
            head_DV = (head.T if cfg.tie_embeddings else head).astype(cfg.dtype)
            return vocab.plain_total(x_bTD, head_DV, targets_bT, mask_bT, chunk,
                                     cfg.logit_softcap, strided)

        mask_BT = batch["segment_ids"] != 0
        router = moe.Router.of(cfg) if cfg.moe.num_experts else None
        objective, entropy, sums = ops.staged_loss(
            run_group, tail, stacked, (norm_state, self.head_weight()), x_BTD,
            batch["positions"], batch["segment_ids"], batch["targets"], mask_BT, router)
        return objective, entropy, sums, batch

    def _to_layers(self, batch: dict, ops: LayerOps) -> tuple[jax.Array, dict, Callable, Any]:
        """(the embeddings through the stacks before the last [B, T, D], the batch balanced,
        the last stack's runner `run_group(stacked, x, positions, segment_ids, select=)`, its
        stacked weights)."""
        if ops.cfg != self.cfg:
            raise ValueError("the operations set was built for another model config")
        batch = ops.balance(batch)
        x_BTD, first = self._embed(batch["tokens"], ops), 0
        for name, count, _ in self.stacks(self.cfg)[:-1]:  # whole, before `layers`: no statistics
            graphdef, stacked = nnx.split(getattr(self, name))
            x_BTD, _ = _run_stack(self.cfg, ops.for_layers(), graphdef, stacked, x_BTD,
                                  batch["positions"], batch["segment_ids"],
                                  names=self.projections, first=first)
            first += count
        graphdef, stacked = nnx.split(self.layers)
        run_group = functools.partial(_run_stack, self.cfg, ops.for_layers(), graphdef,
                                      names=self.projections, first=first)
        return x_BTD, batch, run_group, stacked

    def _after_layers(self, x_BTD, batch: dict, stats: dict, ops: LayerOps) -> dict:
        """What a family adds to the statistics from the last layer's output (before the final
        norm): nothing here; DeepSeek's multi-token prediction (deepseek.py)."""
        del x_BTD, batch, ops
        return stats

    def _embed(self, tokens_BT, ops: LayerOps) -> jax.Array:
        """Token ids -> embeddings [B, T, D] in the compute dtype."""
        return constrain(ops.embed(self.embed[...], tokens_BT), (*IO_SEQ, "act_embed"))

    def _logits(self, x_BTD) -> jax.Array:
        """float32 logits [B, T, V] of final-normed hidden states."""
        return constrain(vocab.logits(x_BTD, self.head(), self.cfg.logit_softcap),
                         ("act_batch_io", None, "act_vocab"))

    def head(self) -> jax.Array:
        """The LM head [D, V] in the compute dtype, gathered like the table (vocab split over
        tensor); tied models read the embedding's table."""
        head_DV = self.head_weight().T if self.cfg.tie_embeddings else self.head_weight()
        return constrain(head_DV.astype(self.cfg.dtype), (None, "act_vocab"))

    def head_weight(self) -> jax.Array:
        """The LM head as stored: lm_head [D, V], or with tied embeddings the table [V, D]."""
        return self.embed[...] if self.cfg.tie_embeddings else self.lm_head[...]


def stacked(block: type, cfg: ModelConfig, count: int, rngs: nnx.Rngs, axis: str = "stack"
            ) -> nnx.Module:
    """`count` layers of `block` with their weights stacked on a leading axis named `axis`:
    `layers` for the stack a pipeline's stages split, `stack` for one every stage runs whole
    (the layers before it, DeepSeek's multi-token-prediction modules; parallel.RULES)."""

    @nnx.vmap(in_axes=0, out_axes=0, transform_metadata={nnx.PARTITION_NAME: axis})
    def stacked_blocks(key):
        return block(cfg, nnx.Rngs(params=key))

    return stacked_blocks(jax.random.split(rngs.params(), count))


def _run_stack(cfg: ModelConfig, ops: LayerOps, graphdef, stacked, x_BTD, positions_BT,
               segment_ids_BT, select: Callable[[Any], Any] | None = None,
               names: tuple[str, ...] = Transformer.projections, first: int = 0):
    """A stack of layers [L', ...]: one scanned (or unrolled) body, remat per policy; returns
    (x, each layer's MoE statistics stacked [L', ...]). `select`, if given, maps each layer's
    stored weights to the ones it runs with, inside the layer body (the pipeline picks a
    repeat's weights there, so the pick is never a saved residual). `names`: the projections'
    weights (Transformer.projections), which model.weights_ahead fetches in the compute dtype.
    `first`: the model's index of the stack's first layer, for its attention window; where the
    layers' windows differ, each layer's rides with its weights (windows.stack_kinds)."""
    inv_freq = families.model_class(cfg).rope(cfg)
    layers = jax.tree.leaves(stacked)[0].shape[0]
    kinds = windows.stack_kinds(cfg, first, layers)
    if not isinstance(kinds, bool):
        stacked = (stacked, jnp.asarray(kinds))

    def body(x, layer_state):
        state, local = (layer_state, kinds) if isinstance(kinds, bool) else layer_state
        block = nnx.merge(graphdef, select(state) if select else state)
        return block(x, positions_BT, segment_ids_BT, inv_freq, ops, local)

    if cfg.remat != "none":
        # A scan keeps the recompute from sharing the forward's work, but XLA unrolls a stack
        # of a few layers whole, and then the recompute shares the forward's weight gathers:
        # every layer's gathered weights held through the step (DeepSeek-V3 cut to 3 dense and
        # 2 MoE layers on 1,024 H100s: 13.25 GiB compiled, against 9.20 with prevent_cse). On
        # longer stacks (which stay loops) prevent_cse costs overlap: Qwen3-30B-A3B on 8 H100s
        # left 10.0 GiB of traffic exposed with it against 6.0 without.
        body = jax.checkpoint(body, policy=REMAT_POLICIES[cfg.remat],
                              prevent_cse=not cfg.scan_layers or layers <= UNROLLED_STACK)
    if cfg.scan_layers:
        return ops.scan_layers(body, x_BTD, stacked, names if select is None else None)
    stats = []
    for i in range(layers):
        x_BTD, layer_stats = body(x_BTD, jax.tree.map(lambda a: a[i], stacked))
        stats.append(layer_stats)
    return x_BTD, jax.tree.map(lambda *a: jnp.stack(a), *stats)


def in_compute_dtype(cfg: ModelConfig) -> ModelConfig:
    """The same model with its matmuls in the compute dtype (model.fp8=none), as generation and
    the Hugging Face forward run it: the master weights and nothing else, no FP8 histories."""
    return dataclasses.replace(cfg, fp8="none")


def init_cache(cfg: ModelConfig, batch: int, length: int) -> dict:
    """An empty KV cache for `Transformer.decode`: per stack of layers (Transformer.stacks),
    k [L', B, S, K, Hk] and v [L', B, S, K, Hv] of `length` slots (cache_heads), in the compute
    dtype (keys stored rotated)."""
    model = families.model_class(cfg)
    heads, key, value = model.cache_heads(cfg)
    zeros = lambda count, size: jnp.zeros((count, batch, length, heads, size), cfg.dtype)
    return {name: {"k": zeros(count, key), "v": zeros(count, value)}
            for name, count, _ in model.stacks(cfg)}


def count_params(state: nnx.State) -> int:
    """Total number of parameters in a (possibly abstract) state."""
    return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(state))
