"""The operations set: the few operations the model calls, chosen once from its config and the
mesh, so that the model says what it computes and this package says how it runs.

Set-up builds a `LayerOps` from the mesh's axis sizes (`build`; the step's plan holds it);
callers without a set-up (generation, the Hugging Face forward, tests) take the one the ambient
mesh implies (`here`). Each operation picks its implementation from the set's fields, never
from the mesh at the point of the call:

- project in / project out: plain, fsdp-gathered, collective matmul, FP8 (projections.py);
- attend: XLA, cuDNN, the context-parallel split (attention.py, context_attention.py);
- embed, and the head with its chunked loss (vocab.py);
- experts: the ring over `expert`, grouped kernels (experts.py);
- run the layer stack: in order (each layer's weights fetched a layer ahead with
  model.weights_ahead, ahead.py), or through the pipeline's stages (parallel/pipeline.py).

The context order has one contract: the model's entry points take batches in natural order and
`balance` them here; the hidden states come back in the order `balance` made (under context
parallelism each rank's two pieces), with the batch in that order beside them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

import jax
from flax import nnx

from jaxtron.config import ModelConfig
from jaxtron.ops import ahead, attention, context_attention, experts, fp8, projections, vocab
from jaxtron.parallel import constrain, context, one_f_one_b, pipeline

# between blocks, the rows and the sequence as split over the batch axes and tensor
_WHOLE_SEQ = ("act_batch", "act_ctx", "act_embed")


@dataclasses.dataclass(frozen=True)
class LayerOps:
    """The model's operations for one config on one mesh (`build`)."""

    cfg: ModelConfig
    sharded: bool = False  # under a mesh: embedding and loss run as shard_maps (vocab.py)
    overlapped: bool = False  # the tensor-parallel matmuls as collective matmuls
    context_ways: int = 1  # context ranks that split each sequence
    pipe: pipeline.Pipeline | None = None  # the layers run through the pipeline's stages
    in_stage: bool = False  # these run inside a stage's per-device program (`for_layers`)
    ahead: bool = False  # each layer's weights gathered a layer ahead (ahead.py)
    # the layers hold collective permutes: the collective matmuls', the expert ring's
    permutes: bool = False

    def for_layers(self) -> LayerOps:
        """The set the layers run with: inside the stages when they run through a pipeline."""
        return dataclasses.replace(self, in_stage=self.sharded and self.pipe is not None)

    def balance(self, batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
        """A natural-order batch of [B, T] arrays in the order the model runs on."""
        return context.balance(batch, self.context_ways)

    def unbalance(self, x: jax.Array) -> jax.Array:
        """x[B, T, ...] in the order the model ran on -> natural order."""
        return context.unbalance(x, self.context_ways)

    def embed(self, table_VD: jax.Array, tokens_BT: jax.Array) -> jax.Array:
        """Token ids -> embeddings [B, T, D] in the compute dtype: the table gathered in the
        compute dtype under a mesh, its gradient reduce-scattered (vocab.sharded_embed)."""
        if not self.sharded:
            return table_VD.astype(self.cfg.dtype)[tokens_BT]
        return vocab.sharded_embed(table_VD, tokens_BT, self.cfg.dtype)

    def project_in(self, x_BTD: jax.Array, params, sites: fp8.Sites | None) -> tuple:
        """x[B, T, D] times each weight [D, ...] (q, k, v; gate, up): [B, T, ...] each."""
        return projections.project_in(self.cfg, self.overlapped, x_BTD, params, sites)

    def project(self, x: jax.Array, params, sites: fp8.Sites | None) -> tuple:
        """x[..., K] times each weight [K, ...], as plain matmuls (no collective matmul: x is
        whole over the sequence, as latent attention's projections read it), FP8 with
        model.fp8."""
        return projections.project_in(self.cfg, False, x, params, sites)

    def project_out(self, h: jax.Array, param: nnx.Param, sites: fp8.Sites | None) -> jax.Array:
        """h[B, T, ...] times w[..., D] summed over the middle dimensions (o, down): [B, T, D]."""
        return projections.project_out(self.cfg, self.overlapped, h, param, sites)

    def weight(self, param: nnx.Param) -> jax.Array:
        """A layer's weight in the compute dtype as its matmuls read it (a bias)."""
        return projections.gathered(param, self.cfg)

    def whole_seq(self, h_BTD: jax.Array) -> jax.Array:
        """A block's normed input, before the projections that read it. Inside a pipeline stage
        (without collective matmuls, which gather in steps themselves) it is gathered over the
        sequence once for all of them: there the compiler otherwise gathered it per projection
        and again in the backward; outside, it shares one gather by itself, and the pin cost
        more (docs/performance.md)."""
        if self.overlapped or not self.in_stage:
            return h_BTD
        return constrain(h_BTD, _WHOLE_SEQ)

    def attend(self, q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, window: int = 0,
               softcap: float = 0.0, sinks: jax.Array | None = None) -> jax.Array:
        """Causal attention within segments with model.attention's kernel, within the `window`
        latest keys when it is > 0, its scores soft-capped at `softcap` > 0, each head's sink
        logit `sinks` [N] in its softmax; a sequence split over `context` attends to the keys
        of the whole sequence (none of these there: parallel/features.py)."""
        impl = self._kernel(softcap, sinks)
        if self.context_ways > 1:
            return context_attention.attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, impl)
        return attention.attention(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, impl, window,
                                   softcap, sinks)

    def attend_either(self, q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, local: jax.Array,
                      window: int, softcap: float = 0.0, sinks: jax.Array | None = None
                      ) -> jax.Array:
        """`attend` within `window` where `local` (traced), else globally: one of the two
        kernels runs, on each device's own rows and heads (attention.either)."""
        return attention.either(q_BTNH, k_BTKH, v_BTKH, segment_ids_BT, local,
                                self._kernel(softcap, sinks), window, softcap, sinks)

    def _kernel(self, softcap: float, sinks: jax.Array | None) -> str:
        return attention.resolve(self.cfg.attention, jax.default_backend(), softcap=softcap,
                                 sinks=sinks is not None)

    def experts(self, x_BTD, expert_BTk, weight_BTk, w_gate, w_up, w_down,
                biases: tuple | None = None) -> jax.Array:
        """What each token's chosen experts make of it, weighted and summed: [B, T, D].
        `biases`: (gate [E, F], up [E, F], down [E, D]) where the experts have them."""
        return experts.experts(self.cfg, x_BTD, expert_BTk, weight_BTk, w_gate, w_up, w_down,
                               biases)

    def run_layers(self, run_group: Callable[..., tuple[jax.Array, dict]], stacked: Any,
                   x_BTD, positions_BT, segment_ids_BT, rows: tuple[str, ...] = ()
                   ) -> tuple[jax.Array, dict]:
        """(x, the MoE statistics stacked [L, ...]) after every stacked layer: `run_group(
        stacked, x, positions, segment_ids, select=None)` over all of them, or through the
        pipeline's stages, which add up the statistics over microbatches (`rows`: those kept
        per row [L, B, ...], pipeline.run)."""
        if self.pipe is None:
            return run_group(stacked, x_BTD, positions_BT, segment_ids_BT)
        return pipeline.run(run_group, stacked, x_BTD, positions_BT, segment_ids_BT,
                            pipe=self.pipe, rows=rows)

    def staged_loss(self, run_group: Callable[..., tuple[jax.Array, dict]], tail: Callable,
                    stacked: Any, tail_params: Any, x_BTD, positions_BT, segment_ids_BT,
                    targets_BT, mask_BT, router: Any = None) -> tuple[jax.Array, jax.Array, dict]:
        """(the summed objective, the summed loss, the router's sums) through every stacked
        layer and `tail(tail_params, x, targets, mask)` per microbatch, the layers through a
        1F1B pipeline's stages (pipe.explicit): its ticks run each microbatch's loss and
        backward themselves (one_f_one_b.py). `router`: a mixture of experts' (moe.Router)."""
        return one_f_one_b.loss(run_group, tail, stacked, tail_params, x_BTD, positions_BT,
                                segment_ids_BT, targets_BT, mask_BT, self.pipe,
                                permutes=self.permutes, router=router)

    def scan_layers(self, body: Callable, x, stacked: Any, names: tuple[str, ...] | None):
        """`jax.lax.scan(body, x, stacked)` over stacked layers; with model.weights_ahead their
        weights split over `embed` fetched a layer ahead, `names` (the projections) in the
        compute dtype (ahead.scan; None: as they are, a pipeline stage's pick)."""
        if self.ahead and names is not None:
            return ahead.scan(self.cfg, body, x, stacked, names)
        return jax.lax.scan(body, x, stacked)

    def head_loss(self, head: Any, x_BTD, targets_BT, mask_BT, chunk: int) -> jax.Array:
        """The summed cross-entropy of final-normed hidden states over `mask` through `head`'s
        LM head (its `head()`, `head_weight()`), in chunks of `chunk` positions (vocab.py)."""
        cap = self.cfg.logit_softcap
        if not self.sharded:
            return vocab.plain_total(x_BTD, head.head(), targets_BT, mask_BT, chunk, cap)
        return vocab.sharded_total(x_BTD, head.head_weight(), targets_BT, mask_BT, chunk,
                                   tied=self.cfg.tie_embeddings, softcap=cap)


def build(cfg: ModelConfig, sizes: Mapping[str, int] | None,
          pipe: pipeline.Pipeline | None = None) -> LayerOps:
    """The set for a mesh of these axis sizes (None: no mesh), with the layers run through
    `pipe`'s stages when given."""
    if sizes is None:
        return LayerOps(cfg, pipe=pipe)
    overlapped = cfg.collective_matmul and sizes.get("tensor", 1) > 1
    ring = bool(cfg.moe.num_experts) and sizes.get(experts.EXPERT_AXIS, 1) > 1
    return LayerOps(cfg, sharded=True, overlapped=overlapped,
                    context_ways=sizes.get(context.AXIS, 1), pipe=pipe,
                    ahead=ahead.applies(cfg, sizes), permutes=overlapped or ring)


def here(cfg: ModelConfig, pipe: pipeline.Pipeline | None = None) -> LayerOps:
    """The set the ambient mesh implies (none: one device's), for callers without a set-up."""
    mesh = jax.sharding.get_abstract_mesh()
    return build(cfg, None if mesh.empty else dict(mesh.shape), pipe)
