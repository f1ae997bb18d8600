"""Model families (jaxtron/model/families.py): model.family picks the module that builds the
model and fixes the settings that make that family; a config without the key is the family its
settings make, as before the key existed; presets name theirs and imports record theirs."""

import dataclasses
from pathlib import Path

import pytest
from flax import nnx

from jaxtron import config
from jaxtron.config import ConfigError, MLAConfig, ModelConfig, MoEConfig
from jaxtron.hf import config_json
from jaxtron.model import decoder, deepseek, families, gemma, gpt_oss

ROOT = Path(__file__).resolve().parent.parent
SMALL = ModelConfig(vocab_size=64, num_layers=1, d_model=16, num_heads=2, num_kv_heads=1,
                    mlp_dim=24, dtype="float32")
# the settings that make each family, from a config without the key
EXPERTS = MoEConfig(num_experts=4)
LATENT = MLAConfig(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
MADE_BY = {"llama": {}, "mistral": {"sliding_window": 32}, "qwen2": {"qkv_bias": True},
           "qwen3": {"qk_norm": True}, "mixtral": {"moe": EXPERTS},
           "qwen3_moe": {"moe": EXPERTS, "qk_norm": True},
           "deepseek_v3": {"moe": MoEConfig(num_experts=4, scoring="sigmoid"),
                           "num_kv_heads": 2, "mla": LATENT},
           "deepseek_v2": {"moe": EXPERTS, "num_kv_heads": 2, "mla": LATENT},
           "gpt_oss": {"moe": EXPERTS, "qkv_bias": True, "attn_sinks": True}}
# families that only model.family makes (their blocks differ in ways no other setting says),
# with the settings they fix; unnamed, those settings make the family beside them
NAMED_ONLY = {"gemma2": ({}, "llama"), "gemma3_text": ({"qk_norm": True}, "qwen3")}


def test_every_family_is_made_by_its_settings_and_builds_its_module():
    assert set(MADE_BY) | set(NAMED_ONLY) == set(families.FAMILIES)
    for name, settings in MADE_BY.items():
        unnamed = dataclasses.replace(SMALL, **settings)
        named = dataclasses.replace(unnamed, family=name)
        assert families.family_of(unnamed) == families.family_of(named) == name
        families.check(named)
        model = families.build(named, nnx.Rngs(0))
        module = (deepseek if name.startswith("deepseek") else gpt_oss if name == "gpt_oss"
                  else decoder)
        assert type(model) is module.Transformer and model.cfg == named
        experts = hasattr(model.layers.mlp, "router")
        assert experts == ("moe" in settings), name
    for name, (settings, unnamed_family) in NAMED_ONLY.items():
        named = dataclasses.replace(SMALL, family=name, **settings)
        families.check(named)
        assert families.family_of(dataclasses.replace(named, family="")) == unnamed_family
        model = families.build(named, nnx.Rngs(0))
        assert type(model) is gemma.Transformer and model.cfg == named
        assert hasattr(model.layers, "post_mlp_norm"), name


@pytest.mark.parametrize("family, settings, needs", [
    ("qwen2", {}, "model.qkv_bias=true"),
    ("llama", {"qk_norm": True}, "model.qk_norm=false"),
    ("mixtral", {}, "model.moe.num_experts > 0"),
    ("qwen3", {"moe": EXPERTS, "qk_norm": True}, "model.moe.num_experts=0"),
    ("deepseek_v3", {"moe": EXPERTS}, "model.mla.kv_lora_rank > 0"),
    ("deepseek_v3", {"moe": EXPERTS, "num_kv_heads": 2, "mla": LATENT},
     "model.moe.scoring=sigmoid"),
    ("deepseek_v2", {"moe": MoEConfig(num_experts=4, scoring="sigmoid"), "num_kv_heads": 2,
                     "mla": LATENT}, "model.moe.scoring=softmax"),
    ("gpt_oss", {"moe": EXPERTS, "qkv_bias": True}, "model.attn_sinks=true"),
    ("llama", {"attn_sinks": True}, "model.attn_sinks=false"),
])
def test_a_family_without_its_settings_is_refused_in_one_line(family, settings, needs):
    cfg = dataclasses.replace(SMALL, family=family, **settings)
    with pytest.raises(ConfigError) as refused:
        families.check(cfg)
    message = str(refused.value)
    assert f"model.family={family} needs" in message and needs in message, message
    assert f"model.family={families.family_of(dataclasses.replace(cfg, family=''))}" in message


def test_an_unknown_family_is_refused_naming_the_families():
    with pytest.raises(ConfigError, match="model.family=gemma3 is not one of llama, mistral"):
        families.check(dataclasses.replace(SMALL, family="gemma3"))


def test_the_gpu_presets_name_their_family():
    """Every preset but the CPU test beds (tiny, tiny_moe: their settings are turned to other
    families' in tests) names its family, and its settings are that family's."""
    presets = sorted((ROOT / "configs").glob("*.yaml"))
    named = {}
    for path in presets:
        if path.stem in ("tiny", "tiny_moe", "gpu_base"):
            continue
        cfg = config.load([str(path)], [])
        families.check(cfg.model)
        named[path.stem] = cfg.model.family
    assert named["llama3_70b_pp8"] == "llama" and named["qwen3_30b_a3b"] == "qwen3_moe"
    assert named["mixtral_8x7b"] == "mixtral" and all(named.values()), named


@pytest.mark.parametrize("model_type", sorted(MADE_BY))
def test_an_import_records_its_family(model_type):
    hf = {"model_type": model_type, "vocab_size": 64, "num_hidden_layers": 1, "hidden_size": 16,
          "num_attention_heads": 2, "intermediate_size": 24, "num_local_experts": 4,
          "num_experts_per_tok": 2, "moe_intermediate_size": 24,
          # deepseek_v3's: latent attention, routed and shared experts
          "kv_lora_rank": 8, "q_lora_rank": None, "qk_nope_head_dim": 4, "qk_rope_head_dim": 4,
          "v_head_dim": 4, "n_routed_experts": 4, "n_shared_experts": 1, "n_group": 1,
          "topk_group": 1, "first_k_dense_replace": 0}
    overrides = config_json.config_from_hf(hf)
    assert overrides["family"] == model_type
    families.check(ModelConfig(**overrides))
