"""Checks that need an NVIDIA GPU (marked `gpu`): run them with `pytest -m gpu` on a GPU machine;
everywhere else they are skipped (tests/conftest.py). Each asserts numbers:

- cuDNN fused attention against the XLA reference on packed bf16 batches (several documents per
  row, padding), forward and dq, dk, dv, over sequence lengths, GQA groups and head sizes; and
  that the segment mask matters (the same data as one document is far outside the tolerance).
- jaxtron's real train step, a few steps on one GPU against the same steps on one CPU device:
  same initial state, same packed batch, bf16 compute (cudnn on the GPU, xla on the CPU).
- tokamax's Mosaic GPU grouped kernel for the MoE experts against jax.lax.ragged_dot: loss and
  gradients on a padded batch (the rows the kernel leaves unwritten must reach nothing).
- The `gpu` XLA flag preset accepted by a GPU backend, and xla.mem_fraction taking effect (in
  subprocesses: the backend in this process has started already).

The comparison helpers also run here on the CPU (the tests not marked gpu), so that a slip in the
test itself shows up before GPU time is spent.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

from jaxtron import config, parallel
from jaxtron.ops import attention
from jaxtron.program import xla_flags
from jaxtron.step import compile_step, global_batch, loss_and_grads
from jaxtron.step.optim import make_optimizer
from jaxtron.step.state import init_state, make_plan

ROOT = Path(__file__).resolve().parent.parent
gpu = pytest.mark.gpu

# --- attention --------------------------------------------------------------------------------

# Relative L2 error allowed between two bf16 attention kernels (output, dq, dk, dv). bf16 keeps 8
# significant bits (unit roundoff 2^-8 = 3.9e-3); each kernel rounds its inputs' products, the
# probabilities and its outputs to bf16 at different places, so two correct kernels differ by a
# few roundoffs spread over the tensor. Measured on the CPU, xla_attention in bf16 against the
# same in float32 on the same bf16 inputs: 1.6e-3 - 2.9e-3 (these shapes); two independent bf16
# kernels: ~sqrt(2) x that, ~4e-3. 2e-2 (jaxtron's own attention self_check) leaves 5x room,
# while a kernel that ignores the segments is off by ~0.77 (MASK_FLOOR below).
ATTENTION_RTOL = 2e-2
# The same data with every row's documents merged into one: measured 0.76-0.79 (xla, CPU), so a
# kernel that drops the segment ids cannot pass as a kernel within ATTENTION_RTOL.
MASK_FLOOR = 10 * ATTENTION_RTOL
ATTENTION_SHAPES = [  # (T, N query heads, K kv heads, H head size): G = N / K = 1, 4, 8
    (128, 8, 8, 64),
    (512, 8, 2, 128),
    (512, 16, 2, 64),
    (2048, 8, 1, 64),
    (2048, 16, 4, 128),
]
ROWS = 3  # one row without padding, two with


def packed_segments(rows: int, t: int, seed: int = 0) -> np.ndarray:
    """[rows, t] segment ids as the input pipeline packs them: 2-5 documents of random lengths per
    row, numbered from 1, and on every other row a tail of padding (0, up to t/8 tokens)."""
    rng = np.random.default_rng(seed)
    segments = np.zeros((rows, t), np.int32)
    for row in range(rows):
        pad = int(rng.integers(1, t // 8 + 1)) if row % 2 == 0 else 0
        cuts = np.sort(rng.choice(np.arange(1, t - pad), int(rng.integers(1, 5)), replace=False))
        bounds = [0, *cuts.tolist(), t - pad]
        for doc, (start, end) in enumerate(zip(bounds[:-1], bounds[1:]), start=1):
            segments[row, start:end] = doc
    return segments


def merged(segments: np.ndarray) -> np.ndarray:
    """The same rows with their documents merged into one (padding stays padding)."""
    return np.where(segments > 0, 1, 0).astype(np.int32)


def attention_inputs(t: int, n: int, k: int, h: int, device, dtype=jnp.bfloat16, seed: int = 0):
    """(q, k, v, cotangent) on `device`: standard normal (scores ~ N(0, 1) after the 1/sqrt(H)
    scale), q/k/v in `dtype`, the cotangent of the output in float32."""
    rng = np.random.default_rng(seed)
    shapes = [(ROWS, t, n, h), (ROWS, t, k, h), (ROWS, t, k, h), (ROWS, t, n, h)]
    arrays = [rng.standard_normal(shape, np.float32) for shape in shapes]
    arrays[:3] = [a.astype(dtype) for a in arrays[:3]]
    return [jax.device_put(a, device) for a in arrays]


def outputs_and_grads(kernel, q, k, v, segments, cotangent) -> list[np.ndarray]:
    """[output, dq, dk, dv] of `kernel` (gradients of sum(output * cotangent)), on the inputs'
    device, as float32 numpy arrays."""

    def run(q, k, v, segments, cotangent):
        loss = lambda q, k, v: jnp.sum(kernel(q, k, v, segments).astype(jnp.float32) * cotangent)
        return (kernel(q, k, v, segments), *jax.grad(loss, argnums=(0, 1, 2))(q, k, v))

    segments = jax.device_put(segments, q.sharding)
    out = jax.jit(run)(q, k, v, segments, cotangent)
    return [np.asarray(x.astype(jnp.float32)) for x in out]


def relative_errors(got: list, want: list) -> dict[str, float]:
    """Relative L2 error of each of output, dq, dk, dv (float64 norms)."""
    errors = {}
    for name, a, r in zip(("output", "dq", "dk", "dv"), got, want, strict=True):
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        errors[name] = float(np.linalg.norm(a - r) / np.linalg.norm(r))
    return errors


def test_packed_segments_have_documents_and_padding():
    segments = packed_segments(ROWS, 128)
    for row in segments:
        docs = row[row > 0]
        assert 2 <= len(np.unique(docs)) <= 5 and np.all(np.diff(docs) >= 0)  # in order
        assert np.all(row[len(docs):] == 0)  # padding only at the end
    assert (segments[0] == 0).any() and not (segments[1] == 0).any()
    assert np.array_equal(np.unique(merged(segments)), [0, 1])


def test_merged_segments_differ_beyond_the_tolerance_on_cpu():
    """What the GPU mask test relies on, with the xla kernel: the comparison sees 0 between one
    kernel and itself, bf16 rounding stays well inside ATTENTION_RTOL, and the merged documents
    are far outside it."""
    cpu = jax.devices("cpu")[0]
    t, n, k, h = 128, 8, 2, 64
    segments = packed_segments(ROWS, t)
    q, kk, v, cot = attention_inputs(t, n, k, h, cpu)
    want = outputs_and_grads(attention.xla_attention, q, kk, v, segments, cot)
    again = outputs_and_grads(attention.xla_attention, q, kk, v, segments, cot)
    assert max(relative_errors(again, want).values()) == 0
    as_f32 = [x.astype(jnp.float32) for x in (q, kk, v)]
    f32 = outputs_and_grads(attention.xla_attention, *as_f32, segments, cot)
    assert max(relative_errors(want, f32).values()) < ATTENTION_RTOL / 4  # measured 2.9e-3
    wrong = outputs_and_grads(attention.xla_attention, q, kk, v, merged(segments), cot)
    assert min(relative_errors(wrong, want).values()) > MASK_FLOOR  # measured 0.76


@gpu
@pytest.mark.parametrize("t,n,k,h", ATTENTION_SHAPES)
def test_cudnn_attention_matches_xla_on_packed_batches(t, n, k, h):
    cuda = jax.devices("cuda")[0]
    segments = packed_segments(ROWS, t, seed=t + n + k + h)
    inputs = attention_inputs(t, n, k, h, cuda, seed=t * h + n * k)
    want = outputs_and_grads(attention.xla_attention, *inputs[:3], segments, inputs[3])
    got = outputs_and_grads(attention.cudnn_attention, *inputs[:3], segments, inputs[3])
    errors = relative_errors(got, want)
    assert max(errors.values()) <= ATTENTION_RTOL, errors


@gpu
def test_cudnn_attention_keeps_packed_documents_apart():
    """The kernel on the same data with each row's documents merged: far from the packed
    reference (so a kernel ignoring the segment ids fails the test above), yet right for the
    merged rows (so the difference is the mask, not noise)."""
    cuda = jax.devices("cuda")[0]
    t, n, k, h = 512, 8, 2, 128
    segments = packed_segments(ROWS, t, seed=1)
    q, kk, v, cot = attention_inputs(t, n, k, h, cuda, seed=1)
    packed = outputs_and_grads(attention.xla_attention, q, kk, v, segments, cot)
    one_doc = outputs_and_grads(attention.cudnn_attention, q, kk, v, merged(segments), cot)
    one_doc_ref = outputs_and_grads(attention.xla_attention, q, kk, v, merged(segments), cot)
    errors = relative_errors(one_doc, packed)
    assert min(errors.values()) > MASK_FLOOR, errors
    errors = relative_errors(one_doc, one_doc_ref)
    assert max(errors.values()) <= ATTENTION_RTOL, errors


@gpu
@pytest.mark.parametrize("window", [64, 96])
def test_cudnn_windowed_attention_matches_xla_on_packed_batches(window):
    """cuDNN's sliding_window_length against the banded XLA kernel (512 positions: chunks of 64
    or 128), packed documents, forward and gradients; and the per-layer choice between the two
    kernels (`attention.either`, a cond) picks the windowed one where asked."""
    cuda = jax.devices("cuda")[0]
    t, n, k, h = 512, 8, 2, 128
    segments = packed_segments(ROWS, t, seed=window)
    q, kk, v, cot = attention_inputs(t, n, k, h, cuda, seed=window)
    windowed = lambda kernel: lambda *a: kernel(*a, window)
    want = outputs_and_grads(windowed(attention.xla_attention), q, kk, v, segments, cot)
    got = outputs_and_grads(windowed(attention.cudnn_attention), q, kk, v, segments, cot)
    errors = relative_errors(got, want)
    assert max(errors.values()) <= ATTENTION_RTOL, errors
    either = lambda *a: attention.either(*a, jnp.asarray(True), "cudnn", window)
    errors = relative_errors(outputs_and_grads(either, q, kk, v, segments, cot), want)
    assert max(errors.values()) <= ATTENTION_RTOL, errors
    whole = outputs_and_grads(attention.xla_attention, q, kk, v, segments, cot)
    assert min(relative_errors(got, whole).values()) > MASK_FLOOR  # the window matters


@gpu
@pytest.mark.parametrize("sizes", [(64, 64), (192, 128)])  # latent attention's
def test_attention_self_check_passes_on_the_gpu(sizes):
    """jaxtron's start-up check (train() runs it before training with model.attention=cudnn)."""
    with jax.default_device(jax.devices("cuda")[0]):
        attention.self_check("cudnn", sizes=sizes)  # raises a ConfigError naming the error


