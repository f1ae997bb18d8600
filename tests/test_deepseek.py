"""DeepSeek-V3's training (jaxtron/model/deepseek.py, moe.py): group-limited sigmoid routing, the
auxiliary-loss-free balancing bias as train state (moved by the step's load, equal on every
mesh, unchanged by a skipped step), configs/tiny_deepseek.yaml on 8 devices against one and over
microbatches. The Hugging Face parity is tests/test_hf_deepseek.py; the bias across a SIGKILL is
tests/test_preemption.py.

Measured (float32, jax 0.10.2 CPU): see the asserted tolerances in each test.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import QUIET, ROOT

from jaxtron import config, data, parallel
from jaxtron.checkpoint import weights
from jaxtron.config import ConfigError, MLAConfig, ModelConfig, MoEConfig
from jaxtron.hf import mapping as hf
from jaxtron.model import check, deepseek, moe
from jaxtron.step import empty_histories, global_batch, loss_and_grads, loss_sums
from jaxtron.step.optim import make_optimizer
from jaxtron.step.state import init_state, make_plan
from jaxtron.step.train_step import compile_step
from jaxtron.train.loop import train

DEEPSEEK = ROOT / "configs" / "tiny_deepseek.yaml"
# 5 steps of 8 x 64 tokens, no warmup; a bias speed large enough to change routing in 5 steps;
# one multi-token-prediction module (its MoE layer balanced too)
SHORT = ("train.steps=5", "train.log_every=1", "train.batch_size=8", "train.seq_len=64",
         "optim.warmup_steps=0", "train.eval_every=0", "checkpoint.every=0",
         "model.moe.bias_update_speed=0.01", "model.mtp_depth=1")
BIAS = ("layers", "mlp", "router_bias")


@pytest.fixture
def devices() -> list:
    return jax.devices()


def _layer(**moe_overrides) -> tuple[ModelConfig, deepseek.SharedExpertMoE]:
    cfg = ModelConfig(
        family="deepseek_v3", d_model=24, num_heads=2, num_kv_heads=2, mlp_dim=40,
        dtype="float32", mla=MLAConfig(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
                                       v_head_dim=4),
        moe=MoEConfig(num_experts=12, experts_per_token=3, mlp_dim=8, scoring="sigmoid",
                      groups=4, topk_groups=2, shared_experts=2, routed_scale=1.5,
                      **moe_overrides))
    return cfg, deepseek.SharedExpertMoE(cfg, nnx.Rngs(3))


def test_experts_come_from_the_best_groups_and_the_bias_moves_only_the_choice():
    """Each token's 3 experts lie in at most topk_groups=2 of the 4 groups, those whose two best
    biased scores sum highest; the weights are the chosen experts' unbiased sigmoid scores,
    normalised and times routed_scale; a bias on one expert makes every token pick it and leaves
    the other experts' weights their scores."""
    cfg, layer = _layer()
    x = jax.random.normal(jax.random.key(0), (2, 16, cfg.d_model))
    logits = x @ layer.router[...]
    scores = np.asarray(jax.nn.sigmoid(logits))
    probs, weight, expert = (np.asarray(a) for a in layer._route(logits))
    groups = expert // 3
    assert max(len(set(row)) for row in groups.reshape(-1, 3)) <= 2
    rank = np.sort(scores.reshape(2, 16, 4, 3), axis=-1)[..., -2:].sum(-1)
    best = np.argsort(-rank, axis=-1)[..., :2]
    assert all(set(g) <= set(b) for g, b in zip(groups.reshape(-1, 3), best.reshape(-1, 2)))
    chosen = np.take_along_axis(scores, expert, axis=-1)
    np.testing.assert_allclose(weight, 1.5 * chosen / chosen.sum(-1, keepdims=True), rtol=1e-6)
    np.testing.assert_allclose(probs, scores / scores.sum(-1, keepdims=True), rtol=1e-6)

    layer.router_bias[...] = jnp.zeros(12).at[5].set(10.0)
    _, weight_b, expert_b = (np.asarray(a) for a in layer._route(logits))
    assert np.all(np.any(expert_b == 5, axis=-1))  # every token now picks expert 5
    chosen_b = np.take_along_axis(scores, expert_b, axis=-1)  # ... weighted by its score
    np.testing.assert_allclose(weight_b, 1.5 * chosen_b / chosen_b.sum(-1, keepdims=True),
                               rtol=1e-6)


