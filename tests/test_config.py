"""Presets, `base:` inheritance and typed overrides."""

import re
from pathlib import Path

import pytest
from flax import nnx

from jaxtron import config
from jaxtron.model import abstract_model, count_params

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

# Published parameter counts (Hugging Face safetensors totals).
PUBLISHED = {
    "llama3_1b": 1_235_814_400,  # Llama 3.2 1B, tied embeddings
    "llama2_7b": 6_738_415_616,
    "llama3_8b": 8_030_261_248,
    "llama3_70b": 70_553_706_496,
}


@pytest.mark.parametrize("name", sorted(p.stem for p in CONFIGS.glob("*.yaml")))
def test_every_preset_loads(name):
    cfg = config.load([CONFIGS / f"{name}.yaml"])
    assert cfg.model.num_heads % cfg.model.num_kv_heads == 0


@pytest.mark.parametrize("name,expected", sorted(PUBLISHED.items()))
def test_preset_parameter_count_matches_published(name, expected):
    cfg = config.load([CONFIGS / f"{name}.yaml"])
    assert count_params(nnx.state(abstract_model(cfg.model))) == expected


def test_gpt2_124m_preset_is_gpt2_small_sized():
    cfg = config.load([CONFIGS / "gpt2_124m.yaml"])
    assert count_params(nnx.state(abstract_model(cfg.model))) == 123_587_328


def test_base_inheritance_and_override_order(tmp_path):
    (tmp_path / "a.yaml").write_text("train:\n  steps: 7\n  seq_len: 64\nmodel:\n  num_layers: 2\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\ntrain:\n  steps: 9\n")
    cfg = config.load([tmp_path / "b.yaml"], ["train.seq_len=32", "optim.lr=1e-3"])
    assert (cfg.train.steps, cfg.train.seq_len, cfg.model.num_layers) == (9, 32, 2)
    assert cfg.optim.lr == 1e-3 and isinstance(cfg.optim.lr, float)


def test_overrides_are_typed():
    cfg = config.load([], ["model.tie_embeddings=true", "train.steps=5", "run.dir=x/y"])
    assert cfg.model.tie_embeddings is True and cfg.train.steps == 5 and cfg.run.dir == "x/y"
    with pytest.raises(config.ConfigError, match="model.tie_embeddings"):
        config.load([], ["model.tie_embeddings=maybe"])


def test_config_is_frozen_and_round_trips_through_yaml(tmp_path):
    cfg = config.load([CONFIGS / "llama3_8b.yaml"])
    with pytest.raises(AttributeError):
        cfg.train.steps = 1
    (tmp_path / "saved.yaml").write_text(config.to_yaml(cfg))
    assert config.load([tmp_path / "saved.yaml"]) == cfg


def test_yaml_base_cycle_is_reported(tmp_path):
    (tmp_path / "a.yaml").write_text("base: b.yaml\n")
    (tmp_path / "b.yaml").write_text("base: a.yaml\n")
    with pytest.raises(config.ConfigError, match="cycle"):
        config.load([tmp_path / "a.yaml"])


@pytest.mark.parametrize("preset", sorted(p.name for p in CONFIGS.glob("*.yaml")))
def test_every_preset_checkpoints_during_its_run(preset):
    """A job killed by anything but a signal loses at most `checkpoint.every` steps."""
    cfg = config.load([CONFIGS / preset])
    assert 0 < cfg.checkpoint.every < cfg.train.steps


