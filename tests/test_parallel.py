"""Sharding parity: every mesh gives the one-device loss curve, through RULES alone.

Same seed, same data (the real default corpus), 3 steps of AdamW. Measured differences are
<= 1.1e-7 relative (fp32 rounding from different reduction orders); asserted rtol is 1e-5.
"""


import jax
import numpy as np
import pytest

from jaxtron import config
from jaxtron.train import train

RTOL = 1e-5
MESHES = [
    {"data": 8, "fsdp": 1},
    {"fsdp": 8},
    {"tensor": 2, "fsdp": 4},
    {"data": 2, "fsdp": 2, "tensor": 2},
]


def _losses(tmp_path, devices, mesh: dict, *extra: str) -> np.ndarray:
    overrides = [f"mesh.{axis}={size}" for axis, size in mesh.items()] + [
        "train.steps=3", "train.log_every=1", "train.batch_size=16", "train.seq_len=128",
        "optim.warmup_steps=1", "run.tensorboard=false", "run.progress=lines",
        f"run.dir={tmp_path / 'run'}", *extra,
    ]
    history = train(config.load(["configs/tiny.yaml"], overrides), devices=devices)
    return np.array([row["loss"] for row in history])


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return _losses(tmp_path_factory.mktemp("one"), jax.devices()[:1], {"fsdp": 1})


@pytest.mark.parametrize("mesh", MESHES, ids=lambda m: ",".join(f"{k}={v}" for k, v in m.items()))
def test_mesh_matches_one_device(tmp_path, one_device, mesh):
    losses = _losses(tmp_path, jax.devices(), mesh)
    assert losses.shape == (3,) and np.all(np.isfinite(losses))
    assert losses[-1] < losses[0]  # it is training, not just agreeing
    np.testing.assert_allclose(losses, one_device, rtol=RTOL)


def test_gradient_accumulation_matches_one_big_batch(tmp_path, one_device):
    """train.microbatches=2 sums the same gradients as one batch of 16 (here on data=2,fsdp=4)."""
    losses = _losses(tmp_path, jax.devices(), {"data": 2, "fsdp": 4}, "train.microbatches=2")
    np.testing.assert_allclose(losses, one_device, rtol=RTOL)
