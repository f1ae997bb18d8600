"""A peer framework's train step on the same model and tokens per step as a jaxtron run: MaxText.

`run_maxtext` runs MaxText's own pre-training entry point in a subprocess (its synthetic data, no
checkpoints, no eval) with overrides that `maxtext_args` derives from a jaxtron Config, and reads
the step times MaxText logs itself, so that jaxtron bench can put jaxtron/MaxText ratios in a
table. Nothing of MaxText is imported here: it may live in another interpreter (`python`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from jaxtron.config import Config
from jaxtron.program import xla_flags

MAXTEXT_VERSION = "0.2.5"
MAXTEXT_MODULE = "maxtext.trainers.pre_train.train"
# What MaxText's pre-training step imports beyond jaxtron's own dependencies (found by running it
# on a fresh Python 3.12 venv with jaxtron installed), all installed with --no-deps.
MAXTEXT_PACKAGES = (
    "pathwaysutils", "fastapi", "starlette", "annotated-doc", "opentelemetry-api", "uvicorn",
    "requests", "urllib3", "certifi", "jinja2", "markupsafe", "pydantic", "pydantic-core",
    "annotated-types", "typing-inspection", "aqtp", "qwix", "tokamax", "drjax", "einshape",
    "immutabledict", "fire", "termcolor", "six", "jaxtyping", "wadler-lindig", "xprof",
    "transformers", "safetensors", "regex", "tiktoken", "sympy", "mpmath", "ml-collections",
)
INSTALL = (f"pip install --no-deps maxtext=={MAXTEXT_VERSION} {' '.join(MAXTEXT_PACKAGES)} "
           "(Python >= 3.12, jax >= 0.11.1)")

# jaxtron remat policy -> MaxText remat_policy and, for "custom", the tensors it keeps on device.
# MaxText's "none" is no counterpart: its scanned decoder wraps every layer in jax.checkpoint with
# the policy its get_remat_policy returns, None for both "none" and "full", so "none" recomputes
# everything. Keeping every named tensor (the matmul outputs and the attention's output and
# residuals) is the nearest: only the norms and activations are recomputed, a few percent.
_KEEP_ALL = ("query_proj", "key_proj", "value_proj", "context", "attention_out", "out_proj",
             "mlpwi_0", "mlpwi_1", "mlpwo")
REMAT = {
    "none": ("custom", _KEEP_ALL),
    "full": ("full", ()),  # only each layer's input is kept
    "save_dots": ("minimal", ()),  # every projection and MLP matmul output
    "save_qkv_out": ("custom", ("query_proj", "key_proj", "value_proj", "attention_out")),
    "save_attn_out": ("custom", ("attention_out",)),  # attention output, before its projection
    "offload_dots": ("minimal_offloaded", ()),  # the matmul outputs, in pinned host memory
}
_STEP_LINE = re.compile(r"completed step: (\d+), seconds: ([\d.]+), TFLOP/s/device: ([\d.]+), "
                        r"Tokens/s/device: ([\d.]+)")
_PARAMS_LINE = re.compile(r"number parameters: ([\d.]+) billion")
_ERROR_LINE = re.compile(r"^[\w.]*(Error|Exception|Exit)\b")
_PROBE = """import importlib.metadata, importlib.util, json, os
version = importlib.metadata.version("maxtext")
base = os.path.join(importlib.util.find_spec("maxtext").submodule_search_locations[0], "configs")
import jax
print(json.dumps({"version": version, "base": os.path.join(base, "base.yml"),
                  "platform": jax.default_backend(), "devices": jax.device_count()}))"""


class PeerError(Exception):
    """One line saying why the peer could not run."""


def maxtext_args(cfg: Config, devices: int, steps: int, out_dir: str, *,
                 platform: str = "gpu") -> list[str]:
    """MaxText key=value overrides for cfg's model, batch and optimizer on `devices` devices."""
    m, t, o = cfg.model, cfg.train, cfg.optim
    if m.remat not in REMAT:
        raise PeerError(f"model.remat={m.remat} has no MaxText remat_policy; use one of "
                        f"{', '.join(REMAT)}")
    if cfg.mesh.stage > 1:
        raise PeerError("mesh.stage > 1: pipeline parallelism is not mapped onto MaxText's")
    if m.qkv_bias:
        raise PeerError("model.qkv_bias: MaxText's llama2 block has no q/k/v bias")
    if t.batch_size % (devices * t.microbatches):
        raise PeerError(f"train.batch_size={t.batch_size} does not split over {devices} devices "
                        f"x {t.microbatches} microbatches")
    policy, kept = REMAT[m.remat]
    # jaxtron's cudnn kernel is jax's cuDNN SDPA, which MaxText calls as cudnn_flash_jax
    # (cudnn_flash_te needs TransformerEngine); on a CPU only dot_product runs.
    attention = "cudnn_flash_jax" if platform == "gpu" and m.attention != "xla" else "dot_product"
    args = {
        "run_name": "peer", "base_output_directory": out_dir,
        # Llama: RMSNorm, RoPE, GQA, SwiGLU (mlp_activations silu,linear is base.yml's default)
        "decoder_block": "llama2", "base_num_decoder_layers": m.num_layers,
        "base_emb_dim": m.d_model, "base_num_query_heads": m.num_heads,
        "base_num_kv_heads": m.num_kv_heads, "head_dim": m.head_size, "base_mlp_dim": m.mlp_dim,
        "vocab_size": m.vocab_size, "logits_via_embedding": m.tie_embeddings,
        "normalization_layer_epsilon": m.norm_eps, "rope_max_timescale": m.rope_theta,
        "dtype": m.dtype, "weight_dtype": m.param_dtype, "scan_layers": m.scan_layers,
        "remat_policy": policy, "attention": attention, "enable_dropout": False,
        # the same tokens per step: per_device_batch_size is per microbatch
        "per_device_batch_size": t.batch_size // (devices * t.microbatches),
        "gradient_accumulation_steps": t.microbatches, "max_target_length": t.seq_len,
        "ici_data_parallelism": cfg.mesh.data, "ici_fsdp_parallelism": cfg.mesh.fsdp,
        "ici_tensor_parallelism": cfg.mesh.tensor,
        "dataset_type": "synthetic", "enable_checkpointing": False, "eval_interval": -1,
        "steps": steps,
        "opt_type": "adamw", "learning_rate": o.lr, "adam_b1": o.b1, "adam_b2": o.b2,
        "adam_eps": o.eps, "adam_weight_decay": o.weight_decay,
        "gradient_clipping_threshold": o.clip_norm,
        "warmup_steps_fraction": min(1.0, o.warmup_steps / max(steps, 1)),
        "learning_rate_final_fraction": o.min_lr_ratio,
    }
    if m.rope_scaling_factor > 0:
        # MaxText's llama3.1 RoPE fixes factor 8, 1, 4 and 8192: other factors give other
        # frequencies at the same cost, which is all a speed comparison needs
        args.update(rope_type="llama3.1", rope_use_scale=True)
    if platform == "gpu":
        # hardware=cpu would mean a multi-process XPK CPU job (jax.distributed.initialize from
        # its environment); on one CPU process base.yml's default runs the plain path
        args["hardware"] = "gpu"
    args.update({name: "device" for name in kept})
    return [f"{key}={_value(value)}" for key, value in args.items()]


