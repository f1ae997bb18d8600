"""Mixture of experts (jaxtron/model/moe.py): the layer against a dense reference, Mixtral, Qwen3-MoE
and Qwen3 against transformers (logits, import and export through tools/convert_hf.py), expert
parallelism against one device, capacity, the router losses in the objective, the refusals.

Measured (float32, jax 0.10 CPU, transformers 5.24): max |logit diff| mixtral 6.6e-6, qwen3_moe
4.6e-6, qwen3_moe normalized 3.8e-6, qwen3 4.0e-6 (asserted 1e-4); configs/tiny_moe.yaml on 8
devices against one, 4 steps: losses within 6.7e-7, grad norms within 1.7e-5, aux losses within
3.3e-6 (relative; asserted 1e-4); gradients at the initial weights within 7.1e-7 of their norm
(asserted 1e-5).
"""

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from helpers import QUIET, ROOT, assert_refused
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

import launch
from jaxtron import config, data, hf, parallel
from jaxtron.commands import convert_hf
from jaxtron.config import ModelConfig, MoEConfig
from jaxtron.model import Transformer, moe
from jaxtron.ops import experts
from jaxtron.step import empty_histories, global_batch, loss_and_grads, loss_sums
from jaxtron.step.optim import make_optimizer
from jaxtron.step.state import init_state, make_plan
from jaxtron.train.loop import train

TOL = 1e-4  # |logit difference| against transformers; float32 gives ~5e-6
TINY = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5,
            attn_implementation="eager", tie_word_embeddings=False)
FAMILIES = {
    "mixtral": (MixtralConfig, MixtralForCausalLM,
                dict(num_local_experts=4, num_experts_per_tok=2)),
    # Qwen3-MoE's default: the top-k probabilities of the softmax over all experts, as they are
    "qwen3_moe": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                  dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=24,
                       head_dim=16, norm_topk_prob=False)),
    "qwen3_moe_normalized": (Qwen3MoeConfig, Qwen3MoeForCausalLM,
                             dict(num_experts=6, num_experts_per_tok=3, moe_intermediate_size=24,
                                  head_dim=16, norm_topk_prob=True)),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM, dict(head_dim=16)),
}
MOE = ROOT / "configs" / "tiny_moe.yaml"
# Small enough for a CI machine: 4 steps of 8 x 64 tokens, no warmup (every step a real update).
SHORT = ("train.steps=4", "train.log_every=1", "train.batch_size=8", "train.seq_len=64",
         "optim.warmup_steps=0", "train.eval_every=0", "checkpoint.every=0")


@pytest.fixture
def devices() -> list:
    return jax.devices()


@functools.cache
def _saved(name: str, root) -> tuple:
    """(the HF model with random weights, its directory as save_pretrained wrote it)."""
    config_cls, model_cls, overrides = FAMILIES[name]
    torch.manual_seed(0)
    model = model_cls(config_cls(**TINY, **overrides)).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():  # norms too: a dropped one shows
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if pname.endswith("norm.weight")
                    else 0.2 * torch.randn_like(p))
    path = root / name
    model.save_pretrained(path)
    return model, path


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    root = tmp_path_factory.mktemp("hub")
    return lambda name: _saved(name, root)


def _tokens(batch: int = 2, length: int = 24) -> np.ndarray:
    return np.random.default_rng(0).integers(0, TINY["vocab_size"], (batch, length))


@pytest.mark.parametrize("name", list(FAMILIES))
def test_logits_match_transformers(hub, name):
    model, path = hub(name)
    cfg, params = hf.from_pretrained(path)
    assert cfg.qk_norm == name.startswith("qwen3")
    assert cfg.moe.num_experts == FAMILIES[name][2].get("num_local_experts",
                                                    FAMILIES[name][2].get("num_experts", 0))
    tokens = _tokens()
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(tokens)).logits.numpy()
    diff = np.abs(hf.logits(cfg, params, tokens) - ref).max()
    print(f"{name}: max |logit diff| {diff:.2e}")
    assert diff < TOL


def test_renormalizing_qwen3_moe_top_k_matters(hub):
    """norm_topk_prob=false read as true misses transformers by far more than TOL."""
    model, path = hub("qwen3_moe")
    cfg, params = hf.from_pretrained(path)
    assert not cfg.moe.norm_topk_prob
    wrong = hf.logits(dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, norm_topk_prob=True)),
                      params, _tokens())
    with torch.no_grad():
        ref = model(input_ids=torch.from_numpy(_tokens())).logits.numpy()
    assert np.abs(wrong - ref).max() > 100 * TOL


