"""Memory, read from the compiled train step's memory analysis (CPU, nothing allocated).

Measured on a mid-sized model (4 layers, d_model 512, seq 512, batch 8, one device), temporary
memory per remat policy: none 1.90 GB, save_dots 0.72 GB, full 0.62 GB.
"""

from __future__ import annotations

import jax
import pytest

from jaxtron import config, parallel
from jaxtron.model import check_remat
from jaxtron.parallel import mesh as mesh_lib
from jaxtron.plan import memory
from jaxtron.step import abstract_batch, compile_step
from jaxtron.step.optim import make_optimizer
from jaxtron.step.state import make_plan

MID = ["model.num_layers=4", "model.d_model=512", "model.num_heads=8", "model.num_kv_heads=4",
       "model.mlp_dim=1536", "model.vocab_size=1024", "train.seq_len=512"]


def _compiled(num_devices: int, *overrides: str):
    """(memory analysis of the compiled step, plan, config)."""
    cfg = config.load(["configs/tiny.yaml"], [*MID, *overrides])
    tx = make_optimizer(cfg)
    plan = make_plan(cfg, tx, num_devices)
    mesh = parallel.make_mesh(cfg.mesh, jax.devices()[:num_devices])
    shardings = parallel.named(plan.specs, mesh)
    state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                         plan.abstract, shardings)
    with jax.set_mesh(mesh):
        step = compile_step(cfg, plan, tx, mesh).lower(state, abstract_batch(cfg, mesh))
        return step.compile().memory_analysis(), plan, cfg


@pytest.mark.parametrize("stages", [2, 4])
def test_state_bytes_per_device_fall_by_the_stage_count(stages):
    """mesh (data=8/S, stage=S): each device holds 1/S of the params and optimizer state.

    The stacked layers are split into stages, the embedding and LM head over (tensor, stage) along
    the vocabulary; only the final norm's scale (2 KB) stays whole. The compiled step's argument
    bytes, less the batch's (split over data), are the planned state bytes exactly, and fall by S
    to within that norm.
    """
    common = ("mesh.fsdp=1", "train.batch_size=32", "train.microbatches=4")
    one, plan_one, cfg = _compiled(8, "mesh.data=8", *common)
    split, plan_split, _ = _compiled(8, f"mesh.data={8 // stages}", f"mesh.stage={stages}",
                                     *common)

    def batch_bytes(data: int) -> int:  # 4 int32 arrays [batch, seq], split over data
        return 4 * 4 * cfg.train.batch_size * cfg.train.seq_len // data

    def planned(plan) -> int:  # params + optimizer state + two int32 scalars (step, nonfinite)
        return plan.bytes_per_device("params") + plan.bytes_per_device("opt_state") + 8

    state_one = one.argument_size_in_bytes - batch_bytes(8)
    state_split = split.argument_size_in_bytes - batch_bytes(8 // stages)
    assert state_one == planned(plan_one) and state_split == planned(plan_split)
    assert state_one / state_split == pytest.approx(stages, rel=1e-3)


def test_remat_policies_trade_memory_for_recompute():
    """Peak temporary memory: none > save_dots > full, by the factors measured in the docstring."""
    temp = {remat: _compiled(1, "mesh.fsdp=1", "train.batch_size=8", f"model.remat={remat}")[0]
            .temp_size_in_bytes
            for remat in ("none", "save_dots", "full")}
    assert temp["none"] > 2.5 * temp["save_dots"]  # measured 2.6x
    assert temp["save_dots"] > 1.1 * temp["full"]  # measured 1.16x


class _Memory:
    def __init__(self, kind: str):
        self.kind = kind


class _DeviceWithoutPinnedHost:
    platform = "fake"

    def addressable_memories(self):
        return [_Memory("device")]


def test_offloading_needs_pinned_host_memory():
    cfg = config.load(["configs/tiny.yaml"], ["model.remat=offload_dots"]).model
    check_remat(cfg, jax.devices()[0])  # the CPU backend has a pinned_host memory space
    with pytest.raises(config.ConfigError, match="model.remat=offload_dots needs pinned host"):
        check_remat(cfg, _DeviceWithoutPinnedHost())


def test_sequence_parallelism_splits_the_saved_activations(monkeypatch):
    """With remat=full each layer keeps its input x[B, T, D]; under tensor=2 with sequence
    parallelism (act_seq -> tensor) that input is split over the sequence, so each extra layer
    adds half the temporary memory it adds without (measured: 6.6 MB vs 13.0 MB per layer)."""

    def per_layer() -> float:
        common = ("mesh.tensor=2", "mesh.fsdp=1", "train.batch_size=8", "model.remat=full",
                  "model.collective_matmul=false")  # XLA's sequence parallelism, as written
        four = _compiled(2, *common, "model.num_layers=4")[0].temp_size_in_bytes
        eight = _compiled(2, *common, "model.num_layers=8")[0].temp_size_in_bytes
        return (eight - four) / 4

    split = per_layer()
    monkeypatch.setitem(mesh_lib._RULES, "act_seq", None)  # no sequence parallelism
    whole = per_layer()
    assert split < 0.6 * whole


def test_a_state_larger_than_this_machine_is_one_line_before_anything_is_allocated(
        tmp_path, monkeypatch):
    """On CPU devices the state shares the host's memory: more than is available is refused
    with the numbers (not left to the out-of-memory killer), and run.dir is not created."""
    from jaxtron.train import loop as train_lib

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 2**20)
    monkeypatch.setattr(memory, "process_bytes", lambda: 0)
    cfg = config.load([], ["train.steps=1", f"run.dir={tmp_path / 'run'}"])
    with pytest.raises(config.ConfigError, match=r"needs about [\d.]+ GiB of this machine's "
                                                 r"memory on 8 CPU devices and 0.0 GiB is"):
        train_lib.train(cfg)
    assert not (tmp_path / "run").exists()