# --- train steps ------------------------------------------------------------------------------

STEPS = 4
# The tiny preset in bf16 compute over float32 master weights, one device, 4 AdamW steps at its
# lr 3e-3 without warmup (so the updates are not vanishingly small), on one fixed packed batch.
STEP_OVERRIDES = ["model.dtype=bfloat16", "model.attention=auto", "mesh.fsdp=1",
                  "train.batch_size=4", "train.seq_len=256", f"train.steps={STEPS}",
                  "optim.warmup_steps=0"]
# GPU (cudnn attention, bf16 tensor-core matmuls) vs CPU (xla attention, XLA:CPU bf16 dots): two
# bf16 computations that round at different places, each somewhere between float32 and bf16
# everywhere, so they should differ by about twice what bf16 vs float32 does at most. Measured
# on the CPU, this batch in bf16 against float32: loss 5.4e-4 (largest over 4 steps, at step 4:
# Adam carries the noise forward), grad norm 7.7e-3, initial gradient 7.6e-3, parameter updates
# 5.5e-2 (Adam's first steps are ~lr x sign(grad), so elements whose gradient is near 0 flip).
# Tolerances 5-9x those. The same steps with each row's documents merged (what a kernel
# ignoring segment ids computes) are off by loss 4.0e-2, grad norm 0.22, gradient 1.08, updates
# 1.09: 3.6-20x beyond them.
STEP_RTOL = {"loss": 5e-3, "grad_norm": 4e-2, "grads": 5e-2, "updates": 0.3}


