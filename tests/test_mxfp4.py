"""gpt-oss MXFP4 dequantisation (jaxtron/hf/mxfp4.py) against transformers' own, bit for bit,
and against one block worked by hand."""

import ml_dtypes
import numpy as np
import pytest

from jaxtron.hf import mxfp4


def test_matches_transformers():
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(0)
    e, r, g = 3, 5, 2  # all different, so a wrong transpose or reshape changes the shape
    blocks = rng.integers(0, 256, (e, r, g, 16), dtype=np.uint8)
    scales = rng.integers(100, 150, (e, r, g), dtype=np.uint8)
    scales[0, 0] = [0, 1]  # 2**-127 (subnormal) and 2**-126
    scales[1, 0] = [254, 255]  # 2**127, 2**128: |value| >= 2 (>= 1) times them is inf
    assert hf.FP4_VALUES == mxfp4.FP4_VALUES.tolist()
    want = hf.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                         dtype=torch.float32).numpy()
    got = mxfp4.dequantize(blocks, scales)
    assert got.dtype == np.float32 and got.shape == (e, g * 32, r) == want.shape
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.signbit(got), np.signbit(want))
    assert np.isinf(want).any()


def test_bfloat16_as_transformers_loads():
    """transformers dequantises into the parameter's dtype, usually bfloat16: the float32 result
    rounded to bfloat16 is the same, bit for bit, over every scale."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.integrations.mxfp4")
    rng = np.random.default_rng(1)
    blocks = rng.integers(0, 256, (2, 64, 3, 16), dtype=np.uint8)
    scales = rng.permutation(np.arange(384) % 256).astype(np.uint8).reshape(2, 64, 3)
    want = hf.convert_moe_packed_tensors(torch.from_numpy(blocks), torch.from_numpy(scales),
                                         dtype=torch.bfloat16)
    got = mxfp4.dequantize(blocks, scales).astype(ml_dtypes.bfloat16)
    np.testing.assert_array_equal(got.view(np.int16), want.view(torch.int16).numpy())


def test_one_block_by_hand():
    nibbles = np.arange(32) % 16  # 0, 1, ..., 15, 0, 1, ..., 15
    blocks = (nibbles[0::2] | nibbles[1::2] << 4).astype(np.uint8).reshape(1, 1, 1, 16)
    got = mxfp4.dequantize(blocks, np.full((1, 1, 1), 128, np.uint8))
    want = 2 * np.array([0, .5, 1, 1.5, 2, 3, 4, 6, -0., -.5, -1, -1.5, -2, -3, -4, -6] * 2)
    assert got.shape == (1, 32, 1)
    np.testing.assert_array_equal(got[0, :, 0], want)
    np.testing.assert_array_equal(np.signbit(got[0, :, 0]), np.signbit(want))


def test_shapes_refused():
    with pytest.raises(ValueError):
        mxfp4.dequantize(np.zeros((2, 3, 16), np.uint8), np.zeros((2, 3), np.uint8))
    with pytest.raises(ValueError):
        mxfp4.dequantize(np.zeros((1, 2, 3, 16), np.uint8), np.zeros((1, 2, 4), np.uint8))


def test_quantized_names():
    p = "model.layers.0.mlp.experts."
    names = [p + "gate_up_proj_blocks", p + "gate_up_proj_scales", p + "gate_up_proj_bias",
             p + "down_proj_blocks", p + "down_proj_scales", "lone_blocks", "lone2_scales"]
    assert mxfp4.quantized_names(iter(names)) == {
        p + "down_proj": (p + "down_proj_blocks", p + "down_proj_scales"),
        p + "gate_up_proj": (p + "gate_up_proj_blocks", p + "gate_up_proj_scales")}