def test_the_bias_moves_by_the_sign_of_each_experts_load_error():
    picked = jnp.array([[6.0, 2.0, 2.0, 2.0], [3.0, 3.0, 3.0, 3.0]])  # means 3 and 3
    params = {"layers": {"mlp": {"router_bias": jnp.full((2, 4), 0.5),
                                 "router": jnp.ones((2, 3, 4))}}}
    out = moe.rebalanced(params, picked, 0.25)
    np.testing.assert_array_equal(out["layers"]["mlp"]["router_bias"],
                                  [[0.25, 0.75, 0.75, 0.75], [0.5, 0.5, 0.5, 0.5]])
    np.testing.assert_array_equal(out["layers"]["mlp"]["router"], params["layers"]["mlp"]["router"])


def _run(tmp_path, devices, *overrides) -> tuple[dict, np.ndarray]:
    """(the logged curves, the final balancing bias [L, E] as checkpointed)."""
    cfg = config.load([DEEPSEEK], [*QUIET, *SHORT, f"run.dir={tmp_path}", *overrides])
    history = train(cfg, devices=devices)
    keys = ("loss", "grad_norm", "moe_aux_loss", "moe_load", "mtp_loss", "moe_load/3",
            "moe_load/4")  # 4: the MTP module's MoE layer
    _, _, get = weights.reader(tmp_path)
    biases = np.concatenate([get(BIAS, None), get(("mtp", "block", "mlp", "router_bias"), None)])
    return {key: np.array([row[key] for row in history]) for key in keys}, biases


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("one"), jax.devices()[:1])


@pytest.mark.parametrize("overrides", [
    ("mesh.expert=2", "mesh.tensor=2", "mesh.fsdp=2"),
    ("train.microbatches=4",),
], ids=["expert,tensor,fsdp", "microbatches"])
def test_the_family_trains_like_one_device(devices, tmp_path, one_device, overrides):
    """configs/tiny_deepseek.yaml, float32, 5 AdamW steps with bias balancing and one MTP
    module on: loss, grad norm, balance loss, loads and MTP loss on 8 devices (experts, tensor
    and fsdp split), and on one device in 4 microbatches, equal one device's in one; the
    balancing biases (the MTP module's too) equal exactly (each step moves them by +-speed on
    integer loads) and have moved."""
    curves, bias = _run(tmp_path, devices if "mesh.expert=2" in overrides else devices[:1],
                        *overrides)
    want, want_bias = one_device
    for key, values in want.items():
        np.testing.assert_allclose(curves[key], values, rtol=1e-4, err_msg=key)
    np.testing.assert_array_equal(bias, want_bias)
    assert np.count_nonzero(want_bias) > want_bias.size // 2


def test_a_skipped_step_leaves_the_bias_where_it_was(devices):
    """A non-finite loss skips the update: params, the balancing bias among them, unchanged;
    the same step on finite weights moves the bias."""
    cfg = config.load([DEEPSEEK], [*QUIET, *SHORT])
    tx = make_optimizer(cfg)
    plan = make_plan(cfg, tx, 1)
    mesh = parallel.make_mesh(cfg.mesh, devices[:1])
    with jax.set_mesh(mesh):
        step = compile_step(cfg, plan, tx, mesh)
        batch = global_batch(next(data.make_batches(cfg.data, cfg.train,
                                                    cfg.model.vocab_size)), mesh)
        state = init_state(cfg, plan, tx, mesh)
        bias = np.asarray(state["params"]["layers"]["mlp"]["router_bias"])
        broken = jax.tree.map(jnp.copy, state)  # the step donates its state
        broken["params"]["final_norm"]["scale"] = broken["params"]["final_norm"]["scale"] * jnp.nan
        skipped, metrics = step(broken, batch)
        assert int(metrics["nonfinite"]) == 1
        np.testing.assert_array_equal(skipped["params"]["layers"]["mlp"]["router_bias"], bias)
        moved, metrics = step(state, batch)
        assert int(metrics["nonfinite"]) == 0
        assert np.count_nonzero(np.asarray(moved["params"]["layers"]["mlp"]["router_bias"])
                                - bias) > bias.size // 2