def _value(value) -> str:
    """A MaxText command-line value: its YAML reading of true/false and numbers."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def parse_steps(log: str, warmup: int) -> dict:
    """Step time median and spread, and MaxText's TFLOP/s/device, of the steps after `warmup`.

    Step 0 is dropped as well: MaxText compiles before its loop and times dispatch to dispatch,
    so step 0's time is its dispatch alone, step 1 absorbs step 0's run and step 2 comes out
    short (hence warmup >= 2: on CPU the spread is ~8% with 2, ~100% with 1).
    """
    rows = [(int(s), float(sec), float(tf)) for s, sec, tf, _ in _STEP_LINE.findall(log)]
    timed = [row for row in rows if row[0] > warmup]
    if not timed:
        raise PeerError(f"MaxText logged {len(rows)} steps, none after step 0 and {warmup} "
                        "warmup steps")
    times = [sec for _, sec, _ in timed]
    median = statistics.median(times)
    return {"step_time": median, "step_time_spread": (max(times) - min(times)) / median,
            "tflops_per_device": statistics.median(tf for _, _, tf in timed),
            "steps_timed": len(timed)}


# the overrides that move MaxText's numbers, reported with them
_SETTINGS = ("remat_policy", "attention", "per_device_batch_size", "gradient_accumulation_steps",
             "max_target_length", "dtype", "weight_dtype", "scan_layers", "ici_data_parallelism",
             "ici_fsdp_parallelism", "ici_tensor_parallelism")


def run_maxtext(cfg: Config, devices: int, steps: int, warmup: int, timeout_s: float,
                python: str | None = None) -> dict:
    """MaxText's tokens/s on cfg's model and batch: `steps` timed after step 0 and `warmup`."""
    python = python or sys.executable
    maxtext_args(cfg, devices, steps, "")  # refuses what MaxText has no counterpart for, first
    env = dict(os.environ)
    found = _probe(python, env, timeout_s)
    if found["platform"] == "gpu":
        if found["devices"] < devices:
            raise PeerError(f"MaxText sees {found['devices']} GPUs, the row needs {devices}")
        if "CUDA_VISIBLE_DEVICES" not in env:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(devices)))
        env.setdefault(xla_flags.MEM_FRACTION_VARS[0], str(cfg.xla.mem_fraction))
    # The same XLA flags as jaxtron's run (its gpu preset is MaxText's GPU recipes' flags), and
    # exactly `devices` CPU devices where the CPU runs it (the tests simulate eight).
    preset = "none"
    if found["platform"] == "gpu":
        preset = "gpu" if cfg.xla.preset == "auto" else cfg.xla.preset
    flags = [f for f in xla_flags.for_config(dataclasses.replace(cfg.xla, preset=preset),
                                             env.get("XLA_FLAGS", ""))
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={devices}"])
    with tempfile.TemporaryDirectory(prefix="jaxtron_maxtext_") as out_dir:
        args = maxtext_args(cfg, devices, warmup + 1 + steps, out_dir, platform=found["platform"])
        log = _run([python, "-m", MAXTEXT_MODULE, found["base"], *args], env, timeout_s)
        num_params = _num_params(Path(out_dir), log)
    result = parse_steps(log, warmup)
    tokens = cfg.train.batch_size * cfg.train.seq_len
    settings = dict(arg.split("=", 1) for arg in args if arg.split("=", 1)[0] in _SETTINGS)
    policy, kept = REMAT[cfg.model.remat]
    settings["remat_policy"] = f"{policy} (on device: {' '.join(kept)})" if kept else policy
    return {"peer": f"maxtext {found['version']}", "tokens_per_sec": tokens / result["step_time"],
            **result, "num_params": num_params,
            "settings": {**settings, "devices": devices, "platform": found["platform"],
                         "xla_flags": " ".join(flags)}}



def _probe(python: str, env: dict, timeout_s: float) -> dict:
    """MaxText's version and base.yml, and the platform and device count jax finds, in `python`."""
    try:
        done = subprocess.run([python, "-c", _PROBE], env=env, capture_output=True, text=True,
                              timeout=timeout_s)
    except FileNotFoundError:
        raise PeerError(f"no Python at {python} to run MaxText in") from None
    except subprocess.TimeoutExpired:
        raise PeerError(f"{python} did not start jax within {timeout_s:.0f} s") from None
    if "PackageNotFoundError" in done.stderr:
        raise PeerError(f"MaxText is not installed in {python}: {INSTALL}")
    if done.returncode:
        raise PeerError(f"{python} could not start jax: {_last_error(done.stderr)}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def _run(cmd: list[str], env: dict, timeout_s: float) -> str:
    """MaxText's stdout and stderr; a PeerError if it ran too long, out of memory or failed."""
    # its own process group, so that a timeout ends whatever MaxText started too
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise PeerError(f"MaxText did not finish within {timeout_s:.0f} s") from None
    if proc.returncode == 0:
        return log
    if "RESOURCE_EXHAUSTED" in log or "out of memory" in log.lower():
        oom = [line for line in log.splitlines()
               if "RESOURCE_EXHAUSTED" in line or "out of memory" in line.lower()]
        raise PeerError(f"MaxText ran out of memory: {oom[-1].strip()[:300]}")
    error = _last_error(log)
    if error.startswith("ModuleNotFoundError"):
        error += f"; install what MaxText's train step imports: {INSTALL}"
    raise PeerError(f"MaxText failed (exit status {proc.returncode}): {error}")


def _last_error(log: str) -> str:
    """The last exception line of a log, else its last line."""
    lines = [line.strip() for line in log.splitlines() if line.strip()] or ["(no output)"]
    errors = [line for line in lines if _ERROR_LINE.match(line)]
    return (errors or lines)[-1][:300]


def _num_params(out_dir: Path, log: str) -> int | None:
    """MaxText's parameter count: exact from its TensorBoard text summary, else the log's
    billions (three decimals, too coarse for small models)."""
    try:
        from tensorboardX.proto import event_pb2

        for path in out_dir.glob("peer/tensorboard/peer/events.out.tfevents.*"):
            data, at = path.read_bytes(), 0
            while at + 12 <= len(data):  # TFRecords: length (8 bytes), its crc, data, data's crc
                size = int.from_bytes(data[at:at + 8], "little")
                event = event_pb2.Event.FromString(data[at + 12:at + 12 + size])
                at += size + 16
                for value in event.summary.value:
                    if value.tag == "num_model_parameters/text_summary":
                        return int(value.tensor.string_val[0])
    except Exception:  # noqa: BLE001 - a format change costs only the exact count
        pass
    billions = _PARAMS_LINE.findall(log)
    return round(float(billions[-1]) * 1e9) if billions else None