def _convert(*args) -> int:
    try:
        return convert_hf.main([str(a) for a in args])
    except SystemExit as e:
        return e.code


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe", "qwen3"])
def test_import_then_export_gives_identical_tensors(hub, tmp_path, name):
    """tools/convert_hf.py import, then export: the Hub's layout (one tensor per expert per
    projection), every tensor equal, and the family's config.json."""
    _, path = hub(name)
    assert _convert("import", path, tmp_path / "imp") == 0
    assert _convert("export", tmp_path / "imp", tmp_path / "out") == 0
    left, right = hf.read_tensors(path), hf.read_tensors(tmp_path / "out")
    assert sorted(left) == sorted(right)
    for key in left:
        assert left[key].dtype == right[key].dtype, key
        np.testing.assert_array_equal(left[key], right[key], err_msg=key)
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    assert written["model_type"] == name
    assert hf.read_config(tmp_path / "out") == hf.read_config(path)


def _dense_reference(cfg: ModelConfig, layer: moe.MoE, x: np.ndarray) -> np.ndarray:
    """Every expert on every token, the top-k kept: the definition, in float64 numpy."""
    x = x.reshape(-1, cfg.d_model).astype(np.float64)
    logits = x @ np.asarray(layer.router[...], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :cfg.moe.experts_per_token]
    weights = np.take_along_axis(probs, top, -1)
    if cfg.moe.norm_topk_prob:
        weights /= weights.sum(-1, keepdims=True)
    gate, up, down = (np.asarray(w[...], np.float64) for w in (layer.w_gate, layer.w_up,
                                                              layer.w_down))
    out = np.zeros_like(x)
    for t in range(len(x)):
        for e, w in zip(top[t], weights[t]):
            g, u = x[t] @ gate[e], x[t] @ up[e]
            out[t] += w * ((g / (1 + np.exp(-g)) * u) @ down[e].T)
    return out


@pytest.mark.parametrize("normalized", [True, False])
def test_the_layer_is_its_dense_definition(normalized):
    """Sorting, grouped matmuls and bringing the rows back equal every expert on every token
    with the top-k mask; padding tokens (segment 0) get 0 and count in no statistic."""
    cfg = ModelConfig(d_model=32, mlp_dim=48, dtype="float32", init_std=0.2, moe=MoEConfig(
        num_experts=6, experts_per_token=3, norm_topk_prob=normalized))
    layer = moe.MoE(cfg, nnx.Rngs(0))
    x = np.random.default_rng(1).normal(size=(2, 10, 32)).astype(np.float32)
    segments = np.ones((2, 10), np.int32)
    segments[1, 7:] = 0
    y, stats = layer(jnp.asarray(x), jnp.asarray(segments))
    ref = _dense_reference(cfg, layer, x).reshape(2, 10, 32)
    real = segments != 0
    np.testing.assert_allclose(np.asarray(y)[real], ref[real], atol=2e-5)
    assert not np.asarray(y)[~real].any()
    tokens_B = real.sum(1)
    aux = moe.sequence_aux(stats["picked"][None], stats["probs"][None], jnp.asarray(tokens_B))
    want = sum(n * _aux(cfg, layer, x[b:b + 1], real[b:b + 1]) for b, n in enumerate(tokens_B))
    assert abs(float(aux) - want) < 1e-4 * want


