"""Our Llama forward equals Hugging Face transformers' on random tiny weights, via jaxtron/hf/model_dir.py.

Each case builds the real HF model (torch, float32, eval) with every weight randomised (norm scales
and biases too, so a swapped or dropped tensor shows), converts its state dict with the one
MAPPING table, and compares logits with ours in float32.

Measured max |logit diff| (transformers 5.23, torch 2.13 CPU, jax 0.10 CPU), single / packed:
llama2 1.0e-5 / 5.7e-6, llama3 1.5e-5 / 1.2e-5, qwen2 8.0e-6 / 5.5e-6, mistral 1.1e-5 / 6.5e-6.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import HF_CASES, HF_TINY, HF_TOL, hf_case, hf_inputs, hf_logits

from jaxtron import config, hf
from jaxtron.config import ConfigError, ModelConfig
from jaxtron.hf import config_json
from jaxtron.hf import mapping as hf_mapping
from jaxtron.model import abstract_model


def _ours(cfg: ModelConfig, params: dict, tokens, positions, segment_ids) -> np.ndarray:
    """Our logits for numpy params and inputs."""
    graphdef, _ = nnx.split(abstract_model(cfg))
    model = nnx.merge(graphdef, jax.tree.map(jnp.asarray, params))
    return np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(segment_ids)))


@pytest.mark.parametrize("name", list(HF_CASES))
def test_logits_match_hf(name):
    hf_model, cfg, _, params = hf_case(name)
    tokens, positions, segment_ids = hf_inputs(HF_CASES[name][2])
    ref = hf_logits(hf_model, tokens, positions)
    ours = _ours(cfg, params, tokens, positions, segment_ids)
    diff = np.abs(ours - ref).max()
    print(f"{name}: max |logit diff| {diff:.2e} (logit scale {np.abs(ref).max():.1f})")
    assert diff < HF_TOL, (f"{name}: logits differ from transformers by {diff:.2e} "
                           f"(tolerance {HF_TOL})")


def test_llama3_rope_scaling_matters():
    """Without the llama3 frequency scaling the same weights must miss HF by far more than
    HF_TOL."""
    hf_model, cfg, _, params = hf_case("llama3")
    tokens, positions, segment_ids = hf_inputs(HF_CASES["llama3"][2])
    unscaled = dataclasses.replace(cfg, rope_scaling_factor=0.0)
    diff = np.abs(_ours(unscaled, params, tokens, positions, segment_ids)
                  - hf_logits(hf_model, tokens, positions)).max()
    assert diff > 100 * HF_TOL, (f"rope scaling moved logits by only {diff:.2e}: the case tests "
                                 "nothing")


@pytest.mark.parametrize("name", list(HF_CASES))
def test_packed_documents_match_hf_alone(name):
    """Two documents packed in one row (segments 1, 2; positions restart) = each run alone in HF."""
    hf_model, cfg, _, params = hf_case(name)
    lengths = (HF_CASES[name][2] * 5 // 8, HF_CASES[name][2] * 3 // 8)
    docs = [hf_inputs(n, batch=1, seed=i + 1)[0] for i, n in enumerate(lengths)]
    tokens = np.concatenate(docs, axis=1)
    positions = np.concatenate([np.arange(n, dtype=np.int32) for n in lengths])[None]
    segment_ids = np.concatenate([np.full(n, i + 1, np.int32) for i, n in enumerate(lengths)])[None]
    ours = _ours(cfg, params, tokens, positions, segment_ids)
    ref = np.concatenate([hf_logits(hf_model, d, np.arange(d.shape[1])[None]) for d in docs],
                         axis=1)
    diff = np.abs(ours - ref).max()
    print(f"{name} packed: max |logit diff| {diff:.2e}")
    assert diff < HF_TOL, f"{name}: packed logits differ from per-document HF by {diff:.2e}"


@pytest.mark.parametrize("name", list(HF_CASES))
def test_round_trip_is_exact(name):
    _, cfg, hf_tensors, params = hf_case(name)
    back = hf_mapping.params_to_hf(params, cfg)
    if cfg.tie_embeddings:  # HF's state dict lists the shared head too; checkpoints omit it
        hf_tensors = {k: v for k, v in hf_tensors.items() if k != "lm_head.weight"}
    assert sorted(back) == sorted(hf_tensors)
    for key, value in hf_tensors.items():
        assert back[key].dtype == value.dtype and np.array_equal(back[key], value), key


@pytest.mark.parametrize("window", [{}, {"use_sliding_window": False}],
                         ids=["mistral-default", "use_sliding_window-false"])
def test_mistral_attends_within_its_window_past_its_length(window):
    """A Mistral with a 64-token window at 256 tokens (4x the window): the window converts as
    model.sliding_window, which moves HF's logits by far more than the tolerance, and ours equal
    HF's within it, one document per row and packed. Measured: 1.4e-6 at most."""
    config_cls, model_cls, _, overrides = HF_CASES["mistral"]
    hf_model = hf_case("mistral")[0]
    # HF Mistral reads only sliding_window; a stray use_sliding_window=false does not turn it off.
    windowed = model_cls(config_cls(**HF_TINY, **{**overrides, "sliding_window": 64,
                                                  "max_position_embeddings": 512, **window}))
    windowed.load_state_dict(hf_model.state_dict())
    tokens, positions, segments = hf_inputs(256)
    want = hf_logits(windowed.eval(), tokens, positions)
    diff = np.abs(want - hf_logits(hf_model, tokens, positions)).max()
    assert diff > 100 * HF_TOL, f"a window of 64 over 256 tokens moved HF logits by {diff:.2e}"
    overrides = config_json.config_from_hf(windowed.config.to_dict())
    assert (overrides["sliding_window"], overrides["global_every"]) == (64, 0)
    assert config.load(overrides=[f"model.{k}={v}" for k, v in overrides.items()]
                       + ["train.seq_len=256"]).model.sliding_window == 64
    cfg = ModelConfig(**overrides, dtype="float32", param_dtype="float32")
    params = hf_case("mistral")[3]
    got = hf.logits(cfg, params, tokens)
    print(f"window 64 at 256 tokens: {np.abs(got - want).max():.2e} from HF")
    assert np.abs(got - want).max() < HF_TOL
    # two documents in a row, the second 150 tokens (past the window) from position 0
    positions[:, 106:] -= 106
    segments[:, 106:] = 2
    packed = _ours(cfg, params, tokens, positions, segments)
    alone = hf_logits(windowed.eval(), tokens[:, 106:], positions[:, 106:])
    assert np.abs(packed[:, 106:] - alone).max() < HF_TOL
    assert np.abs(packed[:, :106] - want[:, :106]).max() < HF_TOL


