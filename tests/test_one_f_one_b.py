"""The 1F1B schedules (parallel/one_f_one_b.py): the tick arithmetic, and every layout giving the
one-device losses and gradients.

The model and batch are test_pipeline's (helpers.pipeline_run: 8 layers, 3 AdamW steps on a
fixed batch), with its tolerances: losses within 2e-6 relative, each gradient array within
1e-5 of the reference's norm at the start, and after 3 steps 5e-4 (test_pipeline's 2.5e-4 held
on jax 0.10.2; on jax 0.12 the embedding's was 3.6e-4 in the batch-32 case, and 2.7e-4 under
the circular schedule in that layout: Adam's first steps amplify float32 rounding, while the
start gradients agreed to 6.6e-7). The step and the gradient run as two programs (`apart`).
"""

from __future__ import annotations

import numpy as np
import pytest
from helpers import (
    assert_close_grads,
    pipeline_batch,
    pipeline_cfg,
    pipeline_reference,
    pipeline_run,
)

from jaxtron import config
from jaxtron.parallel import one_f_one_b, pipeline
from jaxtron.plan import memory


def _simulate(s: int, r: int, m: int) -> dict:
    """Play the ticks: per stage, each item's forward and backward tick, checked against the
    data each needs; returns the most items alive on a stage at once, and the busy ticks."""
    ticks = one_f_one_b.Ticks(s, r, m)
    fwd, bwd, loss = {}, {}, {}
    for t in range(ticks.ticks):
        for stage in range(s):
            if 0 <= t - stage < ticks.items:
                micro, repeat = ticks.forward_item(t - stage)
                fwd[stage, micro, repeat] = t
                if stage == s - 1 and repeat == r - 1:
                    loss[micro] = t
            b = t - ticks.delay + stage
            if 0 <= b < ticks.items:
                micro, repeat, item = ticks.backward_item(b)
                assert ticks.forward_item(item) == (micro, repeat)
                bwd[stage, micro, repeat] = t
    assert len(fwd) == len(bwd) == s * m * r and len(loss) == m
    for (stage, micro, repeat), t in fwd.items():
        prev = (stage - 1, micro, repeat) if stage else (s - 1, micro, repeat - 1)
        if stage or repeat:  # its input was sent in an earlier tick
            assert fwd[prev] < t
        nxt = (stage + 1, micro, repeat) if stage < s - 1 else (0, micro, repeat + 1)
        if stage < s - 1 or repeat < r - 1:  # its cotangent came back in an earlier tick
            assert bwd[nxt] < bwd[stage, micro, repeat]
        else:  # the loss's, in the same tick
            assert bwd[stage, micro, repeat] == loss[micro] == t
    alive = max(sum(fwd[st, mi, re] <= t <= bwd[st, mi, re] for (st, mi, re) in fwd if st == st0)
                for st0 in range(s) for t in range(ticks.ticks))
    # a slot holds one item from its forward to its backward: no two alive share one
    table = ticks.slot_table()
    for stage in range(s):
        lives = [(fwd[stage, mi, re], bwd[stage, mi, re],
                  table[stage, next(i for i in range(ticks.items)
                                    if ticks.forward_item(i) == (mi, re))])
                 for (st, mi, re) in fwd if st == stage]
        for a, b, slot in lives:
            assert not any(slot == slot2 and a < a2 <= b for a2, _, slot2 in lives)
    return {"alive": alive, "ticks": ticks.ticks, "slots": ticks.slots}


@pytest.mark.parametrize("s,r,m", [(2, 1, 4), (4, 1, 8), (4, 1, 3), (2, 2, 4), (4, 2, 8),
                                   (3, 3, 6)])
def test_ticks_respect_every_dependency_and_keep_slots_apart(s, r, m):
    got = _simulate(s, r, m)
    assert got["alive"] == got["slots"] == min((r + 1) * s - 1, m * r)
    assert got["ticks"] == m * r + (r + 1) * s - 2


def test_items_alive_do_not_grow_with_microbatches():
    assert {_simulate(4, 1, m)["alive"] for m in (8, 16, 32)} == {7}