def test_the_layers_gradients_are_its_dense_definitions():
    """Gradients through the sort, the grouped kernels and the permutations back (custom
    gathers both ways) equal those of every expert on every token with the top-k mask: inputs,
    router, experts."""
    cfg = ModelConfig(d_model=16, mlp_dim=24, dtype="float32", init_std=0.3,
                      moe=MoEConfig(num_experts=4, experts_per_token=2))
    graphdef, params = nnx.split(moe.MoE(cfg, nnx.Rngs(3)))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 6, 16)), jnp.float32)
    probe = jnp.asarray(np.random.default_rng(4).normal(size=(2, 6, 16)), jnp.float32)

    def ours(params, x):
        return jnp.sum(nnx.merge(graphdef, params)(x)[0] * probe)

    def dense(params, x):
        layer = nnx.merge(graphdef, params)
        probs = jax.nn.softmax(x @ layer.router[...], axis=-1)
        top_p, top_e = jax.lax.top_k(probs, 2)
        weights = jnp.sum(jax.nn.one_hot(top_e, 4) * (top_p / top_p.sum(-1, keepdims=True))[
            ..., None], axis=-2)  # [B, T, E]
        g = jnp.einsum("btd,edf->btef", x, layer.w_gate[...])
        u = jnp.einsum("btd,edf->btef", x, layer.w_up[...])
        y = jnp.einsum("btef,edf->bted", jax.nn.silu(g) * u, layer.w_down[...])
        return jnp.sum(jnp.einsum("bted,bte->btd", y, weights) * probe)

    got, want = (jax.grad(f, argnums=(0, 1))(params, x) for f in (ours, dense))
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def _aux(cfg, layer, x, real) -> float:
    """E * sum_e f_e P_e over the real tokens (transformers' Mixtral, one layer)."""
    x = x[real].astype(np.float64)
    logits = x @ np.asarray(layer.router[...], np.float64)
    probs = np.exp(logits - logits.max(-1, keepdims=True))
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-probs, axis=-1)[:, :cfg.moe.experts_per_token]
    picked = np.bincount(top.reshape(-1), minlength=cfg.moe.num_experts) / len(x)
    return cfg.moe.num_experts * float(np.sum(picked * probs.mean(0)))


def _curves(tmp_path, devices, *overrides) -> dict[str, np.ndarray]:
    cfg = config.load([MOE], [*QUIET, *SHORT, f"run.dir={tmp_path}", *overrides])
    history = train(cfg, devices=devices)
    keys = ("loss", "grad_norm", "moe_aux_loss", "moe_z_loss", "moe_load")
    return {key: np.array([row[key] for row in history]) for key in keys}


@pytest.fixture(scope="module")
def one_device(tmp_path_factory):
    return _curves(tmp_path_factory.mktemp("one"), jax.devices()[:1])


@pytest.mark.parametrize("mesh", [
    ("mesh.expert=4", "mesh.fsdp=2"),
    pytest.param(("mesh.expert=2", "mesh.tensor=2", "mesh.fsdp=2"), marks=pytest.mark.slow),
    pytest.param(("mesh.data=2", "mesh.expert=4", "mesh.fsdp=1"), marks=pytest.mark.slow),
], ids=lambda m: ",".join(a.split(".")[1] for a in m))
def test_expert_parallel_trains_like_one_device(devices, tmp_path, one_device, mesh):
    """configs/tiny_moe.yaml, float32, 4 AdamW steps: loss, grad norm and the router's losses
    and load on 8 devices equal one device's."""
    sharded = _curves(tmp_path, devices, *mesh)
    for key, values in one_device.items():
        np.testing.assert_allclose(sharded[key], values, rtol=1e-4, err_msg=key)
    assert np.all(one_device["moe_load"] >= 1.0)


def _gradients(devices, *overrides) -> dict:
    cfg = config.load([MOE], [*QUIET, *SHORT, *overrides])
    tx = make_optimizer(cfg)
    plan = make_plan(cfg, tx, len(devices))
    mesh = parallel.make_mesh(cfg.mesh, devices)
    fn = jax.jit(lambda params, batch: loss_and_grads(
        params, plan.graphdef, batch, plan.accumulation, plan.pipe,
        histories=empty_histories(plan.histories))[1])
    with jax.set_mesh(mesh):
        batch = global_batch(next(data.make_batches(cfg.data, cfg.train, cfg.model.vocab_size)),
                             mesh)
        return jax.device_get(fn(init_state(cfg, plan, tx, mesh)["params"], batch))


def test_expert_parallel_gradients_equal_one_device(devices):
    """Every gradient array at the initial weights, experts and router included."""
    one = _gradients(devices[:1])
    many = _gradients(devices, "mesh.expert=4", "mesh.fsdp=2")
    flat = jax.tree_util.tree_flatten_with_path(one)[0]
    for (path, a), b in zip(flat, jax.tree.leaves(many)):
        scale = max(float(np.linalg.norm(a)), 1e-12)
        assert float(np.linalg.norm(a - b)) / scale < 1e-5, jax.tree_util.keystr(path)
    assert np.linalg.norm(one["layers"]["mlp"]["router"]) > 0  # the router learns