def test_yaml_errors_name_the_line_and_column(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_layers: [3\ntrain:\n  steps: 5\n")
    with pytest.raises(config.ConfigError, match=rf"^{bad}:3:6: not valid YAML \(expected ','"):
        config.load([bad])


def test_a_directory_as_config_lists_its_presets():
    with pytest.raises(config.ConfigError, match=r"is a directory; give one preset file from it "
                                                 r"\(deepseek_v3.yaml, gemma3_27b.yaml, .*tiny.yaml, "
                                                 r"tiny_deepseek.yaml, tiny_moe.yaml\)"):
        config.load([CONFIGS])


@pytest.mark.parametrize("override,message", [
    ("train.steps=3.5", "train.steps must be an integer, got 3.5"),
    ("optim.lr=fast", "optim.lr must be a number, got fast"),
    ("model.tie_embeddings=maybe", "model.tie_embeddings must be true or false, got maybe"),
    ("run.profile_steps=[1,x]", "run.profile_steps[1] must be an integer, got x"),
    ("run.dir=[a,b]", "run.dir must be a string, got [a,b]"),
    ("xla.flags=--xla_dump_to=/tmp/hlo",
     "xla.flags is a list: write xla.flags=[--xla_dump_to=/tmp/hlo] (items separated by commas)"),
    ("xla.flags=--a,--b", "xla.flags is a list: write xla.flags=[--a,--b]"),
    ("xla.flags=null", "xla.flags is a list: write xla.flags=[] for none, or xla.flags=[A,B]"),
    ("run.profile_steps=3",  # it said [3], then "must be [first, last]"
     "run.profile_steps is [first, last]: write run.profile_steps=[3,3] to trace step 3"),
    ("=3", "'=3': an override is section.key=value, e.g. train.steps=100"),
    ("train..steps=3", "'train..steps=3': an override is section.key=value"),
    ("steps", "'steps': an override is section.key=value"),
    ("configs/tiny.yaml", "; a preset is loaded with --config configs/tiny.yaml"),
    ("data.mixture=[{path:/data/web}]",
     "'data.mixture[0].path:/data/web': YAML needs a space after the colon, e.g. "
     "{path: /data/web}"),
])
def test_a_bad_override_says_what_to_type(override, message):
    """OmegaConf's own wording ('could not be converted to Integer', 'AnyNode is not a
    ListConfig') never reaches the user: the line names the key, its type and the spelling."""
    with pytest.raises(config.ConfigError) as e:
        config.load([], [override])
    assert message in str(e.value)
    assert "Node" not in str(e.value) and "converted" not in str(e.value)


@pytest.mark.parametrize("section", ["train: []", "model: [1]", "model: 5", "xla: null"])
def test_a_section_that_is_no_mapping_is_one_line_under_a_base_too(tmp_path, section):
    """Under a `base:` a list in a section's place was OmegaConf's TypeError traceback ("Cannot
    merge incompatible container types"); now the line a preset without a base gets."""
    (tmp_path / "a.yaml").write_text("train:\n  steps: 9\nmodel:\n  num_layers: 2\n")
    (tmp_path / "b.yaml").write_text(f"base: a.yaml\n{section}\n")
    (tmp_path / "c.yaml").write_text(f"{section}\n")
    name = section.split(":")[0]
    for preset in ("b.yaml", "c.yaml"):
        with pytest.raises(config.ConfigError, match=rf"^{tmp_path / preset}: '{name}' is a "
                           rf"section; set its keys, e.g. {name}.<key>=...$"):
            config.load([tmp_path / preset])


@pytest.mark.parametrize("name", ["tiny", "tiny.yaml"])
def test_a_preset_name_loads_the_shipped_preset_from_any_directory(name, tmp_path, monkeypatch):
    """`--config tiny` was "config file not found" outside a checkout's root; the presets ship in
    the package (jaxtron/configs) and a name finds them from anywhere. A file of that name in the
    working directory is a path, and wins."""
    monkeypatch.chdir(tmp_path)
    assert config.load([name]) == config.load([CONFIGS / "tiny.yaml"])
    assert config.load([name]).model.num_layers != 3
    (tmp_path / name).mkdir()  # a run's directory named so: still the preset
    assert config.load([name]) == config.load([CONFIGS / "tiny.yaml"])
    (tmp_path / name).rmdir()
    (tmp_path / name).write_text("model:\n  num_layers: 3\n")
    assert config.load([name]).model.num_layers == 3


def test_a_missing_config_names_the_presets(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a checkout's path elsewhere: the name it has
    with pytest.raises(config.ConfigError, match=r"^config file not found: configs/tiny "
                                                 r"\(did you mean --config tiny\?\)$"):
        config.load(["configs/tiny"])
    with pytest.raises(config.ConfigError, match=r"^config file not found: nope; a preset's name "
                                                 r"is one of deepseek_v3, gemma3_27b, .*, llama3_8b, "
                                                 r".*tiny_moe$"):
        config.load(["nope"])


def test_warmup_longer_than_the_run_is_a_warning():
    assert config.check_warnings(config.load([CONFIGS / "tiny.yaml"])) == []
    [warning] = config.check_warnings(config.load([], ["train.steps=10", "optim.warmup_steps=11"]))
    assert warning.startswith("optim.warmup_steps=11 is more than train.steps=10: the run ends "
                              "during warm-up")
    assert config.check_warnings(config.load([], ["train.steps=10", "optim.warmup_steps=10"])) == []


def test_an_empty_preset_is_refused(tmp_path):
    """A preset file with nothing in it (or only comments) is a mistake, not the defaults."""
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing yet\n")
    with pytest.raises(config.ConfigError, match=r"empty.yaml is empty \(or only comments\)"):
        config.load([str(empty)], [])


def test_a_base_that_names_no_file_says_which_preset_named_it(tmp_path):
    (tmp_path / "a.yaml").write_text("base: nothere.yaml\ntrain:\n  steps: 3\n")
    with pytest.raises(config.ConfigError, match=r"a.yaml: base: nothere.yaml names no file"):
        config.load([str(tmp_path / "a.yaml")], [])


def test_a_key_given_twice_is_an_error_naming_its_line(tmp_path):
    """PyYAML keeps the last of two equal keys without a word: an edit that lands above an old
    line would be silently undone."""
    preset = tmp_path / "p.yaml"
    preset.write_text("train:\n  steps: 5\n  batch_size: 8\n  steps: 6\n")
    with pytest.raises(config.ConfigError, match=r"p\.yaml:4:3: not valid YAML \('steps' is given "
                                                 r"twice; the second would silently win"):
        config.load([preset])


@pytest.mark.parametrize("override,message", [
    ("train.steps=0x10", "train.steps must be an integer, got 0x10"),  # YAML 1.1: 16
    ("train.steps=1:30", "train.steps must be an integer, got 1:30"),  # YAML 1.1: 90
    ("run.progress=off", "run.progress=off is not one of auto, bar, lines"),  # YAML 1.1: false
    # OmegaConf turns these strings into booleans for a bool field; the README says they are text
    ("run.tensorboard=off", "run.tensorboard must be true or false, got off"),
    ("model.tie_embeddings=yes", "model.tie_embeddings must be true or false, got yes"),
    ("model.tie_embeddings=1", "model.tie_embeddings must be true or false, got 1"),
])
def test_yaml_1_1_numbers_and_booleans_are_not_guessed(override, message):
    with pytest.raises(config.ConfigError, match=re.escape(message)):
        config.load([], [override])


def test_a_yes_in_a_preset_is_not_true(tmp_path):
    preset = tmp_path / "p.yaml"
    preset.write_text("model:\n  tie_embeddings: yes\n")
    with pytest.raises(config.ConfigError, match=r"p\.yaml: model\.tie_embeddings must be true or "
                                                 r"false, got yes$"):
        config.load([preset])


def test_a_boolean_given_to_a_text_field_is_kept_as_typed():
    """model.remat=true: the refusal said `model.remat=True`, Python's spelling."""
    assert config.load([], ["model.remat=true"]).model.remat == "true"
    assert config.load([], ["run.dir=false"]).run.dir == "false"


def test_a_yaml_merge_key_shares_settings(tmp_path):
    """`<<: *anchor` (YAML's merge key) was "could not determine a constructor for the tag
    merge"; keys given beside it win, as YAML says, and are not "given twice"."""
    (tmp_path / "m.yaml").write_text(
        "data:\n  mixture:\n    - &web {path: /data/web, weight: 2}\n"
        "    - {<<: *web, path: /data/code}\n"
        "train:\n  <<: {steps: 7, log_every: 7}\n  log_every: 1\n")
    cfg = config.load([tmp_path / "m.yaml"])
    assert [(e.path, e.weight) for e in cfg.data.mixture] == [("/data/web", 2), ("/data/code", 2)]
    assert (cfg.train.steps, cfg.train.log_every) == (7, 1)


def test_of_an_override_given_twice_the_last_one_wins():
    """As later files override earlier ones: a base command with a setting appended."""
    cfg = config.load([], ["train.steps=5", "train.batch_size=8", "train.steps=6"])
    assert (cfg.train.steps, cfg.train.batch_size) == (6, 8)


@pytest.mark.parametrize("overrides,warning", [
    (["optim.warmup_steps=4", "optim.decay_steps=2"],
     "optim.decay_steps=2 is not past optim.warmup_steps=4 (it counts the warm-up): the learning "
     "rate drops from optim.lr to its minimum in one step after the warm-up; raise it"),
    (["train.steps=200", "optim.decay_steps=1000"],
     "optim.decay_steps=1000 is more than train.steps=200: the run ends before the decay does "
     "(meant if a later run goes on); 0 decays over train.steps"),
    (["optim.lr=0"], "optim.lr=0: the weights never change; set the peak learning rate"),
    (["pipeline.schedule=circular", "pipeline.repeats=2", "mesh.stage=1"],
     "pipeline.repeats=2 does nothing with mesh.stage=1 (no pipeline); set mesh.stage > 1, or "
     "drop it"),
    (["mesh.stage=4"], "1 microbatch per pass through mesh.stage=4 stages: they idle 75% of each "
     "step (bubble (S-1)/(M+S-1)); raise train.microbatches"),
])
def test_a_schedule_that_is_probably_not_meant_is_a_warning(overrides, warning):
    """Each was accepted without a word (the learning rate fell off a cliff after warm-up; a
    setting that changed nothing)."""
    assert config.check_warnings(config.load([], ["train.steps=200", *overrides])) == [warning]
    assert config.check_warnings(config.load([], ["train.steps=200", "optim.warmup_steps=10"])) == []


def test_a_tilde_is_the_home_directory_in_path_fields(monkeypatch, tmp_path):
    """`run.dir=~` was YAML's null: 'run.dir must be a string, got None'. A leading `~` is the
    home directory, as the README says, alone or followed by a path."""
    monkeypatch.setenv("HOME", str(tmp_path))
    cfg = config.load([], ["run.dir=~", "data.cache_dir=~/cache", "checkpoint.restore=~"])
    assert (cfg.run.dir, cfg.data.cache_dir, cfg.checkpoint.restore) == (
        str(tmp_path), str(tmp_path / "cache"), str(tmp_path))
    with pytest.raises(config.ConfigError, match=r"^train.steps must be an integer, got ~$"):
        config.load([], ["train.steps=~"])


@pytest.mark.parametrize("mixture, said", [
    ("[{path: /a, weight: true}]", "data.mixture[0].weight must be a number, got True"),
    ("[{path: /a}, {path: /b, weight: abc}]", "data.mixture[1].weight must be a number, got abc"),
])
def test_a_bad_value_in_a_mixture_item_names_the_item(mixture, said):
    """It said "bad value for 'weight': Value 'True' of type 'bool' could not be converted to
    Float", naming neither the list nor the item."""
    with pytest.raises(config.ConfigError, match=f"^{re.escape(said)}$"):
        config.load([], ["data.source=arrayrecord", f"data.mixture={mixture}"])


# The experts' keys before model.moe held them, as a checkpoint's or an import's config has them.
FLAT_EXPERTS = {"num_experts": 8, "experts_per_token": 2, "moe_mlp_dim": 192,
                "norm_topk_prob": False, "capacity_factor": 1.5, "moe_aux_coef": 0.02,
                "moe_z_coef": 0.001, "moe_kernel": "xla"}


@pytest.mark.parametrize("old", sorted(config.FLAT_MOE))
def test_an_experts_key_of_before_the_section_is_refused_naming_its_new_one(old):
    with pytest.raises(config.ConfigError) as refused:
        config.load(["configs/tiny.yaml"], [f"model.{old}=1"])
    assert str(refused.value) == f"'model.{old}' is 'model.moe.{config.FLAT_MOE[old]}' now"


def test_a_stored_config_of_before_the_section_is_read_into_it():
    """A checkpoint's meta of before model.moe: its run config (config_of), the model it is
    compared with on resume (model_changes) and inspect-ckpt's model line read the experts."""
    import yaml

    from jaxtron.checkpoint import weights
    from jaxtron.commands.inspect_ckpt import model_summary

    tree = yaml.safe_load(config.to_yaml(config.load(["configs/tiny.yaml"])))
    tree["model"] = {**{k: v for k, v in tree["model"].items() if k != "moe"}, **FLAT_EXPERTS}
    meta = {"config": yaml.safe_dump(tree)}
    want = config.MoEConfig(num_experts=8, experts_per_token=2, mlp_dim=192,
                            norm_topk_prob=False, capacity_factor=1.5, aux_coef=0.02,
                            z_coef=0.001, kernel="xla")
    assert weights.config_of(meta).model.moe == want
    assert config.model_config(tree["model"]).moe == want
    now = config.load(["configs/tiny_moe.yaml"], ["model.moe.mlp_dim=192"]).model
    assert weights.model_changes(meta, now, resume=True) == [
        "model.mlp_dim=768 -> 384", "model.moe.norm_topk_prob=false -> true"]
    assert "moe.num_experts=8, moe.experts_per_token=2, moe.mlp_dim=192" in model_summary(
        meta["config"])
