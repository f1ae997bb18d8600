"""gpt-oss MXFP4 expert weights, as Hugging Face checkpoints store them, back to float32.

openai/gpt-oss checkpoints keep each MoE expert matrix `X` as `X_blocks` (uint8, two FP4 e2m1
values a byte, low nibble first) and `X_scales` (uint8 E8M0 exponents, one per 32 values). This
reproduces transformers' `convert_moe_packed_tensors` (integrations/mxfp4.py) in numpy, ending in
the layout of the loaded `GptOssExperts` parameters, so the weights convert without torch.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

FP4_VALUES = np.array([+0.0, +0.5, +1.0, +1.5, +2.0, +3.0, +4.0, +6.0,
                       -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 weights from `blocks` uint8 [E, R, G, 16] and `scales` uint8 [E, R, G].

    Value 2j of a block row is FP4_VALUES[byte j & 15], value 2j + 1 is FP4_VALUES[byte j >> 4],
    each times 2**(scale - 127) exactly (np.ldexp, as torch.ldexp there: beyond float32 is +-inf);
    the [E, R, G * 32] result is returned transposed, [E, G * 32, R], as transformers loads it:
    gate_up_proj [E, 2F, D/32, 16] -> [E, D, 2F] and down_proj [E, D, F/32, 16] -> [E, F, D].
    """
    blocks = np.asarray(blocks, dtype=np.uint8)
    if blocks.ndim != 4 or blocks.shape[-1] != 16 or scales.shape != blocks.shape[:-1]:
        raise ValueError(f"blocks {blocks.shape} and scales {scales.shape} are not "
                         "[E, R, G, 16] and [E, R, G]")
    e, r, g, b = blocks.shape
    out = np.empty((e, r, g, b * 2), dtype=np.float32)
    out[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    out[..., 1::2] = FP4_VALUES[blocks >> 4]
    exponents = np.asarray(scales, dtype=np.int32)[..., None] - 127
    with np.errstate(over="ignore"):
        np.ldexp(out, exponents, out=out)
    return np.ascontiguousarray(out.reshape(e, r, g * b * 2).transpose(0, 2, 1))


def quantized_names(names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Each base name `X` whose `X_blocks` and `X_scales` are both in `names`, to that pair."""
    names = set(names)
    return {n.removesuffix(BLOCKS): (n, n.removesuffix(BLOCKS) + SCALES)
            for n in sorted(names)
            if n.endswith(BLOCKS) and n.removesuffix(BLOCKS) + SCALES in names}
