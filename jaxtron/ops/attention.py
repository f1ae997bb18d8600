"""Attention kernels behind one function, all honouring packed-sequence segment ids.

Shapes: B batch, T query length, S key length, N query heads, K kv heads, G = N // K query heads
per kv head, H head size. V's head size may differ from q's and k's (DeepSeek-V3's latent
attention: 192 for q and k, 128 for v): the output has v's, the scores are scaled by q's.
Segment id 0 marks padding; a token attends only to earlier tokens of its own segment, and with
a window W > 0 (a static int, jaxtron/model/windows.py) only to its W latest ones. A soft cap c > 0
(Gemma 2's) takes the scaled scores s to c * tanh(s / c) before the mask; sinks [N] (gpt-oss's
learned logit per head) join each softmax's denominator and nothing else. Both the XLA kernels
only (cuDNN takes neither: `resolve`).
Every backend is tested against `xla_attention` on a packed batch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from jaxtron import parallel
from jaxtron.config import Config, ConfigError


def segment_causal_mask(segment_ids_BT: jax.Array, window: int = 0) -> jax.Array:
    """mask[B, 1, 1, T, S]: causal and within one segment (broadcasts over K and G), and within
    the `window` latest keys when it is > 0."""
    t = segment_ids_BT.shape[1]
    q_T1, k_1T = jnp.arange(t)[:, None], jnp.arange(t)[None, :]
    causal_TS = (k_1T <= q_T1) & ((q_T1 - k_1T < window) if window else True)
    same_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    return (causal_TS[None] & same_BTS)[:, None, None]


def xla_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                  segment_ids_BT: jax.Array, window: int = 0, softcap: float = 0.0,
                  sinks: jax.Array | None = None) -> jax.Array:
    """Reference attention in plain XLA ops; softmax in float32. Within a window much shorter
    than the sequence, in bands (`banded_attention`), so that its work scales with the window."""
    chunk = band_chunk(q_BTNH.shape[1], window)
    if chunk:
        return banded_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, window, chunk, softcap,
                                sinks)
    return masked_attention(q_BTNH, k_BSKH, v_BSKH, segment_causal_mask(segment_ids_BT, window),
                            softcap, sinks)


def band_chunk(t: int, window: int) -> int:
    """The query chunk `banded_attention` takes for a window over a sequence of t: the shortest
    divisor of t at least the window; 0 (attend over the whole sequence) where there is no
    window or two chunks would cover the sequence anyway."""
    if not window:
        return 0
    chunk = next(c for c in range(min(window, t), t + 1) if t % c == 0)
    return chunk if 2 * chunk < t else 0


def banded_attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, window: int,
                     chunk: int, softcap: float = 0.0, sinks: jax.Array | None = None
                     ) -> jax.Array:
    """Windowed attention in chunks of `chunk` >= window queries, each over its own chunk's keys
    and the chunk's before: scores [T, 2 * chunk] where masked attention has [T, T]."""
    b, t, c = q_BTNH.shape[0], q_BTNH.shape[1], chunk
    m = t // c

    def bands(x_BT, fill):  # [B, T, ...] -> [B, M, 2C, ...]: chunk j's keys are j-1's and j's
        padded = jnp.pad(x_BT, [(0, 0), (c, 0)] + [(0, 0)] * (x_BT.ndim - 2),
                         constant_values=fill).reshape(b, m + 1, c, *x_BT.shape[2:])
        return jnp.concatenate([padded[:, :-1], padded[:, 1:]], axis=2)

    fold = lambda x: x.reshape(b * m, *x.shape[2:])  # the chunks as rows of the batch
    i_C1, j_1S = jnp.arange(c)[:, None], jnp.arange(2 * c)[None, :]
    distance_CS = c + i_C1 - j_1S  # query's position less key's
    band_CS = (distance_CS >= 0) & (distance_CS < window)
    q_segments_BMC = segment_ids_BT.reshape(b, m, c)
    same_BMCS = q_segments_BMC[..., None] == bands(segment_ids_BT, -1)[:, :, None, :]
    mask = fold(band_CS & same_BMCS)[:, None, None]
    out = masked_attention(fold(q_BTNH.reshape(b, m, c, *q_BTNH.shape[2:])),
                           fold(bands(k_BSKH, 0)), fold(bands(v_BSKH, 0)), mask, softcap, sinks)
    return out.reshape(b, t, *out.shape[2:])