def test_unknown_and_missing_names_are_named():
    _, cfg, hf_tensors, _ = hf_case("llama2")
    extra = {**hf_tensors, "model.layers.0.self_attn.o_proj.bias": np.zeros(64, np.float32),
             "model.layers.0.self_attn.rotary_emb.inv_freq": np.zeros(8, np.float32)}
    with pytest.raises(ValueError, match=r"o_proj\.bias") as err:
        hf_mapping.hf_to_params(extra, cfg)
    assert "inv_freq" not in str(err.value)  # buffers are dropped, not reported
    partial = {k: v for k, v in hf_tensors.items() if k != "model.layers.1.mlp.up_proj.weight"}
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight"):
        hf_mapping.hf_to_params(partial, cfg)


def test_config_from_transformers4_style_json():
    """Hub config.json files written by transformers 4 keep rope_theta and rope_scaling apart."""
    config = {"model_type": "llama", "vocab_size": 128256, "hidden_size": 2048,
          "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 32,
          "num_key_value_heads": 8, "head_dim": 64, "rms_norm_eps": 1e-5, "hidden_act": "silu",
          "max_position_embeddings": 131072, "rope_theta": 500000.0, "tie_word_embeddings": True,
          "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                           "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    cfg = ModelConfig(**config_json.config_from_hf(config))
    assert (cfg.num_kv_heads, cfg.head_size, cfg.rope_theta) == (8, 64, 500000.0)
    assert (cfg.rope_scaling_factor, cfg.rope_original_max_len) == (32.0, 8192)
    assert cfg.tie_embeddings and not cfg.qkv_bias and cfg.norm_eps == 1e-5
    with pytest.raises(ValueError, match="yarn"):
        config_json.config_from_hf({**config, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})


@pytest.mark.parametrize("name", list(HF_CASES))
def test_directory_in_and_out(tmp_path, name):
    """A directory saved by transformers (safetensors) reads with jaxtron.hf.from_pretrained and
    gives transformers' logits through jaxtron.hf.logits; written back with save_pretrained it
    loads in transformers with no missing or unexpected weight, the same tensors and logits."""
    from transformers import AutoModelForCausalLM

    hf_model, _, hf_tensors, _ = hf_case(name)
    hf_model.save_pretrained(tmp_path / "hf", max_shard_size="100KB")  # sharded, with an index
    assert (tmp_path / "hf" / hf.INDEX).is_file()
    cfg, params = hf.from_pretrained(tmp_path / "hf")
    tokens, positions, _ = hf_inputs(HF_CASES[name][2])
    ref = hf_logits(hf_model, tokens, positions)
    assert np.abs(hf.logits(cfg, params, tokens) - ref).max() < HF_TOL

    model_type = hf_model.config.model_type
    hf.save_pretrained(cfg, params, tmp_path / "out", model_type)
    back, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(back).__name__ == type(hf_model).__name__
    written = hf.read_tensors(tmp_path / "out")
    for key, value in written.items():
        np.testing.assert_array_equal(value, hf_tensors[key])
    assert np.abs(hf_logits(back.eval(), tokens, positions) - ref).max() < HF_TOL


def test_pickled_checkpoints_are_refused(tmp_path):
    hf_model, *_ = hf_case("llama2")
    hf_model.config.save_pretrained(tmp_path)
    torch.save(hf_model.state_dict(), tmp_path / "pytorch_model.bin")  # the older pickled layout
    with pytest.raises(ConfigError, match="only pickled weights .*pytorch_model.bin"):
        hf.from_pretrained(tmp_path)


def test_a_missing_router_aux_loss_coef_is_transformers_default():
    """A config.json without router_aux_loss_coef imported model.moe.aux_coef=0.01; transformers
    trains such a model with its config class's default, 0.001 for Mixtral and Qwen3-MoE."""
    from transformers import MixtralConfig, Qwen3MoeConfig

    for config_cls in (MixtralConfig, Qwen3MoeConfig):
        config = config_cls(**{k: v for k, v in HF_TINY.items() if k != "attn_implementation"},
                            num_attention_heads=4).to_dict()
        default = config.pop("router_aux_loss_coef")
        assert default == config_cls().router_aux_loss_coef == 0.001
        assert config_json.config_from_hf(config)["moe"].aux_coef == default
        assert config_json.config_from_hf({**config, "router_aux_loss_coef": 0.02})[
            "moe"].aux_coef == 0.02


def test_a_windowed_model_exports_as_mistral_not_llama(tmp_path):
    """Llama has no attention window: a Llama-style model (no model.family) with
    model.sliding_window is Mistral by default, and written as llama it is refused in one line
    rather than lose its window."""
    _, cfg, _, params = hf_case("mistral")
    cfg = dataclasses.replace(cfg, family="")  # the import recorded mistral
    windowed = dataclasses.replace(cfg, sliding_window=16)
    assert (hf.model_type_of(cfg), hf.model_type_of(windowed)) == ("llama", "mistral")
    with pytest.raises(ConfigError, match=r"'llama' has no attention window.*"
                                          r"model.sliding_window=16\); write it as 'mistral'$"):
        hf.save_pretrained(windowed, params, tmp_path / "llama", "llama")
    hf.save_pretrained(windowed, params, tmp_path / "out", hf.model_type_of(windowed))
    assert hf.read_config(tmp_path / "out").sliding_window == 16
