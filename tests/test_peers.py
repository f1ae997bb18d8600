"""jaxtron/bench/peers.py: MaxText's overrides for a preset, its log read back, a real run where
MaxText is installed (Python >= 3.12), and one-line errors where it cannot run."""

import dataclasses
import os
import sys
from pathlib import Path

import pytest

from jaxtron import config, model
from jaxtron.bench import peers
from jaxtron.step import optim, state

ROOT = Path(__file__).resolve().parents[1]

# From a real MaxText 0.2.5 run of configs/tiny.yaml (seq_len 128, batch 2) on one CPU device.
LOG = """\
I1127 11:34:40.894692 140491995077504 metric_logger.py:425] number parameters: 0.007 billion
I1127 12:01:02.017294 140491995077504 metric_logger.py:265] completed step: 0, seconds: 0.058, TFLOP/s/device: 0.143, Tokens/s/device: 4435.358, total_weights: 256, loss: 9.466, lm_loss: 9.466, perplexity: 12907.586
I1127 12:01:02.030139 140491995077504 metric_logger.py:393] To see full metrics 'tensorboard --logdir=/tmp/jaxtron_maxtext_x/peer/tensorboard/'
I1127 12:01:02.878765 140491995077504 metric_logger.py:265] completed step: 1, seconds: 0.327, TFLOP/s/device: 0.025, Tokens/s/device: 782.284, total_weights: 256, loss: 9.466, lm_loss: 9.466, perplexity: 12907.586
I1127 12:01:03.018830 140491995077504 metric_logger.py:265] completed step: 2, seconds: 0.110, TFLOP/s/device: 0.075, Tokens/s/device: 2317.182, total_weights: 256, loss: 8.232, lm_loss: 8.232, perplexity: 3760.616
I1127 12:01:03.195786 140491995077504 metric_logger.py:265] completed step: 3, seconds: 0.175, TFLOP/s/device: 0.047, Tokens/s/device: 1463.903, total_weights: 256, loss: 6.222, lm_loss: 6.222, perplexity: 503.564
I1127 12:01:03.386143 140491995077504 metric_logger.py:265] completed step: 4, seconds: 0.192, TFLOP/s/device: 0.043, Tokens/s/device: 1335.385, total_weights: 256, loss: 4.088, lm_loss: 4.088, perplexity: 59.606
I1127 12:01:03.571143 140491995077504 metric_logger.py:265] completed step: 5, seconds: 0.185, TFLOP/s/device: 0.045, Tokens/s/device: 1386.985, total_weights: 256, loss: 2.192, lm_loss: 2.192, perplexity: 8.952
"""


def _args(preset: str, devices: int, platform: str, *overrides: str) -> dict[str, str]:
    cfg = config.load([ROOT / "configs" / preset], list(overrides))
    args = peers.maxtext_args(cfg, devices, 20, "/tmp/out", platform=platform)
    return dict(arg.split("=", 1) for arg in args)


def test_llama3_8b_dimensions_batch_and_remat():
    args = _args("llama3_8b.yaml", 8, "gpu", "model.remat=full", "train.microbatches=1")
    assert {key: args[key] for key in (
        "base_num_decoder_layers", "base_emb_dim", "base_num_query_heads", "base_num_kv_heads",
        "head_dim", "base_mlp_dim", "vocab_size", "logits_via_embedding", "rope_max_timescale",
        "normalization_layer_epsilon", "dtype", "weight_dtype")} == {
        "base_num_decoder_layers": "32", "base_emb_dim": "4096", "base_num_query_heads": "32",
        "base_num_kv_heads": "8", "head_dim": "128", "base_mlp_dim": "14336",
        "vocab_size": "128256", "logits_via_embedding": "false", "rope_max_timescale": "500000.0",
        "normalization_layer_epsilon": "1e-05", "dtype": "bfloat16", "weight_dtype": "float32"}
    # 128 sequences of 8192 over 8 GPUs; remat full; jax's cuDNN flash attention; the schedule's
    # hyper-parameters from gpu_base.yaml
    assert (args["per_device_batch_size"], args["max_target_length"]) == ("16", "8192")
    assert (args["remat_policy"], args["attention"], args["hardware"]) == (
        "full", "cudnn_flash_jax", "gpu")
    assert (args["learning_rate"], args["adam_b2"], args["adam_weight_decay"]) == (
        "0.0003", "0.95", "0.1")
    assert (args["dataset_type"], args["enable_checkpointing"], args["steps"]) == (
        "synthetic", "false", "20")


def test_gpt2_124m_tied_embeddings_and_no_remat_on_cpu():
    args = _args("gpt2_124m.yaml", 8, "cpu", "model.remat=none", "train.microbatches=1")
    assert [args[key] for key in ("base_num_decoder_layers", "base_emb_dim",
                                  "base_num_query_heads", "base_num_kv_heads", "head_dim",
                                  "base_mlp_dim", "vocab_size", "logits_via_embedding")] == [
        "12", "768", "12", "12", "64", "2048", "50304", "true"]
    assert (args["per_device_batch_size"], args["max_target_length"]) == ("64", "1024")
    assert args["attention"] == "dot_product" and "hardware" not in args
    # MaxText's remat_policy=none recomputes everything; jaxtron's none keeps every named tensor
    assert args["remat_policy"] == "custom"
    assert sorted(key for key, value in args.items() if value == "device") == sorted(
        peers._KEEP_ALL)