def step_batch(cfg: config.Config, seed: int = 0) -> dict[str, np.ndarray]:
    """One fixed packed batch: 2-5 documents per row, padding on every other row, positions from 0
    in each document. Each document repeats a random 16-token phrase from a 512-token slice of
    the vocabulary, so the next token depends on earlier tokens of the same document."""
    b, t = cfg.train.batch_size, cfg.train.seq_len
    rng = np.random.default_rng(seed)
    segments = packed_segments(b, t + 1, seed)
    tokens = np.zeros((b, t + 1), np.int32)
    positions = np.zeros((b, t + 1), np.int32)
    for row in range(b):
        for doc in np.unique(segments[row][segments[row] > 0]):
            where = np.flatnonzero(segments[row] == doc)
            phrase = rng.integers(0, 512, 16)
            tokens[row, where] = np.resize(phrase, len(where))
            positions[row, where] = np.arange(len(where))
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": segments[:, :-1],
            "positions": positions[:, :-1]}


def one_device_mesh(device) -> Mesh:
    """A mesh of jaxtron's axes, all of size 1, over `device` (any backend, not only the
    default one, which parallel.make_mesh assumes)."""
    axes = parallel.MESH_AXES
    return Mesh(np.asarray([device]).reshape((1,) * len(axes)), axes,
                axis_types=(jax.sharding.AxisType.Auto,) * len(axes))