def cached_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                     start: jax.Array, window: jax.Array | int = 0,
                     softcap: float = 0.0, sinks: jax.Array | None = None) -> jax.Array:
    """T new queries over a KV cache of S slots, in which their own keys sit at slots start ..
    start+T-1: each query sees the slots up to its own (earlier tokens and itself), never the
    unwritten ones after, and with `window` > 0 (may be traced) only its `window` latest. The
    reference math, for generation (T = 1 per step after the prompt)."""
    query_slot_T1 = (start + jnp.arange(q_BTNH.shape[1]))[:, None]
    slot_1S = jnp.arange(k_BSKH.shape[1])[None, :]
    mask_TS = (slot_1S <= query_slot_T1) & ((window == 0) | (query_slot_T1 - slot_1S < window))
    return masked_attention(q_BTNH, k_BSKH, v_BSKH, mask_TS[None, None, None], softcap, sinks)


def masked_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                     mask: jax.Array, softcap: float = 0.0, sinks: jax.Array | None = None
                     ) -> jax.Array:
    """Grouped-query attention where mask[B or 1, 1, 1, T, S] is true; softmax in float32. The
    output has v's head size (which may differ from q's), the scores the scale of q's. `sinks`
    [N]: each head's sink logit in the softmax's denominator (probabilities summing to less
    than 1), as transformers' gpt-oss appends it as a column and drops it after."""
    b, t, n, h = q_BTNH.shape
    k, hv = k_BSKH.shape[2], v_BSKH.shape[3]
    q_BKGTH = q_BTNH.reshape(b, t, k, n // k, h).transpose(0, 2, 3, 1, 4)
    scores_BKGTS = jnp.einsum(
        "bkgth,bskh->bkgts", q_BKGTH, k_BSKH, preferred_element_type=jnp.float32
    ) / jnp.sqrt(jnp.float32(h))
    if softcap:
        scores_BKGTS = softcap * jnp.tanh(scores_BKGTS / softcap)
    scores_BKGTS = jnp.where(mask, scores_BKGTS, jnp.finfo(jnp.float32).min)
    if sinks is None:
        probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1)
    else:
        sink_KG11 = sinks.astype(jnp.float32).reshape(k, n // k, 1, 1)
        total = jnp.logaddexp(jax.nn.logsumexp(scores_BKGTS, axis=-1, keepdims=True), sink_KG11)
        probs_BKGTS = jnp.exp(scores_BKGTS - total)
    probs_BKGTS = probs_BKGTS.astype(v_BSKH.dtype)
    out_BKGTH = jnp.einsum("bkgts,bskh->bkgth", probs_BKGTS, v_BSKH)
    return out_BKGTH.transpose(0, 3, 1, 2, 4).reshape(b, t, n, hv)


def cudnn_attention(q_BTNH: jax.Array, k_BSKH: jax.Array, v_BSKH: jax.Array,
                    segment_ids_BT: jax.Array, window: int = 0, softcap: float = 0.0,
                    sinks: jax.Array | None = None) -> jax.Array:
    """cuDNN fused (flash) attention, GPU only: causal, grouped-query with K/V read per kv head
    (never repeated in memory), packed documents kept apart by a segment-equality mask, and a
    window (cuDNN's sliding_window_length: the tiles outside the band are skipped).

    The scores never exist in memory: cuDNN tiles them in on-chip SRAM, forward and backward. The
    mask is [B, 1, T, S] (one per sequence, shared by every head); jax's entry with packed-layout
    offsets checks for a local Hopper GPU, so it cannot be compiled ahead of time elsewhere.
    V with another head size than q's (latent attention) takes cuDNN's own entry (`_cudnn_local`).

    Inside the pipeline's stages (a partly manual program, whose shardings jax's cuDNN
    partitioning rule cannot read) the kernel runs in a `shard_map` over the remaining axes, on
    each device's own sequences and heads (the specs of RULES), sealed (`_sealed`)."""
    if softcap or sinks is not None:
        raise ConfigError(NO_SOFTCAP if softcap else NO_SINKS)
    mesh = jax.sharding.get_abstract_mesh()
    manual = jax.sharding.AxisType.Manual
    if mesh.empty or manual not in mesh.axis_types:  # outside the pipeline: jax partitions it
        return _cudnn_local(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, window)
    free = {name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind != manual}
    q_spec = parallel.spec_here(("act_batch", None, "act_heads", None))
    kv_spec = parallel.spec_here(("act_batch", None, "act_kv_heads", None))
    run = jax.shard_map(functools.partial(_sealed, window=window),
                        in_specs=(q_spec, kv_spec, kv_spec, P(q_spec[0], None)),
                        out_specs=q_spec, axis_names=free, check_vma=False)
    return run(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)


def _cudnn_local(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, window: int = 0) -> jax.Array:
    """One cuDNN call: causal, the segment-equality mask as a bias. jax.nn's entry wants v's head
    size to be q's, so another v size goes to cuDNN's own entry (the same kernel, in its latent
    attention form: jax allows it on Hopper or later with cuDNN 9.10 or later, checking the local
    GPU) with jax.nn's scale and mask."""
    # the sequence whole, as cuDNN's partitioning wants the mask (a MoE layer's use of the ids
    # split over the sequence propagated onto it otherwise)
    segment_ids_BT = parallel.constrain(segment_ids_BT, ("act_batch", "act_ctx"))
    same_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
    if v_BSKH.shape[-1] == q_BTNH.shape[-1]:
        return jax.nn.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=same_BTS[:, None],
                                            is_causal=True, implementation="cudnn",
                                            local_window_size=(window - 1, 0) if window else None)
    from jax._src.cudnn import fused_attention_stablehlo as fa
    return fa.dot_product_attention(q_BTNH, k_BSKH, v_BSKH, mask=same_BTS[:, None],
                                    scale=q_BTNH.shape[-1] ** -0.5,
                                    mask_type=fa.MaskType.CAUSAL,
                                    **({"sliding_window_length": window} if window else {}))


