"""model.remat=auto and train.microbatches=auto (jaxtron/plan/autofit.py): the least recompute, then
the fewest microbatches, whose estimated peak leaves 10% of the target's usable memory free."""

import re
from pathlib import Path

import pytest

import launch
from jaxtron.config import ConfigError, load
from jaxtron.plan import autofit, memory
from jaxtron.program import aot
from jaxtron.step.optim import make_optimizer
from jaxtron.step.state import make_plan

ROOT = Path(__file__).resolve().parent.parent
H100 = int(aot.capacity_bytes("h100") * 0.9)  # xla.mem_fraction's default
# Each preset and the smallest cluster it is meant for (README's preset table).
CLUSTERS = {"gpt2_124m": 1, "llama3_1b": 1, "llama2_7b": 8, "llama3_8b": 8, "llama3_70b": 64,
            "llama3_70b_pp8": 128}


def _preset(name: str, *overrides: str):
    return load([ROOT / "configs" / f"{name}.yaml"], list(overrides))


def _peak(cfg, devices: int) -> int:
    return sum(memory.estimate(cfg, make_plan(cfg, make_optimizer(cfg), devices)).values())


@pytest.mark.parametrize("name", CLUSTERS)
def test_every_gpu_preset_chooses_a_layout_with_a_tenth_spare_on_its_cluster(name):
    """The 70B presets pin what the planner's --verify recommends (llama3_70b: remat=full in one
    pass, auto's save_dots with 8 microbatches compiles to 67.9 GiB there; llama3_70b_pp8:
    save_dots under 1f1b, on its mesh): kept as they are."""
    cfg = aot.for_gpus(_preset(name))
    pinned = {"llama3_70b": "full", "llama3_70b_pp8": "save_dots"}.get(name)
    assert cfg.model.remat == (pinned or "auto")
    chosen, line = autofit.resolve(cfg, CLUSTERS[name], H100, "one H100")
    assert chosen.model.remat in autofit.POLICIES and chosen.train.microbatches >= 1
    assert _peak(chosen, CLUSTERS[name]) <= 0.9 * H100, line
    if not pinned:
        assert line.startswith("auto: model.remat=") and "free (at least 10% kept)" in line


def test_the_choice_is_the_least_recompute_then_the_fewest_microbatches():
    """llama3_8b on 8 H100s: no microbatch count lets remat=none fit (one sequence per GPU
    already needs more than the budget); save_dots does at 16 microbatches and not at 8."""
    cfg = aot.for_gpus(_preset("llama3_8b"))
    found = autofit.candidates(cfg, 8)
    budget = 0.9 * H100
    chosen, line = autofit.resolve(cfg, 8, H100, "one H100")
    assert (chosen.model.remat, chosen.train.microbatches) == ("save_dots", 16)
    assert min(peak for remat, _, peak in found if remat == "none") > budget
    by_count = {count: peak for remat, count, peak in found if remat == "save_dots"}
    assert by_count[16] <= budget < by_count[8]
    least_none = min(peak for remat, _, peak in found if remat == "none")
    assert f"less recompute needs {least_none / 2**30:.1f} GiB at the least" in line
    # everything fits on a large enough device: no recompute, no microbatches
    roomy, _ = autofit.resolve(cfg, 8, 100 * H100, "a large GPU")
    assert (roomy.model.remat, roomy.train.microbatches) == ("none", 1)


def test_nothing_fits_takes_the_least_memory_and_says_so():
    cfg = aot.for_gpus(_preset("llama3_8b"))
    chosen, line = autofit.resolve(cfg, 8, 2**30, "a small GPU")
    assert (chosen.model.remat, chosen.train.microbatches) == ("full", 16)
    assert re.search(r"the least memory, and still [\d.]+ GiB per device estimated against "
                     r"1\.0 GiB usable on a small GPU: nothing fits", line)
    unknown, line = autofit.resolve(cfg, 8, None, "CPU devices")
    assert (unknown.model.remat, unknown.train.microbatches) == ("full", 16)
    assert "no memory limit is known for CPU devices" in line