@dataclasses.dataclass
class StepRun:
    kernel: str  # the attention kernel model.attention resolved to on the device
    losses: np.ndarray  # [STEPS]
    grad_norms: np.ndarray  # [STEPS]
    grads: dict  # the gradient at the initial state (float32 numpy tree)
    params: dict  # after the last step (float32 numpy tree)


def start_state(cfg: config.Config) -> dict:
    """The train state of cfg's seed, made once on one CPU device and fetched to the host, so
    every run starts from the same numbers."""
    cfg = attention.configure(cfg, "cpu")
    tx = make_optimizer(cfg)
    plan = make_plan(cfg, tx, 1)
    mesh = one_device_mesh(jax.devices("cpu")[0])
    with jax.set_mesh(mesh):
        return jax.device_get(init_state(cfg, plan, tx, mesh))


def run_steps(cfg: config.Config, device, state: dict, batch: dict) -> StepRun:
    """cfg.train.steps of jaxtron's train step (step.compile_step, as train() compiles it) on one
    `device` from the host `state` on the fixed `batch`; and the gradient at `state`."""
    cfg = attention.configure(cfg, device.platform)  # as train() does: auto -> cudnn on GPUs
    tx = make_optimizer(cfg)
    plan = make_plan(cfg, tx, 1)
    mesh = one_device_mesh(device)
    with jax.set_mesh(mesh):
        state = jax.device_put(state, parallel.named(plan.specs, mesh))
        inputs = global_batch(batch, mesh)
        grad_fn = jax.jit(lambda params, batch: loss_and_grads(
            params, plan.graphdef, batch, 1, None, cfg.train.loss_chunk)[1])
        grads = jax.device_get(grad_fn(state["params"], inputs))
        step = compile_step(cfg, plan, tx, mesh)
        history = []
        for _ in range(cfg.train.steps):
            state, metrics = step(state, inputs)
            history.append(jax.device_get(metrics))
        params = jax.device_get(state["params"])
    assert all(int(m["nonfinite"]) == 0 for m in history), history
    return StepRun(cfg.model.attention, np.array([float(m["loss"]) for m in history]),
                   np.array([float(m["grad_norm"]) for m in history]), grads, params)


def _tree_relative(got: dict, want: dict) -> float:
    """||got - want|| / ||want|| over every leaf of two trees (float64)."""
    pairs = zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True)
    diff = total = 0.0
    for a, r in pairs:
        a, r = np.asarray(a, np.float64), np.asarray(r, np.float64)
        diff += float(np.sum((a - r) ** 2))
        total += float(np.sum(r ** 2))
    return (diff / total) ** 0.5


def compare_runs(got: StepRun, want: StepRun, start: dict) -> dict[str, float]:
    """Relative errors of `got` against `want`: per-step loss and grad norm (the largest over the
    steps), the initial gradient (L2 over all parameters), and the parameter updates
    (final - start params; L2 over all, against the size of `want`'s update)."""
    updates = lambda run: jax.tree.map(lambda p, p0: np.asarray(p, np.float64) - p0,
                                       run.params, start["params"])
    return {
        "loss": float(np.max(np.abs(got.losses - want.losses) / np.abs(want.losses))),
        "grad_norm": float(np.max(np.abs(got.grad_norms - want.grad_norms) / want.grad_norms)),
        "grads": _tree_relative(got.grads, want.grads),
        "updates": _tree_relative(updates(got), updates(want)),
    }


@pytest.fixture(scope="module")
def step_setup():
    """(cfg, initial host state, fixed batch, the run on one CPU device)."""
    cfg = config.load([ROOT / "configs" / "tiny.yaml"], STEP_OVERRIDES)
    state = start_state(cfg)
    batch = step_batch(cfg)
    return cfg, state, batch, run_steps(cfg, jax.devices("cpu")[0], state, batch)