def either(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, local: jax.Array, impl: str, window: int,
           softcap: float = 0.0, sinks: jax.Array | None = None) -> jax.Array:
    """Attention within `window` where `local` (a traced bool: a layer of a scanned stack whose
    layers differ, jaxtron/model/windows.py), else global: both kernels compiled, a `lax.cond`
    runs one. The cond runs on each device's own rows and heads, in a `shard_map` over the
    mesh's axes (the specs of RULES): left to the partitioner, the cond's residuals for the
    backward (the softmax statistics, the mask, q, k, v) came out whole over the batch and
    were all-gathered on every device, every layer (Gemma 3 27B on 8 H100s: 285 GiB gathered
    per step against 98 with every layer alike)."""
    run = ATTENTION_IMPLS[impl]  # resolved by the caller (LayerOps.attend_either)
    if run is cudnn_attention:
        run = _sealed  # a device's own rows: the kernel, sealed inside the manual program

    def per_device(q, k, v, segments, local, *sinks):
        extra = (softcap, *sinks)
        kernel = lambda w: lambda q, k, v: run(q, k, v, segments, w, *extra)
        return jax.lax.cond(local, kernel(window), kernel(0), q, k, v)

    args = (q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, local,
            *(() if sinks is None else (sinks,)))
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return per_device(*args)
    manual = jax.sharding.AxisType.Manual
    free = {name for name, kind in zip(mesh.axis_names, mesh.axis_types) if kind != manual}
    if not free:
        return per_device(*args)
    q_spec = parallel.spec_here(("act_batch", None, "act_heads", None))
    kv_spec = parallel.spec_here(("act_batch", None, "act_kv_heads", None))
    sink_spec = (P(q_spec[2]),) if sinks is not None else ()
    sharded = jax.shard_map(per_device, in_specs=(q_spec, kv_spec, kv_spec, P(q_spec[0], None),
                                                  P(), *sink_spec),
                            out_specs=q_spec, axis_names=free, check_vma=False)
    return sharded(*args)


def _from_arrays(prim, *avals, **params) -> bool:
    """Remat policy: save what is computed from arrays, recompute what is made of literals."""
    del prim, params
    return any(getattr(aval, "shape", ()) for aval in avals)