def test_capacity_drops_in_sequence_order_the_same_on_every_mesh(devices, tmp_path):
    """A capacity below the load drops pairs (moe_dropped > 0) the same way on 8 devices as on
    one; a capacity that holds every pair equals dropless bit for bit."""
    tight = ("model.moe.capacity_factor=0.5",)
    one = config.load([MOE], [*QUIET, *SHORT, f"run.dir={tmp_path / 'a'}", *tight])
    rows = train(one, devices=devices[:1])
    # at most half the pairs fit, the most loaded layer's load 2.3-4x the mean: 61-86% dropped
    assert all(0.5 < row["moe_dropped"] < 0.95 for row in rows)
    many = config.load([MOE], [*QUIET, *SHORT, f"run.dir={tmp_path / 'b'}", *tight,
                              "mesh.expert=4", "mesh.fsdp=2"])
    sharded = train(many, devices=devices)
    # the first step at the same weights drops the same pairs: the same share, the same loss;
    # later, AdamW's updates differ in the last bits, and a router logit at a capacity boundary
    # can move one pair (measured: step 4's loss 2.7e-5 apart, the others within 5e-6)
    assert sharded[0]["moe_dropped"] == pytest.approx(rows[0]["moe_dropped"], abs=1e-7)
    assert sharded[0]["loss"] == pytest.approx(rows[0]["loss"], rel=1e-6)
    np.testing.assert_allclose([r["loss"] for r in sharded], [r["loss"] for r in rows],
                               rtol=1e-4)
    dropless = _curves(tmp_path / "c", devices[:1])
    roomy = _curves(tmp_path / "d", devices[:1], "model.moe.capacity_factor=4")  # E/k: every pair
    np.testing.assert_array_equal(roomy["loss"], dropless["loss"])


def test_router_losses_join_the_objective_not_the_logged_loss():
    """The objective sums aux_coef x aux + z_coef x z (each a sum over tokens) onto the
    cross-entropy; the cross-entropy (the logged loss, and eval's) is the same whatever the
    coefficients."""
    cfg = config.load([MOE], [*QUIET, *SHORT, "model.moe.z_coef=0.01"])
    model = Transformer(cfg.model, nnx.Rngs(0))
    graphdef, params = nnx.split(model, nnx.Param)
    batch = {k: jnp.asarray(v) for k, v in
             next(data.make_batches(cfg.data, cfg.train, cfg.model.vocab_size)).items()}
    total, (count, entropy, stats) = loss_sums(nnx.to_pure_dict(params), graphdef, batch,
                                               with_stats=True)
    m = cfg.model
    expected = entropy + m.moe.aux_coef * stats["aux"] + m.moe.z_coef * stats["z"]
    assert abs(float(total - expected)) < 1e-3 and float(total - entropy) > 0
    plain, plain_count = loss_sums(nnx.to_pure_dict(params), graphdef, batch)
    assert float(plain) == float(total) and int(plain_count) == int(count)


@pytest.mark.parametrize("args, names", [
    (["mesh.expert=2"], ["mesh.expert=2", "model.moe.num_experts=0"]),
    (["--config", str(MOE), "mesh.expert=3", "mesh.fsdp=2", "--devices", "6"],
     ["model.moe.num_experts=8", "mesh.expert=3"]),
    (["--config", str(ROOT / "configs" / "tiny_deepseek.yaml"), "mesh.stage=2", "model.num_layers=5",
      "pipeline.schedule=1f1b", "model.mtp_depth=1", "--devices", "2"],
     ["pipeline.schedule=1f1b", "model.mtp_depth=1"]),
    (["--config", str(MOE), "model.moe.experts_per_token=9"], ["model.moe.experts_per_token=9"]),
    (["--config", str(MOE), "model.moe.kernel=megablox"], ["model.moe.kernel=megablox"]),
    (["optim.mu_dtype=int8"], ["optim.mu_dtype=int8"]),
])
def test_bad_moe_settings_are_one_line_and_status_2(capsys, args, names):
    rc = launch.main([*args, "--dry-run", *([] if "--devices" in args else ["--devices", "8"])])
    assert_refused(rc, capsys.readouterr().err, *names)


