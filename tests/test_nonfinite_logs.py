"""A run through NaN steps: the step lines say so, and nothing else repeats it on stderr
(tensorboardX warned "NaN or Inf found in input tensor" for each NaN scalar, twice a step)."""

import logging

import jax.numpy as jnp

from jaxtron import config
from jaxtron.step import train_step as step_lib  # loss_and_grads calls it there
from jaxtron.train.loop import train


def test_nan_steps_log_no_tensorboard_warnings(tmp_path, monkeypatch, capfd, caplog):
    real_loss = step_lib.loss_sums

    def loss_sums(*args, **kwargs):
        total, aux = real_loss(*args, **kwargs)
        if kwargs.get("with_stats"):  # the cross-entropy logged with it too
            aux = (aux[0], aux[1] * jnp.nan, aux[2])
        return total * jnp.nan, aux  # every step's loss, and so its gradient, is NaN

    monkeypatch.setattr(step_lib, "loss_sums", loss_sums)
    cfg = config.load(["configs/tiny.yaml"], [
        "train.steps=2", "train.log_every=1", "train.seq_len=64", "optim.warmup_steps=1",
        "run.tensorboard=true", "run.progress=lines", f"run.dir={tmp_path / 'run'}"])
    with caplog.at_level(logging.WARNING):
        rows = train(cfg)
    assert [r["step"] for r in rows] == [1, 2] and all(r["loss"] != r["loss"] for r in rows)
    assert list((tmp_path / "run" / "tensorboard").iterdir())  # the scalars were still written
    assert not [r for r in caplog.records if r.name.startswith("tensorboardX")]
    out, err = capfd.readouterr()
    assert "update skipped" in out and "NaN or Inf" not in err