def test_a_given_value_is_kept_and_only_the_other_is_chosen():
    cfg = aot.for_gpus(_preset("llama3_8b", "model.remat=full"))
    chosen, line = autofit.resolve(cfg, 8, H100, "one H100")
    assert chosen.model.remat == "full" and chosen.train.microbatches == 4
    assert line.startswith("auto: train.microbatches=4:") and "model.remat" not in line
    fixed = aot.for_gpus(_preset("llama3_8b", "train.microbatches=16"))
    assert autofit.resolve(fixed, 8, H100, "one H100")[0].model.remat == "save_dots"
    explicit = _preset("llama3_8b", "model.remat=full", "train.microbatches=4")
    assert autofit.resolve(explicit, 8, H100, "one H100") == (explicit, "")


def test_auto_is_read_from_presets_and_overrides_and_refused_with_a_pipeline():
    assert _preset("llama3_8b").train.microbatches == autofit.AUTO_MICROBATCHES
    assert _preset("llama3_8b", "train.microbatches=4").train.microbatches == 4
    assert load([], ["train.microbatches=auto"]).train.microbatches == autofit.AUTO_MICROBATCHES
    with pytest.raises(ConfigError, match=r"train.microbatches=-1 must be auto or positive"):
        load([], ["train.microbatches=-1"])
    with pytest.raises(ConfigError, match="model.remat=fastest is not one of .*full, .*auto"):
        _checked("fastest")
    piped = _preset("llama3_8b", "mesh.stage=2", "mesh.fsdp=4")
    with pytest.raises(ConfigError, match=r"train.microbatches=auto is for runs without a "
                                          r"pipeline; with mesh.stage=2 give a number"):
        autofit.resolve(piped, 8, H100, "one H100")


def _checked(remat: str) -> None:
    from jaxtron import model

    model.check(load([], [f"model.remat={remat}"]).model)


def test_the_dry_run_and_a_cpu_run_say_what_auto_chose(tmp_path, capsys):
    """The dry run against an H100 (--gpu) prints the choice and the verdict agrees; a run on
    CPU devices (no limit known) logs the least-memory choice and trains with it."""
    assert launch.main(["--config", str(ROOT / "configs/llama3_8b.yaml"), "--dry-run", "--gpu",
                        "h100", "--devices", "8", f"run.dir={tmp_path / 'plan'}"]) in (0, None)
    out = capsys.readouterr().out
    assert re.search(r"^auto: model.remat=save_dots and train.microbatches=16: [\d.]+ GiB per "
                     r"device estimated, \d+% of the 71.2 GiB usable on one H100 free", out, re.M)
    assert "verdict: fits" in out and "microbatches: 16" in out and "remat: save_dots" in out
    rows = launch.main(["model.remat=auto", "train.microbatches=auto", "train.steps=2",
                        "train.batch_size=16", "train.log_every=1", "run.progress=lines",
                        f"run.dir={tmp_path / 'run'}"])
    assert rows in (0, None)
    out = capsys.readouterr().out
    assert re.search(r"^.*auto: model.remat=full and train.microbatches=[12], the least memory "
                     r".*no memory limit is known for CPU devices", out, re.M), out[-2000:]
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "remat: full" in saved and "microbatches: 0" not in saved


def test_options_this_jaxlib_does_not_know_are_left_out():
    """jax 0.11's XLA has no xla_gpu_enable_pipelined_all_gather compile option (it refused the
    whole compile with it); compile_with drops it and compiles, and raises anything else."""
    calls = []

    def compile(options):
        calls.append(options)
        if options and "xla_gpu_enable_pipelined_all_gather" in options:
            raise RuntimeError("INVALID_ARGUMENT: No such compile option: "
                               "'xla_gpu_enable_pipelined_all_gather'")
        return "compiled"

    both = {**autofit.NO_PIPELINED_GATHER, **autofit.NO_LIMIT}
    assert autofit.compile_with(compile, both) == "compiled"
    assert calls[-1] == autofit.NO_LIMIT
    assert autofit.compile_with(compile, autofit.NO_PIPELINED_GATHER) == "compiled"
    assert calls[-1] is None

    def broken(options):
        raise RuntimeError("RESOURCE_EXHAUSTED: out of memory")

    with pytest.raises(RuntimeError, match="out of memory"):
        autofit.compile_with(broken, both)