def test_a_grouped_kernel_that_is_not_installed_is_refused(capsys, monkeypatch):
    """model.moe.kernel=mosaic without tokamax (or, on jax 0.11, =triton, whose kernel needs jax
    0.10): one line naming the setting and what works instead, status 2."""
    monkeypatch.setattr(experts, "_tokamax", lambda: None)
    rc = launch.main(["--config", str(MOE), "model.moe.kernel=mosaic", "--dry-run"])
    assert_refused(rc, capsys.readouterr().err, "model.moe.kernel=mosaic", "model.moe.kernel=xla")


class _JunkKernels:
    """A CPU stand-in for tokamax with its kernels' contract: jax.lax.ragged_dot's numbers in
    each group's rows, and `junk` in the rows past sum(sizes) of the result and of x's gradient
    (its kernels write only the groups' rows, and XLA does not zero a custom call's buffer)."""

    def __init__(self, junk: float):
        self.junk = junk

    def ragged_dot(self, x, w, sizes, implementation):
        fill = lambda a, sizes: jnp.where((jnp.arange(a.shape[0]) >= jnp.sum(sizes))[:, None],
                                          jnp.asarray(self.junk, a.dtype), a)

        @jax.custom_vjp
        def dot(x, w, sizes):
            return fill(jax.lax.ragged_dot(x, w, sizes), sizes)

        def forward(x, w, sizes):
            return dot(x, w, sizes), (x, w, sizes)

        def backward(res, g):
            x, w, sizes = res
            dx, dw = jax.vjp(lambda x, w: jax.lax.ragged_dot(x, w, sizes), x, w)[1](g)
            return fill(dx, sizes), dw, None

        dot.defvjp(forward, backward)
        return dot(x, w, sizes)


@pytest.mark.parametrize("junk", [1e4, float("nan")])
@pytest.mark.parametrize("where", ["tokamax", "any kernel"])
def test_a_kernel_that_leaves_rows_unwritten_changes_no_gradient(monkeypatch, junk, where):
    """One layer, padding tokens and a capacity that drops pairs (both parked past the groups):
    outputs and gradients (inputs, router, experts) through the junk-leaving stand-in, as
    tokamax or as whatever grouped kernel the layer is given, equal jax.lax.ragged_dot's.
    Without the select around the kernel: NaN, or gradients 4e4 off."""
    stand_in = _JunkKernels(junk)
    if where == "tokamax":
        monkeypatch.setattr(experts, "_tokamax", lambda: stand_in)
    else:
        monkeypatch.setattr(experts, "_grouped", lambda kind: jax.lax.ragged_dot if kind == "xla"
                            else functools.partial(stand_in.ragged_dot, implementation=kind))
    cfg = ModelConfig(d_model=16, mlp_dim=24, dtype="float32", init_std=0.3, moe=MoEConfig(
        num_experts=4, experts_per_token=2, capacity_factor=0.75, kernel="xla"))
    graphdef, params = nnx.split(moe.MoE(cfg, nnx.Rngs(3)))
    x = jnp.asarray(np.random.default_rng(2).normal(size=(2, 8, 16)), jnp.float32)
    probe = jnp.asarray(np.random.default_rng(4).normal(size=(2, 8, 16)), jnp.float32)
    segments = jnp.asarray(np.r_[[[1] * 8], [[1] * 5 + [0] * 3]], jnp.int32)

    def loss(params, x, kernel):
        layer = nnx.merge(graphdef, params)
        layer.cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, kernel=kernel))
        y, stats = layer(x, segments)
        assert float(stats["dropped"]) > 0  # a capacity that drops, not only padding
        return jnp.sum(y * probe) + jnp.sum(stats["probs"] * probe[:, 0, :4])

    want = jax.grad(loss, argnums=(0, 1))(params, x, "xla")
    got = jax.grad(loss, argnums=(0, 1))(params, x, "mosaic")
    for (path, a), b in zip(jax.tree_util.tree_flatten_with_path(got)[0], jax.tree.leaves(want)):
        np.testing.assert_allclose(a, b, atol=1e-5, err_msg=jax.tree_util.keystr(path))