def _sealed(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, window: int = 0,
            softcap: float = 0.0) -> jax.Array:
    """`_cudnn_local` as one unit that no transformation splits open inside a manual program.

    jax's cuDNN entry makes zero-element placeholders (`jnp.zeros(0)`, in place of the bias,
    sequence lengths, offsets and page tables it is not given) and passes them to its kernels,
    forward and backward. Inside a `shard_map`, partial evaluation hoists such constants out of
    the body and passes them back in: as residuals from the forward to the backward, and out of
    the scans' bodies as loop-invariant values (a split `shard_map` computes its constants in a
    zero-input one). XLA of jax 0.11.2 segfaults on a manual computation with a zero-element
    operand (Shardy's canonicalizer: mlir::sdy::ManualComputationUnusedInputsPattern, from
    xla::sdy::ShardyXLA in OptimizeHloModule; a CPU shard_map reading a `jnp.zeros(0)` argument
    crashes too; GSPMD and jax 0.10 compile it). Two remats keep the placeholders inside: the
    inner one (saving nothing) is what the forward program holds, and partial evaluation of a
    remat recomputes what it may not save, so no constant leaves it; the outer one is the one
    differentiated, and saves the kernel's residuals but not the placeholders, which the
    backward makes again. The kernels run as often as unsealed: no forward is recomputed."""
    # looked up at trace time (tests substitute it)
    kernel = lambda *args: _cudnn_local(*args, window=window)
    inner = jax.checkpoint(kernel, policy=jax.checkpoint_policies.nothing_saveable,
                           prevent_cse=False)
    outer = jax.checkpoint(inner, policy=_from_arrays, prevent_cse=False)
    return outer(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT)


@contextlib.contextmanager
def cross_compiling(device):
    """A context in which jax's cuDNN attention is lowered for `device`, a GPU this host lacks
    (the compile-only H100s of --compile-for): jax reads the local GPU's compute capability for
    what cuDNN takes (head sizes over 128 and latent attention's smaller value size from Hopper
    on, model.mla), and here there is none, so it answers for `device` instead."""
    from jax._src.cudnn import fused_attention_stablehlo as fused  # noqa: PLC0415

    have = tuple(int(x) for x in str(getattr(device, "compute_capability", "0.0")).split("."))
    parse = lambda capability: tuple(int(x) for x in capability.split("."))
    saved = fused.check_compute_capability, fused.is_cuda_compute_capability_equal
    fused.check_compute_capability = lambda capability: have >= parse(capability)
    fused.is_cuda_compute_capability_equal = lambda capability: have == parse(capability)
    try:
        yield
    finally:
        fused.check_compute_capability, fused.is_cuda_compute_capability_equal = saved


ATTENTION_IMPLS: dict[str, Callable[..., jax.Array]] = {
    "xla": xla_attention,
    "cudnn": cudnn_attention,
}
CHOICES = ("auto", *ATTENTION_IMPLS)  # model.attention; auto: cudnn on GPUs, xla elsewhere


NO_SOFTCAP = ("model.attention=cudnn does not soft-cap scores (cuDNN has no tanh cap): with "
              "model.attn_softcap use model.attention=auto or xla")
NO_SINKS = ("model.attention=cudnn has no attention sinks (jax's cuDNN entry takes no sink "
            "logit): with model.attn_sinks use model.attention=auto or xla")


def resolve(impl: str, platform: str, dtype: str = "bfloat16", softcap: float = 0.0,
            sinks: bool = False) -> str:
    """The kernel `model.attention` means on devices of `platform` (auto: cudnn on GPUs in 16-bit
    compute without a soft cap or sinks, xla elsewhere). Pipeline stages run their layers per
    device (a shard_map over `stage`), so the choice is the same inside them."""
    if impl == "cudnn" and dtype not in ("bfloat16", "float16"):
        raise ConfigError(f"model.attention=cudnn needs model.dtype=bfloat16 or float16, not "
                          f"{dtype}")
    if impl == "cudnn" and (softcap or sinks):
        raise ConfigError(NO_SOFTCAP if softcap else NO_SINKS)
    if impl != "auto":
        return impl
    gpu = platform in ("gpu", "cuda")
    plain = not softcap and not sinks
    return "cudnn" if gpu and dtype in ("bfloat16", "float16") and plain else "xla"