CASES = [  # (overrides, devices, remat); stage4 x fsdp2 and stage2 x tensor2 x data2 left out
    (("mesh.stage=2", "mesh.data=2", "mesh.fsdp=2", "pipeline.schedule=1f1b"), 8, "none"),
    (("mesh.stage=4", "mesh.tensor=2", "mesh.fsdp=1", "pipeline.schedule=1f1b"), 8, "full"),
    # tensor and fsdp together: the loss's target logit as a gather aborted XLA's partitioner
    (("mesh.stage=2", "mesh.tensor=2", "mesh.fsdp=2", "pipeline.schedule=1f1b"), 8, "save_dots"),
    (("mesh.stage=2", "mesh.context=2", "mesh.fsdp=2", "pipeline.schedule=interleaved_1f1b",
      "pipeline.repeats=2"), 8, "full"),
    # the half ticks' input pieces ride the swaps with positions split over context
    (("mesh.stage=2", "mesh.context=2", "mesh.fsdp=2", "pipeline.schedule=1f1b"), 8,
     "save_dots"),
    (("mesh.stage=2", "mesh.data=2", "mesh.fsdp=2", "pipeline.grad_sum=whole",
      "pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2", "train.microbatches=8",
      "train.batch_size=32"), 8, "none"),
    (("mesh.stage=4", "mesh.fsdp=1", "pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2",
      "pipeline.passes=2", "train.microbatches=8", "train.batch_size=32"), 4, "none"),
    # zb_h1 beside tensor: without collective matmuls, whose rings keep the weight gradients
    (("mesh.stage=4", "mesh.tensor=2", "mesh.fsdp=1", "pipeline.schedule=zb_h1",
      "model.collective_matmul=false"), 8, "full"),
    (("mesh.stage=2", "mesh.data=2", "mesh.fsdp=2", "pipeline.schedule=zb_h1",
      "train.microbatches=8", "train.batch_size=32"), 8, "save_dots"),
]


@pytest.mark.parametrize("overrides,devices,remat", CASES,
                         ids=[",".join(o).replace("mesh.", "").replace("pipeline.", "")
                              for o, _, _ in CASES])
def test_1f1b_matches_one_device(overrides, devices, remat):
    losses, first, last = pipeline_run(pipeline_cfg(*overrides, f"model.remat={remat}"),
                                       devices, apart=True)
    batch = [o for o in overrides if o.startswith("train.batch_size=")]
    ref_losses, ref_first, ref_last = pipeline_reference(remat, *batch)
    assert losses[-1] < losses[0] - 0.1
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-6)
    assert_close_grads(first, ref_first, 1e-5)
    assert_close_grads(last, ref_last, 5e-4)


@pytest.mark.parametrize("overrides,message", [
    (("pipeline.schedule=interleaved_1f1b", "pipeline.repeats=2", "train.microbatches=6"),
     "runs microbatches in groups of mesh.stage=4"),
    (("pipeline.schedule=1f1b", "pipeline.repeats=2"),
     "pipeline.repeats=2 needs pipeline.schedule=circular or interleaved_1f1b"),
])
def test_1f1b_layouts_it_cannot_run_are_refused(overrides, message):
    cfg = pipeline_cfg("mesh.stage=4", "mesh.fsdp=1", *overrides)
    with pytest.raises(config.ConfigError, match=message):
        pipeline.check(cfg, 4)


def test_the_estimate_keeps_1f1b_activations_flat_in_microbatches():
    """The dry run's activations: gpipe's grow with M; 1f1b's ring of S items and the whole
    ticks' 2*S-1 (interleaved_1f1b at R=1) do not."""
    def layer_runs(schedule, m):
        cfg = pipeline_cfg("mesh.stage=4", "mesh.fsdp=1", f"pipeline.schedule={schedule}",
                   f"train.microbatches={m}", f"train.batch_size={4 * m}")
        return memory._layer_runs(cfg, {"stage": 4})
    assert [layer_runs("1f1b", m) for m in (2, 4, 16, 64)] == [2 * 2, 4 * 2, 4 * 2, 4 * 2]
    assert [layer_runs("interleaved_1f1b", m) for m in (4, 16, 64)] == [2 * 4, 7 * 2, 7 * 2]
    assert [layer_runs("gpipe", m) for m in (4, 16, 64)] == [7 * 2, 19 * 2, 67 * 2]