def test_train_step_comparison_on_cpu(step_setup):
    """The GPU test's helpers on the CPU: a loss that falls, and merged documents (what a kernel
    ignoring segment ids computes) outside every tolerance."""
    cfg, state, batch, cpu = step_setup
    assert cpu.kernel == "xla"
    assert cpu.losses[-1] < cpu.losses[0] - 1, cpu.losses  # measured 9.06 -> 6.83
    assert compare_runs(cpu, cpu, state) == dict.fromkeys(STEP_RTOL, 0.0)
    one_doc = {**batch, "segment_ids": merged(batch["segment_ids"])}
    wrong = run_steps(cfg, jax.devices("cpu")[0], state, one_doc)
    errors = compare_runs(wrong, cpu, state)
    assert all(errors[key] > STEP_RTOL[key] for key in STEP_RTOL), errors


@pytest.mark.slow
def test_train_step_tolerances_cover_bf16_rounding(step_setup):
    """bf16 against float32 on the CPU stays within half of STEP_RTOL (the measured proxy for
    GPU vs CPU; see STEP_RTOL), so the GPU test does not fail on rounding alone."""
    cfg, state, batch, cpu = step_setup
    f32 = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dtype="float32"))
    errors = compare_runs(cpu, run_steps(f32, jax.devices("cpu")[0], state, batch), state)
    assert all(errors[key] <= STEP_RTOL[key] / 2 for key in STEP_RTOL), errors


@gpu
def test_train_steps_on_gpu_match_cpu(step_setup):
    cfg, state, batch, cpu = step_setup
    cuda = run_steps(cfg, jax.devices("cuda")[0], state, batch)
    assert (cuda.kernel, cpu.kernel) == ("cudnn", "xla")
    errors = compare_runs(cuda, cpu, state)
    detail = f"{errors}; losses gpu {cuda.losses} cpu {cpu.losses}"
    assert all(errors[key] <= STEP_RTOL[key] for key in STEP_RTOL), detail


# --- XLA flags and memory fraction, in a fresh process -----------------------------------------

# Sets the gpu preset and xla.mem_fraction as launch.py does (xla_flags.apply, before the backend
# starts), starts the backend, runs a scanned matmul (a while loop: the pipelining and
# double-buffering flags act on it) and prints what it found as one JSON line.
BACKEND_SCRIPT = textwrap.dedent("""
    import ctypes, json, os, sys
    import numpy as np
    from jaxtron.program import xla_flags
    from jaxtron.config import XlaConfig

    flags = xla_flags.apply(XlaConfig(preset="gpu", mem_fraction=float(sys.argv[1])))
    import jax
    import jax.numpy as jnp

    device = jax.devices()[0]
    w = np.linalg.qr(np.random.default_rng(0).standard_normal((256, 256)))[0].astype(np.float32)
    x = np.random.default_rng(1).standard_normal((64, 256)).astype(np.float32)

    def layers(x, w):
        step = lambda x, _: (jnp.tanh(jnp.dot(x, w, precision="highest")), None)
        return jax.lax.scan(step, x, None, length=8)[0]

    got = np.asarray(jax.jit(layers)(jax.device_put(x, device), jax.device_put(w, device)))
    want = x.astype(np.float64)
    for _ in range(8):
        want = np.tanh(want @ w)

    def total_bytes():  # the GPU's memory as XLA's allocator sizes it (cuMemGetInfo's total)
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
        except OSError:
            return None
        ordinal, total = ctypes.c_int(), ctypes.c_size_t()
        if (cuda.cuInit(0) or cuda.cuDeviceGet(ctypes.byref(ordinal), 0)
                or cuda.cuDeviceTotalMem_v2(ctypes.byref(total), ordinal)):
            return None
        return total.value

    print(json.dumps({
        "platform": device.platform, "flags": flags,
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "mem_fraction_env": os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION"),
        "bytes_limit": (device.memory_stats() or {}).get("bytes_limit"),
        "total_bytes": total_bytes() if device.platform == "gpu" else None,
        "scan_error": float(np.max(np.abs(got - want))),
    }))
""")
MEM_RTOL = 0.03  # bytes_limit against fraction x total; XLA sizes its pool as exactly that


