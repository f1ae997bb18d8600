"""What the model's settings name, checked before anything is built: the remat policies
(what each keeps for the backward), the attention kernel, FP8, the experts' kernel, the family
and its windows; and whether the device has the host memory an offloading policy copies to."""

from __future__ import annotations

import jax

from jaxtron.config import ConfigError, ModelConfig
from jaxtron.model import families, windows
from jaxtron.ops import attention as attention_lib
from jaxtron.ops import experts, fp8
from jaxtron.parallel import collective_matmul

_policies = jax.checkpoint_policies
_names = _policies.save_only_these_names
# What a remat policy keeps for the backward pass; everything else is recomputed. Ordered from
# most memory to least; docs/parallelism.md says when to use which.
REMAT_POLICIES = {
    "none": None,  # no remat: keep every activation (fastest, most memory)
    # keep matmul outputs, and the collective matmuls' outputs (gathered, reduce-scattered)
    "save_dots": _policies.save_from_both_policies(_policies.dots_with_no_batch_dims_saveable,
                                                   _names(collective_matmul.SCATTERED,
                                                          collective_matmul.GATHERED)),
    "save_qkv_out": _names("query_proj", "key_proj", "value_proj", "attn_out"),
    "save_attn_out": _names("attn_out"),  # keep the attention output only
    "full": _policies.nothing_saveable,  # keep only each layer's input
    # keep matmul outputs in pinned host memory, copied back for the backward pass
    "offload_dots": _policies.offload_dot_with_no_batch_dims("device", "pinned_host"),
}
OFFLOADING = ("offload_dots",)  # policies that need a pinned_host memory space on the device


def check(cfg: ModelConfig) -> None:
    """Names the config gives for code this module owns: the remat policy and attention kernel."""
    if cfg.remat not in REMAT_POLICIES and cfg.remat != "auto":
        raise ConfigError(f"model.remat={cfg.remat} is not one of {', '.join(REMAT_POLICIES)}, "
                          "auto")
    if cfg.attention not in attention_lib.CHOICES:
        raise ConfigError(
            f"model.attention={cfg.attention} is not one of {', '.join(attention_lib.CHOICES)}")
    attention_lib.kernel_of(cfg, "gpu")  # a kernel the dtype, soft cap and sinks allow
    if cfg.fp8 not in fp8.MODES:
        raise ConfigError(f"model.fp8={cfg.fp8} is not one of {', '.join(fp8.MODES)}")
    experts.check(cfg)
    families.check(cfg)
    windows.check(cfg)
    if cfg.fp8_history < 1:
        raise ConfigError(f"model.fp8_history={cfg.fp8_history} must be at least 1 (steps of "
                          "amax history under model.fp8=delayed)")


def check_remat(cfg: ModelConfig, device: jax.Device) -> None:
    """An offloading policy needs host memory the device can copy to; say so before compiling."""
    kinds = [memory.kind for memory in device.addressable_memories()]
    if cfg.remat in OFFLOADING and "pinned_host" not in kinds:
        raise ConfigError(
            f"model.remat={cfg.remat} needs pinned host memory, which {device.platform} devices "
            f"here do not have (memories: {', '.join(kinds)}); use model.remat=save_dots or full")