def test_every_jaxtron_remat_policy_has_a_maxtext_one_and_others_are_refused():
    assert set(peers.REMAT) == set(model.REMAT_POLICIES)
    cfg = config.load([ROOT / "configs" / "tiny.yaml"])
    bad = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, remat="everything"))
    with pytest.raises(peers.PeerError, match="model.remat=everything has no MaxText"):
        peers.maxtext_args(bad, 1, 5, "/tmp/out")
    with pytest.raises(peers.PeerError, match="does not split over 3 devices"):
        peers.maxtext_args(cfg, 3, 5, "/tmp/out")


def test_log_parsed_after_step_0_and_warmup():
    one = peers.parse_steps(LOG, warmup=1)  # steps 2-5: 0.110 0.175 0.192 0.185
    assert one["steps_timed"] == 4
    assert one["step_time"] == pytest.approx(0.180)
    assert one["step_time_spread"] == pytest.approx((0.192 - 0.110) / 0.180)
    assert one["tflops_per_device"] == pytest.approx(0.046)
    two = peers.parse_steps(LOG, warmup=2)  # steps 3-5
    assert (two["steps_timed"], two["step_time"]) == (3, pytest.approx(0.185))
    assert two["step_time_spread"] == pytest.approx(0.017 / 0.185)
    assert peers._num_params(Path("/nonexistent"), LOG) == 7_000_000  # the log's 3 decimals
    with pytest.raises(peers.PeerError, match="none after step 0 and 5 warmup steps"):
        peers.parse_steps(LOG, warmup=5)


def _fake_python(tmp_path, run: str) -> str:
    """A `python` that answers the probe as MaxText 0.2.5 on one CPU and runs `run` for -m."""
    fake = tmp_path / "python"
    fake.write_text(
        "#!/bin/sh\n"
        'if [ "$1" = -c ]; then echo \'{"version": "0.2.5", "base": "b.yml", '
        '"platform": "cpu", "devices": 1}\'; exit 0; fi\n' + run + "\n")
    fake.chmod(0o755)
    return str(fake)


def test_missing_maxtext_is_one_line_naming_the_install(tmp_path):
    cfg = config.load([ROOT / "configs" / "tiny.yaml"])
    bare = tmp_path / "python"  # the same interpreter without site-packages: no maxtext
    bare.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    bare.chmod(0o755)
    with pytest.raises(peers.PeerError) as e:
        peers.run_maxtext(cfg, 1, 2, 1, 60, python=str(bare))
    assert "\n" not in str(e.value)
    assert str(e.value).startswith(f"MaxText is not installed in {bare}: "
                                   "pip install --no-deps maxtext==0.2.5 pathwaysutils ")
    assert "ml-collections" in str(e.value)
    with pytest.raises(peers.PeerError, match="no Python at /nonexistent/python"):
        peers.run_maxtext(cfg, 1, 2, 1, 60, python="/nonexistent/python")


@pytest.mark.parametrize("run, error", [
    ("echo 'jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while "
     "trying to allocate 9.50GiB.'; exit 1",
     "MaxText ran out of memory: jaxlib.xla_extension.XlaRuntimeError: RESOURCE_EXHAUSTED: Out "
     "of memory while trying to allocate 9.50GiB."),
    ("echo Traceback; echo \"ModuleNotFoundError: No module named 'qwix'\"; echo; exit 1",
     "MaxText failed (exit status 1): ModuleNotFoundError: No module named 'qwix'; install what "
     "MaxText's train step imports: pip install --no-deps maxtext==0.2.5 pathwaysutils"),
    ("sleep 30", "MaxText did not finish within 2 s"),
])
def test_a_failed_run_is_one_line(tmp_path, run, error):
    cfg = config.load([ROOT / "configs" / "tiny.yaml"])
    with pytest.raises(peers.PeerError) as e:
        peers.run_maxtext(cfg, 1, 2, 1, 2, python=_fake_python(tmp_path, run))
    assert str(e.value).startswith(error) and "\n" not in str(e.value)


def test_maxtext_trains_tiny_on_the_same_model():
    pytest.importorskip("maxtext")
    cfg = config.load([ROOT / "configs" / "tiny.yaml"], ["train.seq_len=128", "train.batch_size=2"])
    found = peers.run_maxtext(cfg, 1, 3, 1, 600)
    assert found["peer"] == "maxtext 0.2.5" and found["steps_timed"] == 3
    assert 0 < found["step_time"] < 60 and found["step_time_spread"] >= 0
    assert found["tokens_per_sec"] == pytest.approx(2 * 128 / found["step_time"])
    assert found["tflops_per_device"] > 0
    # the same model: MaxText's exact parameter count is jaxtron's (7,342,336)
    tx = optim.make_optimizer(cfg)
    assert found["num_params"] == state.make_plan(cfg, tx, 1).num_params == 7_342_336
    assert found["settings"]["attention"] == "dot_product"
    assert found["settings"]["per_device_batch_size"] == "2"
    assert found["settings"]["platform"] == "cpu" and found["settings"]["devices"] == 1
    assert os.environ["XLA_FLAGS"].count("device_count=8")  # the suite's 8 devices, untouched