def run_backend_script(fraction: float, **env: str) -> dict:
    """BACKEND_SCRIPT in a fresh Python: this process's JAX and allocator settings left out."""
    clean = {k: v for k, v in os.environ.items()
             if k not in ("XLA_FLAGS", "JAX_PLATFORMS", *xla_flags.MEM_FRACTION_VARS)
             and not k.startswith("XLA_PYTHON_CLIENT_")}
    proc = subprocess.run([sys.executable, "-c", BACKEND_SCRIPT, str(fraction)], cwd=ROOT,
                          env={**clean, **env}, capture_output=True, text=True, timeout=300,
                          check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _check_backend_result(result: dict, fraction: float, platform: str) -> None:
    assert result["platform"] == platform
    assert result["flags"] == list(xla_flags.XLA_PRESETS["gpu"])
    assert result["xla_flags"].split() == result["flags"]  # exported for the backend
    assert result["mem_fraction_env"] == str(fraction)
    assert result["scan_error"] < 1e-4  # float32 at highest precision: ~1e-6 measured on CPU


def test_backend_script_on_cpu():
    """The script's own logic, on the CPU backend (no memory stats there)."""
    result = run_backend_script(0.5, JAX_PLATFORMS="cpu")
    _check_backend_result(result, 0.5, "cpu")
    assert result["bytes_limit"] is None and result["total_bytes"] is None


def _total_gpu_bytes() -> int | None:
    """nvidia-smi's memory.total of GPU 0, where libcuda could not be asked."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,"
                              "nounits", "-i", "0"], capture_output=True, text=True, timeout=60,
                             check=True).stdout
        return int(out.split()[0]) * 2**20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None


@gpu
@pytest.mark.parametrize("fraction", [0.5, 0.3])
def test_gpu_flag_preset_and_memory_fraction_take_effect(fraction):
    """A GPU backend starts with every flag of the gpu preset and compiles and runs a scan under
    them; its allocator's limit is xla.mem_fraction of the GPU's memory."""
    result = run_backend_script(fraction)
    _check_backend_result(result, fraction, "gpu")
    total = result["total_bytes"] or _total_gpu_bytes()
    assert total, "neither libcuda nor nvidia-smi gave the GPU's memory size"
    share = result["bytes_limit"] / total
    assert abs(share - fraction) <= MEM_RTOL * fraction, (result["bytes_limit"], total, share)


MOE_OVERRIDES = ["model.dtype=bfloat16", "model.attention=xla", "mesh.fsdp=1",
                 "train.batch_size=4", "train.seq_len=256"]


def moe_gradients(kernel: str, device) -> tuple[float, dict]:
    """(loss, gradient) of configs/tiny_moe.yaml in bf16 at its initial weights on step_batch
    (padding on every other row: unrouted pairs past the groups) with model.moe.kernel=kernel,
    on one `device`."""
    cfg = config.load([ROOT / "configs" / "tiny_moe.yaml"], [*MOE_OVERRIDES,
                                                             f"model.moe.kernel={kernel}"])
    state = start_state(cfg)
    tx = make_optimizer(cfg)
    plan = make_plan(cfg, tx, 1)
    mesh = one_device_mesh(device)
    with jax.set_mesh(mesh):
        params = jax.device_put(state["params"], parallel.named(plan.specs["params"], mesh))
        fn = jax.jit(lambda p, b: loss_and_grads(p, plan.graphdef, b, 1)[:2])
        loss, grads = fn(params, global_batch(step_batch(cfg), mesh))
        return float(loss), jax.device_get(grads)


@gpu
def test_moe_grouped_kernel_gradients_match_xla_on_a_padded_batch():
    """tokamax's Mosaic GPU grouped kernel against jax.lax.ragged_dot on the same GPU: loss and
    every gradient on a batch with padding (pairs past the groups, where the kernel writes
    nothing). Tolerance: STEP_RTOL's (two bf16 computations); rows leaking from the kernel's
    unwritten buffer put gradients 46-104x their norm off (a CPU stand-in), or NaN."""
    from jaxtron.ops import experts  # noqa: PLC0415

    if not experts.available("mosaic"):
        pytest.skip("tokamax's Mosaic GPU ragged_dot is not installed")
    device = jax.devices("cuda")[0]
    loss, grads = moe_gradients("mosaic", device)
    want_loss, want = moe_gradients("xla", device)
    assert abs(loss - want_loss) <= STEP_RTOL["loss"] * abs(want_loss), (loss, want_loss)
    assert all(np.isfinite(g).all() for g in jax.tree.leaves(grads))
    error = _tree_relative(grads, want)
    print(f"moe mosaic vs xla: loss {loss:.6f} / {want_loss:.6f}, gradient {error:.2e}")
    assert error <= STEP_RTOL["grads"], error