def test_the_evaluation_runs_the_forwards_alone_and_matches_one_device():
    """compile_eval's loss through 1F1B is the loss's value outside autodiff: the ticks run
    forwards and the loss only (M*R + S - 1 of them, not M*R + (R+1)*S - 2), as one device
    computes it."""
    import jax
    from helpers import pipeline_batch

    from jaxtron import parallel
    from jaxtron.program import hlo
    from jaxtron.step import BATCH_KEYS, compile_eval
    from jaxtron.step.optim import make_optimizer
    from jaxtron.step.state import init_state, make_plan

    def evaluate(cfg, devices):
        tx = make_optimizer(cfg)
        plan = make_plan(cfg, tx, devices)
        mesh = parallel.make_mesh(cfg.mesh, jax.devices()[:devices])
        sharding = jax.sharding.NamedSharding(mesh, parallel.batch_spec())
        with jax.set_mesh(mesh):
            state = init_state(cfg, plan, tx, mesh)
            batch = {k: jax.device_put(v, sharding) for k, v in pipeline_batch(cfg).items()
                     if k in BATCH_KEYS}
            fn = compile_eval(plan, mesh)
            text = fn.lower(state["params"], batch).compile().as_text()
            total, count = jax.device_get(fn(state["params"], batch))
        return float(total), int(count), text

    total, count, text = evaluate(pipeline_cfg("mesh.stage=4", "mesh.fsdp=2",
                                               "pipeline.schedule=interleaved_1f1b",
                                               "pipeline.repeats=2"), 8)
    ref_total, ref_count, _ = evaluate(pipeline_cfg("mesh.fsdp=1"), 1)
    assert count == ref_count and total == pytest.approx(ref_total, rel=2e-6)
    module = hlo.parse(text)
    trips = {hlo.trip_count(module, inst) for insts in module.computations.values()
             for inst in insts if inst.opcode == "while"}
    ticks = one_f_one_b.Ticks(4, 2, 4)
    assert ticks.items + 4 - 1 in trips and ticks.ticks not in trips, trips


def test_1f1b_gradients_follow_the_loss_cotangent():
    """The 1F1B loss is a custom VJP whose ticks compute the gradients of the summed loss; its
    backward scales them by the cotangent it is given. The train step differentiates the sum
    itself (cotangent 1): a loss scaled by c has c times every gradient, the embedding's (which
    comes through the pipeline's input) included."""
    import jax

    from jaxtron import parallel
    from jaxtron.step import BATCH_KEYS
    from jaxtron.step.optim import make_optimizer
    from jaxtron.step.state import init_state, make_plan
    from jaxtron.step.train_step import loss_sums

    cfg = pipeline_cfg("mesh.stage=2", "mesh.fsdp=1", "pipeline.schedule=1f1b",
                       "model.remat=none")
    tx = make_optimizer(cfg)
    plan = make_plan(cfg, tx, 2)
    mesh = parallel.make_mesh(cfg.mesh, jax.devices()[:2])
    sharding = jax.sharding.NamedSharding(mesh, parallel.batch_spec())
    scaled = jax.jit(jax.grad(lambda p, batch, c: c * loss_sums(p, plan.graphdef, batch,
                                                                pipe=plan.pipe)[0]))
    with jax.set_mesh(mesh):
        params = init_state(cfg, plan, tx, mesh)["params"]
        local = pipeline_batch(cfg)
        batch = {k: jax.device_put(local[k], sharding) for k in BATCH_KEYS}
        once, c_times = jax.device_get((scaled(params, batch, 1.0), scaled(params, batch, 0.375)))
    # each array against its own norm (an all-zero one would fail: its error is nan)
    assert_close_grads(c_times, jax.tree.map(lambda g: 0.375 * g, once), 1e-6)