def _grads_with(devices, kernel: str, *overrides, microbatches: int = 1) -> tuple:
    """(loss, gradients, the router metrics) of configs/tiny_moe.yaml's first batch at the
    initial weights, with model.moe.kernel set after the config's checks (the stand-in kernel
    runs in float32)."""
    cfg = config.load([MOE], [*QUIET, *SHORT, *overrides])
    moe_cfg = dataclasses.replace(cfg.model.moe, kernel=kernel)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, moe=moe_cfg))
    tx = make_optimizer(cfg)
    plan = make_plan(cfg, tx, len(devices))
    mesh = parallel.make_mesh(cfg.mesh, devices)

    def fn(params, batch):
        loss, grads, extras = loss_and_grads(params, plan.graphdef, batch, microbatches,
                                             histories=empty_histories(plan.histories))
        return loss, grads, moe.metrics(extras["moe"], extras["tokens"], capacity=True)

    with jax.set_mesh(mesh):
        rows = next(data.make_batches(cfg.data, cfg.train, cfg.model.vocab_size))
        rows["segment_ids"][1, 40:] = 0  # a padded row: unrouted pairs
        batch = global_batch(rows, mesh)
        return jax.device_get(jax.jit(fn)(init_state(cfg, plan, tx, mesh)["params"], batch))


def _assert_gradients_close(got: dict, want: dict, tol: float = 1e-5) -> None:
    flat = jax.tree_util.tree_flatten_with_path(want)[0]
    for (path, a), b in zip(flat, jax.tree.leaves(got)):
        scale = max(float(np.linalg.norm(a)), 1e-12)
        assert float(np.linalg.norm(a - b)) / scale < tol, (jax.tree_util.keystr(path),
                                                            float(np.linalg.norm(a - b)) / scale)


def test_the_expert_ring_with_a_junk_leaving_kernel_trains_like_xla(devices, monkeypatch):
    """mesh.expert=2: half of every ring step's pairs belong to the other device's experts and
    are parked past the groups, with a padded row's unrouted pairs; loss and every gradient
    through the stand-in equal jax.lax.ragged_dot's."""
    monkeypatch.setattr(experts, "_tokamax", lambda: _JunkKernels(float("nan")))
    monkeypatch.setattr(experts, "KERNEL_DTYPES", ("float32",))  # the stand-in's
    mesh = ("mesh.expert=2", "mesh.fsdp=4")
    want_loss, want, _ = _grads_with(devices, "xla", *mesh)
    got_loss, got, _ = _grads_with(devices, "mosaic", *mesh)
    assert abs(float(got_loss) - float(want_loss)) < 1e-6 * abs(float(want_loss))
    _assert_gradients_close(got, want)


@pytest.mark.parametrize("capacity", ["model.moe.capacity_factor=0", "model.moe.capacity_factor=0.5"])
def test_the_objective_is_the_same_for_any_microbatch_count(devices, capacity):
    """1, 2 and 4 microbatches of one batch (a padded row in it): the same loss, gradients and
    router metrics (balancing loss, z-loss, load, dropped share), dropless and with a capacity
    that drops 78% of the pairs. Measured (float32, jax 0.10.2 CPU): loss within 2.1e-7
    relative, gradients within 6.8e-7 of their norm, metrics within 1.1e-7."""
    one = _grads_with(devices[:1], "xla", capacity, "model.moe.z_coef=0.01")
    if capacity.endswith("0.5"):
        assert 0.2 < float(one[2]["moe_dropped"]) < 0.9
    for m in (2, 4):
        loss, grads, stats = _grads_with(devices[:1], "xla", capacity, "model.moe.z_coef=0.01",
                                         microbatches=m)
        assert abs(float(loss) - float(one[0])) < 1e-5 * float(one[0]), m
        _assert_gradients_close(grads, one[1])
        for key, value in one[2].items():
            np.testing.assert_allclose(stats[key], value, rtol=1e-5, err_msg=f"{key}, M={m}")