def kernel_of(m, platform: str) -> str:
    """The kernel a model config's model.attention means on devices of `platform`, with its
    dtype, soft cap and sinks (`resolve`)."""
    return resolve(m.attention, platform, m.dtype, m.attn_softcap, m.attn_sinks)


def configure(cfg: Config, platform: str) -> Config:
    """cfg with model.attention resolved for devices of `platform` (auto -> cudnn on GPUs in
    16-bit compute, else xla)."""
    kernel = kernel_of(cfg.model, platform)
    if kernel == "cudnn" and platform not in ("gpu", "cuda"):
        raise ConfigError(f"model.attention=cudnn runs on NVIDIA GPUs only, not on {platform} "
                          "devices; use model.attention=auto (it picks xla here)")
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, attention=kernel))


def attention(q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, impl: str = "xla",
              window: int = 0, softcap: float = 0.0, sinks: jax.Array | None = None
              ) -> jax.Array:
    """Dispatch to the configured kernel (`model.attention`; auto follows jax's backend)."""
    impl = resolve(impl, jax.default_backend(), softcap=softcap, sinks=sinks is not None)
    extra = () if sinks is None else (sinks,)
    return ATTENTION_IMPLS[impl](q_BTNH, k_BSKH, v_BSKH, segment_ids_BT, window, softcap, *extra)


def self_check(impl: str, dtype=jnp.bfloat16, tolerance: float = 2e-2,
               kernel: Callable[..., jax.Array] | None = None,
               form: str = "", sizes: tuple[int, int] = (64, 64),
               window: int = 0) -> dict[str, float]:
    """Run `impl` against `xla_attention` on a small packed batch (three documents per row,
    padding at the end), forward and gradient, on the local default device; the relative errors
    of output, dq, dk and dv. Raise a ConfigError naming the kernel and the error when they
    differ (a kernel that lets packed documents see each other, or reads K/V of the wrong group,
    fails here before training starts). `kernel`: another form of `impl` to check in its place
    (`form` names it in the error: context parallelism's). `sizes`: the model's query/key and
    value head sizes (`Transformer.cache_heads`), so the check runs the shapes training will
    (latent attention's 192 and 128). `window`: the model's attention window, checked at a third
    of the batch's length at most, so that it cuts the documents (0: none)."""
    b, t, n, k = 2, 64, 4, 2
    (h, hv), keys = sizes, jax.random.split(jax.random.key(0), 4)
    q = jax.random.normal(keys[0], (b, t, n, h), dtype)
    kv = [jax.random.normal(key, (b, t, k, size), dtype) for key, size in zip(keys[1:3], (h, hv))]
    cotangent = jax.random.normal(keys[3], (b, t, n, hv), jnp.float32)
    segments = jnp.array([[1] * 20 + [2] * 30 + [3] * 10 + [0] * 4,
                          [1] * 5 + [2] * 50 + [3] * 9], jnp.int32)

    window = min(window, t // 3)
    extra = (window,) if window else ()

    def run(kernel):
        loss = lambda q, k, v: jnp.sum(kernel(q, k, v, segments, *extra).astype(jnp.float32)
                                       * cotangent)
        out = kernel(q, *kv, segments, *extra)
        return (out, *jax.grad(loss, argnums=(0, 1, 2))(q, *kv))

    want = jax.jit(lambda: run(xla_attention))()
    got = jax.jit(lambda: run(kernel or ATTENTION_IMPLS[impl]))()
    errors = {}
    for name, a, r in zip(("output", "dq", "dk", "dv"), got, want):
        a, r = a.astype(jnp.float32), r.astype(jnp.float32)
        error = errors[name] = float(jnp.linalg.norm(a - r) / jnp.linalg.norm(r))
        if not error <= tolerance:
            raise ConfigError(
                f"model.attention={impl}{form} disagrees with the xla reference on a packed "
                f"batch (head sizes {h}/{hv}): {name} off by {error:.3g} (relative, tolerance "
                f"{tolerance}); use "
                "model.attention=xla, or model.attention_check=false to train anyway")
    return errors