def test_a_step_larger_than_this_machine_is_refused_as_the_dry_run_says(tmp_path, monkeypatch,
                                                                         capsys):
    """The run agrees with the dry run's DOES NOT FIT on CPU devices: refused in one line before
    anything is written. Before, only the state alone was checked (here a few MiB), so the run
    compiled and the out-of-memory killer ended it without a word (exit 137, a run.dir left)."""
    import launch
    from jaxtron.train import loop as train_lib

    monkeypatch.setattr(memory, "available_host_bytes", lambda: 3 * 2**30)
    monkeypatch.setattr(memory, "process_bytes", lambda: 2**29)
    big = ["train.batch_size=64", "train.seq_len=512", f"run.dir={tmp_path / 'run'}"]
    assert launch.main(["--dry-run", *big]) == 0
    assert "\nverdict: DOES NOT FIT: " in capsys.readouterr().out
    with pytest.raises(config.ConfigError, match=r"^this step needs about [\d.]+ GiB of this "
                       r"machine's memory on 8 CPU devices and 3.5 GiB is available \(jaxtron train \.\.\. "
                       r"--dry-run "
                       r"shows the terms\); lower train.batch_size"):
        train_lib.train(config.load([], ["train.steps=1", *big]))
    assert not (tmp_path / "run").exists()


def test_available_host_memory_is_read_on_linux():
    assert 2**20 < memory.available_host_bytes() < 2**50


def test_sinks_are_estimated_in_the_xla_kernel_they_run_in():
    """gpt-oss's sinks keep attention in XLA on GPUs (no cuDNN kernel takes them): the estimate
    of model.attention=auto is XLA's, its float32 scores counted, not cuDNN's (the 20B on 8
    H100s: 55.6 GiB estimated against 56.9 compiled; counted as cuDNN, 42.5)."""
    cfg = config.load(["gpt_oss_20b"], ["model.num_layers=2", "model.moe.num_experts=8"])
    tx = make_optimizer(cfg)
    plan = make_plan(cfg, tx, 8)
    auto = sum(memory.estimate(cfg, plan).values())
    xla = config.load(["gpt_oss_20b"], ["model.num_layers=2", "model.moe.num_experts=8",
                                         "model.attention=xla"])
    assert auto == sum(memory.estimate(xla, plan).values())
    unsunk = config.load(["gpt_oss_20b"], ["model.num_layers=2", "model.moe.num_experts=8",
                                            "model.family=mixtral", "model.qkv_bias=false",
                                            "model.attn_sinks=false"])
    assert auto > sum(memory.estimate(unsunk, plan).values()) + 2**30  # the scores: GiBs