def test_other_families_refuse_deepseek_options():
    with pytest.raises(ConfigError, match="model.moe.scoring=sigmoid"):
        check(ModelConfig(moe=MoEConfig(num_experts=4, scoring="sigmoid")))
    cfg, _ = _layer()
    with pytest.raises(ConfigError, match="topk_groups"):
        check(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, topk_groups=5)))


def _initial(*overrides) -> tuple[float, dict, dict]:
    """Loss, gradients and FP8 amaxes observed at the initial weights, one device, two layers
    (one dense, one MoE) of configs/tiny_deepseek.yaml."""
    cfg = config.load([DEEPSEEK], [*QUIET, "train.batch_size=4", "train.seq_len=64",
                                    "model.num_layers=2", "mesh.fsdp=1", *overrides])
    tx = make_optimizer(cfg)
    plan = make_plan(cfg, tx, 1)
    mesh = parallel.make_mesh(cfg.mesh, jax.devices()[:1])
    with jax.set_mesh(mesh):
        batch = global_batch(next(data.make_batches(cfg.data, cfg.train, cfg.model.vocab_size)),
                             mesh)
        loss, grads, extras = jax.jit(lambda p, b: loss_and_grads(
            p, plan.graphdef, b, plan.accumulation, plan.pipe,
            histories=empty_histories(plan.histories)))(init_state(cfg, plan, tx, mesh)["params"],
                                                        batch)
    return float(loss), jax.device_get(grads), jax.device_get(extras["fp8"])


@pytest.mark.parametrize("q_rank", [96, pytest.param(0, marks=pytest.mark.slow)],  # CI's time
                         ids=["q_lora", "no_q_lora"])
def test_latent_attention_and_shared_experts_run_in_fp8(q_rank):
    """model.fp8=tensorwise: latent attention's projections (wq_a, wkv_a, wq_b, wkv_b, wo; wq
    without q compression) and the shared experts' have amax histories, each of whose rows a
    step observes (an input, weight or gradient left out, or read at another's row, leaves a
    row at zero); their gradients move by FP8's rounding (measured 10-18% of their norm at the
    initial weights), the loss by less than 0.1% (measured 0.06%)."""
    lora = f"model.mla.q_lora_rank={q_rank}"
    loss, grads, amax = _initial(lora, "model.fp8=tensorwise")
    want_loss, want, none = _initial(lora, "model.fp8=none")
    assert none is None  # no histories without FP8
    rows = 4 if q_rank else 3  # inputs; weights one more
    for stack in ("dense_layers", "layers"):
        attn = amax[stack]["attn"]
        assert attn["fp8_x"].shape[1:] == (rows, 1) and attn["fp8_w"].shape[1:] == (rows + 1, 1)
        shared = amax[stack]["mlp"] if stack == "dense_layers" else amax[stack]["mlp"]["shared"]
        for history in (*attn.values(), *shared.values()):
            assert np.all(history[..., 0] > 0), (stack, history)
        names = ("wq_a", "wq_b", "wkv_a", "wkv_b", "wo") if q_rank else ("wq", "wkv_a",
                                                                         "wkv_b", "wo")
        for name in names:
            g, w = grads[stack]["attn"][name], want[stack]["attn"][name]
            assert 0.02 < np.linalg.norm(g - w) / np.linalg.norm(w) < 0.3, name
    assert abs(loss - want_loss) / want_loss < 1e-3