@pytest.mark.parametrize("name", ["mixtral", "qwen3_moe_normalized"])
def test_the_balancing_loss_is_transformers_per_sequence(tmp_path, name):
    """3 layers, 3 sequences (one padded at its end): each sequence's balancing loss is what
    transformers' load_balancing_loss_func gives for it alone (output_router_logits=True,
    pooled over all layers, padding masked), and the batch's is their token-weighted mean;
    transformers' own batch value pools the sequences instead, and differs. Measured (float32,
    transformers 5.24): within 9e-8 relative; the pooled batch value 1.5-6.4% apart."""
    config_cls, model_cls, overrides = FAMILIES[name]
    torch.manual_seed(1)
    ref = model_cls(config_cls(**{**TINY, "num_hidden_layers": 3}, **overrides,
                               output_router_logits=True)).eval()
    with torch.no_grad():
        for pname, p in ref.named_parameters():
            p.copy_(1.0 + 0.2 * torch.randn_like(p) if pname.endswith("norm.weight")
                    else 0.5 * torch.randn_like(p))
    ref.save_pretrained(tmp_path)
    cfg, params = hf.from_pretrained(tmp_path)
    assert cfg.num_layers == 3
    tokens = _tokens(3, 16)
    mask = np.ones_like(tokens)
    mask[2, 11:] = 0
    graphdef = nnx.graphdef(Transformer(cfg, nnx.Rngs(0)))
    batch = {"tokens": tokens, "targets": tokens, "segment_ids": mask,
             "positions": np.broadcast_to(np.arange(16), tokens.shape)}
    _, (count, _, sums) = loss_sums(params, graphdef, jax.tree.map(jnp.asarray, batch),
                                    with_stats=True)
    ours = float(sums["aux"] / count)

    def theirs(rows) -> float:
        with torch.no_grad():
            out = ref(input_ids=torch.from_numpy(tokens[rows]),
                      attention_mask=torch.from_numpy(mask[rows]))
        return float(out.aux_loss)

    per_row = [theirs(slice(b, b + 1)) for b in range(3)]
    want = float(np.dot(per_row, mask.sum(1)) / mask.sum())
    print(f"{name}: ours {ours:.6f}, relative to the per-sequence mean {ours / want - 1:.1e}, "
          f"transformers' batch {theirs(slice(None)):.6f}")
    assert abs(ours - want) < 1e-5 * want
    assert abs(ours - theirs(slice(None))) > 1e-3  # the batch-pooled form is another number


@pytest.mark.parametrize("remat", ["full", "save_dots"])
def test_weights_fetched_a_layer_ahead_change_no_gradient(devices, remat):
    """model.weights_ahead: the attention weights gathered over fsdp x expert one layer ahead
    and carried into the next; loss, every gradient and the router sums as without."""
    mesh = ("mesh.expert=4", "mesh.fsdp=2", f"model.remat={remat}")
    want = _grads_with(devices, "xla", *mesh)
    got = _grads_with(devices, "xla", *mesh, "model.weights_ahead=true")
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    _assert_gradients_close(got[1], want[1])
    np.testing.assert_allclose(got[2]["moe_load"], want[2]["moe_load"], rtol=1e-6)


# gpt-oss's blocks on tiny_moe: sinks, biased attention and experts, the clamped SwiGLU at a
# limit the activations reach, every other layer windowed (a window of 16 in rows of 64), YaRN
GPT_OSS = ("model.family=gpt_oss", "model.qkv_bias=true", "model.attn_sinks=true",
           "model.moe.swiglu_limit=0.5", "model.sliding_window=16", "model.global_every=2",
           "model.rope_scaling_type=yarn", "model.rope_scaling_factor=4",
           "model.rope_original_max_len=32", "model.rope_truncate=false")


def test_gpt_oss_on_experts_tensor_and_fsdp_equals_one_device(devices, tmp_path):
    """mesh.expert=2 mesh.tensor=2 mesh.fsdp=2 (the experts' down bias added on one tensor
    rank, their gate/up pairs split whole over tensor): every gradient at the initial weights
    (sinks and biases included) and 4 steps of losses and grad norms equal one device's."""
    mesh = ("mesh.expert=2", "mesh.tensor=2", "mesh.fsdp=2")
    one, many = _gradients(devices[:1], *GPT_OSS), _gradients(devices, *GPT_OSS, *mesh)
    flat = jax.tree_util.tree_flatten_with_path(one)[0]
    names = {jax.tree_util.keystr(path) for path, _ in flat}
    assert {"['layers']['attn']['sinks']", "['layers']['mlp']['b_down']",
            "['layers']['mlp']['b_gate_up']", "['layers']['mlp']['b_router']"} <= names
    for (path, a), b in zip(flat, jax.tree.leaves(many)):
        scale = float(np.linalg.norm(a))
        assert scale > 0, jax.tree_util.keystr(path)
        assert float(np.linalg.norm(a - b)) / scale < 1e-5, jax.tree_util.keystr(path)
    want = _curves(tmp_path / "one", devices[:1], *GPT_OSS)
    got = _curves(tmp_path / "many", devices, *GPT_OSS, *mesh)
    for key in ("loss", "grad_norm", "moe_aux_loss"):
        np.testing.assert_allclose(got[key], want[key], rtol=1e-4, err_msg=key)
