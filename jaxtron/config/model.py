"""The model section of the run configuration (`model.*`), with its experts' (`model.moe`) and
latent attention's (`model.mla`) subsections, and the reading of a stored model section of an
earlier layout."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class MoEConfig:
    """model.moe: the experts' own section (jaxtron/model/moe.py). num_experts SwiGLU experts of
    width mlp_dim (0: model.mlp_dim) replace every layer's MLP; each token goes to
    experts_per_token of them, picked by a router's softmax over all experts, the top-k
    renormalized when norm_topk_prob (Mixtral's softmax over its top-k logits is the same).
    0 experts: a dense model."""

    num_experts: int = 0
    experts_per_token: int = 2
    mlp_dim: int = 0
    norm_topk_prob: bool = True
    # 0: dropless (every token reaches its experts); > 0: an expert takes at most
    # ceil(capacity_factor * seq_len * experts_per_token / num_experts) of each sequence's pairs
    capacity_factor: float = 0.0
    # load-balancing loss: transformers' Mixtral form per sequence, all layers (moe.sequence_aux)
    aux_coef: float = 0.01
    z_coef: float = 0.0  # router z-loss: mean logsumexp(router logits)^2, mean over layers
    # the experts' grouped matmuls: auto (mosaic on GPUs, where tokamax is installed; else xla),
    # mosaic (tokamax's Mosaic GPU ragged_dot), triton (its Triton one: jax 0.10 only), xla
    # (jax.lax.ragged_dot: on GPUs XLA runs it as a dense matmul of every row with every expert)
    kernel: str = "auto"
    # DeepSeek-MoE (family deepseek_v3): the router's scores, softmax over all experts or each
    # expert's own sigmoid (normalised over the chosen k when norm_topk_prob)
    scoring: str = "softmax"
    routed_scale: float = 1.0  # the routed experts' weights times this (routed_scaling_factor)
    # group-limited routing: the experts in `groups` equal groups, a token's k chosen only among
    # the topk_groups groups whose two best scores sum highest (n_group, topk_group)
    groups: int = 1
    topk_groups: int = 1
    shared_experts: int = 0  # always-on experts: one SwiGLU of shared_experts * mlp_dim width
    # the first layers keep a dense MLP of model.mlp_dim (first_k_dense_replace)
    first_dense: int = 0
    # auxiliary-loss-free balancing: a per-expert bias added to the scores for the choice only,
    # moved after each step by this times the sign of the expert's load error; 0: no bias
    bias_update_speed: float = 0.0
    # > 0: gpt-oss's clamped SwiGLU, gate clipped above and up on both sides at this limit,
    # then (up + 1) * gate * sigmoid(swiglu_alpha * gate); 0: silu(gate) * up
    swiglu_limit: float = 0.0
    swiglu_alpha: float = 1.702


@dataclass(frozen=True)
class MLAConfig:
    """model.mla: multi-head latent attention (DeepSeek-V2/V3; jaxtron/model/deepseek.py).
    kv_lora_rank > 0 replaces grouped-query attention: keys and values come from one compressed
    vector per token, queries from another (q_lora_rank; 0: projected directly)."""

    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_nope_head_dim: int = 128  # each head's query/key dimensions without RoPE
    qk_rope_head_dim: int = 64  # ... and with RoPE: a key part shared by every head
    v_head_dim: int = 128


# The experts' keys as they were before model.moe held them (model.num_experts, ...): a
# checkpoint's or a run's stored config reads them into the section (`nested`); typed by a user
# they are refused, naming the key now.
FLAT_MOE = {"num_experts": "num_experts", "experts_per_token": "experts_per_token",
            "moe_mlp_dim": "mlp_dim", "norm_topk_prob": "norm_topk_prob",
            "capacity_factor": "capacity_factor", "moe_aux_coef": "aux_coef",
            "moe_z_coef": "z_coef", "moe_kernel": "kernel"}


def nested(model: dict) -> dict:
    """A stored `model` section with the experts' keys of before model.moe moved into it."""
    flat = {FLAT_MOE[k]: v for k, v in model.items() if k in FLAT_MOE}
    if not flat:
        return model
    rest = {k: v for k, v in model.items() if k not in FLAT_MOE}
    return {**rest, "moe": {**flat, **(rest.get("moe") or {})}}


def model_config(model: dict) -> ModelConfig:
    """A stored `model` section (a checkpoint's meta, in this or an earlier layout) as a
    ModelConfig; keys the schema does not have are left out."""
    tree = nested(model)
    known = lambda schema, d: {k: v for k, v in d.items() if k in schema.__dataclass_fields__}
    return ModelConfig(**{**known(ModelConfig, tree),
                          "moe": MoEConfig(**known(MoEConfig, tree.get("moe") or {})),
                          "mla": MLAConfig(**known(MLAConfig, tree.get("mla") or {}))})


@dataclass(frozen=True)
class ModelConfig:
    # llama, mistral, qwen2, qwen3, mixtral, qwen3_moe, deepseek_v3, deepseek_v2, gemma2,
    # gemma3_text (jaxtron/model/families.py);
    # "": the one the settings below make
    family: str = ""
    vocab_size: int = 8192
    num_layers: int = 4
    d_model: int = 256
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int = 0  # 0: d_model // num_heads
    mlp_dim: int = 768
    rope_theta: float = 10000.0
    rope_scaling_factor: float = 0.0  # > 0 turns on Llama-3 frequency scaling
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_max_len: int = 8192
    # with rope_scaling_factor > 0: llama3 (the fields above), linear (positions divided by the
    # factor: Gemma 3's global layers) or yarn (DeepSeek-V3: the fields below, and the softmax
    # scale times mscale(rope_mscale_all_dim)^2)
    rope_scaling_type: str = "llama3"
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 0.0
    # YaRN's correction range rounded out to whole dimensions (transformers' truncate; gpt-oss:
    # false)
    rope_truncate: bool = True
    norm_eps: float = 1e-5
    tie_embeddings: bool = False
    qkv_bias: bool = False
    # the attention window: a windowed layer's query sees its W latest keys (itself included),
    # 0 for none (jaxtron/model/windows.py); global_every=n: every n-th layer attends globally
    # (Gemma 3: 6; Gemma 2, gpt-oss: 2), 0: every layer windowed (Mistral)
    sliding_window: int = 0
    global_every: int = 0
    # the windowed layers' RoPE base, unscaled (Gemma 3's rope_local_base_freq); 0: rope_theta
    # and its scaling, as the global layers
    rope_local_theta: float = 0.0
    # attention scores scaled by 1/sqrt(attn_scale_dim) (Gemma's query_pre_attn_scalar); 0: the
    # head size
    attn_scale_dim: int = 0
    # soft-capping (Gemma 2): attention scores and the final logits z as cap * tanh(z / cap);
    # 0: none
    attn_softcap: float = 0.0
    logit_softcap: float = 0.0
    # gpt-oss: a learned logit per head in every softmax's denominator (model/gpt_oss.py)
    attn_sinks: bool = False
    init_std: float = 0.02
    dtype: str = "bfloat16"  # compute dtype
    param_dtype: str = "float32"  # master weights
    scan_layers: bool = True
    remat: str = "none"  # a key of model.REMAT_POLICIES, or auto (jaxtron/plan/autofit.py)
    attention: str = "auto"  # auto (cudnn on GPUs, xla elsewhere), cudnn, xla
    attention_check: bool = True  # on a GPU: test the kernel against xla before the first step
    # mesh.tensor > 1: overlap each tensor-parallel matmul with its all-gather / reduce-scatter
    # over the sequence (jaxtron/parallel/collective_matmul.py); nothing changes with mesh.tensor=1
    collective_matmul: bool = True
    # gather each layer's projection weights (attention; the MLP of a dense layer) over fsdp one
    # layer ahead, beside the layer before, and keep them for the backward: (q, k, v, o) bytes
    # per layer more memory, no gather at a layer's start (jaxtron/model/decoder.py). Under
    # remat and model.fp8=none only; a pipeline's stages gather as before
    weights_ahead: bool = False
    # none, tensorwise or delayed: the layers' projections (q, k, v, o, gate, up, down) as FP8
    # matmuls, e4m3 forward and e5m2 gradients, scaled per tensor by its amax at this step
    # (tensorwise) or over the last fp8_history steps (delayed; the histories are train state,
    # checkpointed) (jaxtron/ops/fp8.py); the LM head, embedding and attention stay in the
    # compute dtype
    fp8: str = "none"
    fp8_history: int = 1024
    qk_norm: bool = False  # Qwen3: an RMSNorm over each head's q and k (head_size wide) before RoPE
    # the experts of a mixture-of-experts family (mixtral, qwen3_moe); a dense model has none
    moe: MoEConfig = field(default_factory=MoEConfig)
    mla: MLAConfig = field(default_factory=MLAConfig)  # latent attention (deepseek_v3)
    # deepseek_v3's multi-token prediction: this many extra modules, the k-th predicting token
    # t+1+k from the one before's hidden state and token t+k's embedding (shared embedding and
    # head), their mean loss times mtp_coef joining the objective; training only (0: none)
    mtp_depth: int = 0
    mtp_coef: float = 0.3

    @property
    def staged_layers(self) -> int:
        """The layers a pipeline's stages split: all but model.moe.first_dense dense ones, which
        are a stack of their own that runs whole before them (DeepSeek's `dense_layers`)."""
        return self.num_layers - self.moe.first_dense

    def weight_grads_apart(self, tensor: int) -> bool:
        """Whether pipeline.schedule=zb_h1 can run the layers' weight gradients apart from their
        input gradient: not beside collective matmuls over `tensor`, whose rings compute them in
        shard_maps the input gradient needs whole (parallel/zero_bubble.py); there it runs as
        1f1b."""
        return tensor == 1 or not self.collective_matmul

    @property
    def head_size(self) -> int:
        return self.head_dim or self.d_model // self.num_heads