def test_mtp_reads_the_next_tokens_of_the_same_document():
    """Depth k's inputs are tokens t+1+k and its targets t+2+k, real only inside the row and
    the document of position t (packed rows, padding)."""
    tokens = np.arange(1, 9)[None]  # targets: the next token along the row
    batch = {"tokens": jnp.asarray(tokens), "targets": jnp.asarray(tokens + 1),
             "segment_ids": jnp.array([[1, 1, 1, 2, 2, 2, 2, 0]]),
             "positions": jnp.array([[0, 1, 2, 0, 1, 2, 3, 0]])}
    out = deepseek.mtp_batch(batch, 2)
    np.testing.assert_array_equal(out["mtp_inputs/0"], [[2, 3, 4, 5, 6, 7, 8, 9]])
    np.testing.assert_array_equal(out["mtp_targets/0"], [[3, 4, 5, 6, 7, 8, 9, 0]])
    np.testing.assert_array_equal(out["mtp_valid/0"], [[1, 1, 0, 1, 1, 1, 0, 0]])
    np.testing.assert_array_equal(out["mtp_inputs/1"], [[3, 4, 5, 6, 7, 8, 9, 0]])
    np.testing.assert_array_equal(out["mtp_targets/1"], [[4, 5, 6, 7, 8, 9, 0, 0]])
    np.testing.assert_array_equal(out["mtp_valid/1"], [[1, 0, 0, 1, 1, 0, 0, 0]])


def _mtp_model(depth: int, coef: float = 0.3):
    cfg = config.load([DEEPSEEK], ["model.num_layers=3", "model.d_model=64", "model.mlp_dim=96",
                                   "model.moe.mlp_dim=32", "model.mla.kv_lora_rank=16",
                                   "model.mla.q_lora_rank=16", f"model.mtp_depth={depth}",
                                   f"model.mtp_coef={coef}"]).model
    graphdef, params = nnx.split(deepseek.Transformer(cfg, nnx.Rngs(0)), nnx.Param)
    return cfg, graphdef, nnx.to_pure_dict(params)


def _packed_batch():
    tokens = jax.random.randint(jax.random.key(1), (2, 33), 0, 8192)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": jnp.array([[1] * 20 + [2] * 10 + [0] * 2, [1] * 32]),
            "positions": jnp.array([list(range(20)) + list(range(10)) + [0, 0], range(32)])}


def test_mtp_joins_the_objective_by_its_coefficient_and_leaves_inference_alone():
    """Two MTP modules: the objective is the cross-entropy, the router losses and mtp_coef / 2
    x the modules' summed cross-entropy (logged apart: mtp_entropy over mtp_tokens, about
    ln V at random weights); the logits (inference) and the Hugging Face export are those of
    the same weights without the modules."""
    batch = _packed_batch()
    sums = {}
    for coef in (0.0, 0.3):
        cfg, graphdef, params = _mtp_model(2, coef)
        total, (count, entropy, stats) = loss_sums(params, graphdef, batch, with_stats=True)
        sums[coef] = float(total)
    assert float(stats["mtp_tokens"]) == 2 * (19 + 9 + 31) - (1 + 1 + 1)  # 2 depths, 3 docs
    assert abs(float(stats["mtp_entropy"]) / float(stats["mtp_tokens"]) - np.log(8192)) < 0.5
    np.testing.assert_allclose(sums[0.3] - sums[0.0], 0.15 * float(stats["mtp_entropy"]),
                               rtol=1e-4)
    bare_cfg, bare_graphdef, _ = _mtp_model(0)
    bare = {k: v for k, v in params.items() if k != "mtp"}
    args = (batch["tokens"], batch["positions"], batch["segment_ids"])
    np.testing.assert_array_equal(nnx.merge(graphdef, params)(*args),
                                  nnx.merge(bare_graphdef, bare)(*args))
    exported, bare_exported = hf.params_to_hf(params, cfg), hf.params_to_hf(bare, bare_cfg)
    assert sorted(exported) == sorted(bare_exported)