@pytest.mark.parametrize("remat", ["full", "save_dots", "none"])
def test_zb_h1_runs_the_weight_gradients_apart_and_no_matmul_twice(remat):
    """zb_h1's W (one_f_one_b.SCOPES[3]) holds every layer weight's gradient matmul, 2 * rows *
    fan-in * fan-out each (x^T g), and the step runs the same matmuls as the whole ticks'
    1F1B (interleaved_1f1b at R=1) and 1f1b's half ticks, each weighed by its own scopes'
    shares: none is recomputed to cut the backward in two, none lost. Under save_dots W also recomputes the
    attention's output (probabilities times values, a batched matmul the policy does not keep):
    only the output projection's weight gradient reads it."""
    import jax

    from jaxtron import parallel
    from jaxtron.program import flops, hlo
    from jaxtron.step import compile_step
    from jaxtron.step.optim import make_optimizer
    from jaxtron.step.state import init_state, make_plan

    def matmuls(schedule):
        cfg = pipeline_cfg("mesh.stage=2", "mesh.fsdp=1", f"pipeline.schedule={schedule}",
                           f"model.remat={remat}")
        tx = make_optimizer(cfg)
        plan = make_plan(cfg, tx, 2)
        mesh = parallel.make_mesh(cfg.mesh, jax.devices()[:2])
        sharding = jax.sharding.NamedSharding(mesh, parallel.batch_spec())
        with jax.set_mesh(mesh):
            state = init_state(cfg, plan, tx, mesh)
            batch = {k: jax.device_put(v, sharding) for k, v in pipeline_batch(cfg).items()}
            text = compile_step(cfg, plan, tx, mesh).lower(state, batch).compile().as_text()
        module = hlo.parse(text)
        shares = one_f_one_b.Ticks.of(plan.pipe).shares()
        total = flops.compiled(module, scope_shares=shares)["matmul"]
        rest = flops.compiled(module, scope_shares={**shares, "1f1b_weights": 0.0})["matmul"]
        layers = state["params"]["layers"]
        fans = sum(a.size for a in jax.tree.leaves(layers) if a.ndim >= 3)  # [L, in, out]
        return total, total - rest, fans, cfg

    total, weights, fans, cfg = matmuls("zb_h1")
    rows = cfg.train.batch_size * cfg.train.seq_len
    layers = cfg.model.num_layers // 2  # stage 2: each device's half of the layers
    recomputed = 2 * rows * cfg.train.seq_len * cfg.model.d_model * layers
    assert weights == 2 * rows * fans // 2 + (recomputed if remat == "save_dots" else 0)
    assert total == matmuls("interleaved_1f1b")[0] == matmuls("1f1b")[0]


def _play_zb_h1(s: int, m: int, f: float = 1.0, b: float = 1.0, w: float = 1.0) -> dict:
    """Play zb_h1's ticks as `_ticks` runs them, each tick as long as its slowest stage: a
    stage's W waits where its backward comes before stage 0's first (t < D) in queue slot
    b_item, and runs in its tick t >= ticks - s, for item t - (ticks - s)."""
    ticks = one_f_one_b.Ticks(s, 1, m, zero_bubble=True)
    queue, done, total = {}, {}, 0.0
    for t in range(ticks.ticks):
        longest = 0.0
        for stage in range(s):
            work = f if 0 <= t - stage < ticks.items else 0.0
            item = t - ticks.delay + stage
            if 0 <= item < ticks.items:
                work += b
                if t < ticks.delay:
                    assert item < stage and (stage, item) not in queue and item <= s - 2
                    queue[stage, item] = t
                else:
                    done[stage, item] = t
                    work += w
            late = t - (ticks.ticks - stage)
            if 0 <= late < min(stage, ticks.items):
                assert queue.pop((stage, late)) < t
                done[stage, late] = t
                work += w
            longest = max(longest, work)
        total += longest
    assert not queue and len(done) == s * m  # every W once, after its B
    return {"bubble": 1 - m * (f + b + w) / total}


@pytest.mark.parametrize("s,m", [(2, 4), (4, 8), (8, 16), (8, 256), (4, 2)])
def test_zb_h1_bubble_is_the_warm_up_without_its_weight_gradients(s, m):
    """Every W runs once after its B, the queue's S-1 slots suffice, and where M >= S the
    bubble played is Pipeline.bubble's 2(S-1)/(3M+2(S-1)) (F = B = W), below 1F1B's
    (S-1)/(M+S-1). With M < S a stage waits with fewer than S-1 (M) and runs no W past them."""
    zb = pipeline.Pipeline(s, 1, m, schedule="zb_h1").bubble
    played = _play_zb_h1(s, m)["bubble"]
    if m < s:
        return
    assert played == pytest.approx(zb, rel=1e-12)
    assert zb < pipeline.Pipeline(s, 1, m, schedule="1f1b").bubble
