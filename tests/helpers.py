"""What several test modules share: the checkout's paths, the tiny preset quiet, launch.py as a
process and the one-line refusal check (every command's tests); and what one module's tests
built and others build on: prepared datasets, the small run and its TensorBoard scalars, the
Hugging Face parity models, two-process runs, the sharding-parity gradients, runs stopped by a
signal and their processes, byte-level BPE tokenizer files, the pipelines' parity runs.

Test modules import it as `from helpers import ...` (pytest puts tests/ on the path, as for
conftest.py); none imports another test module or conftest.py (tests/test_layout.py checks).
jax, jaxtron and the other heavy libraries are imported where they are used, so that a module
that takes only assert_refused does not pay for them; HF_CASES, which holds transformers' model
classes, is made on its first import. conftest.py has pytest rewrite this module's asserts as it
does a test module's."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import shutil
import socket
import struct
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from jaxtron import config
    from jaxtron.config import DataConfig, ModelConfig

# ------------------------------------------------------------------------------ every command
ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "tiny.yaml"
QUIET = ("run.tensorboard=false", "run.progress=lines")  # no event files, a line per log step


def tiny_config(*overrides: str, run_dir: str | Path | None = None):
    """configs/tiny.yaml with `overrides`, quiet (QUIET) and, given one, its own run.dir."""
    from jaxtron import config

    where = (f"run.dir={run_dir}",) if run_dir is not None else ()
    return config.load([TINY], [*QUIET, *where, *overrides])


def run_launch(*args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    """`python launch.py ARGS` in the repository root, its output captured as text."""
    return subprocess.run([sys.executable, str(ROOT / "launch.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout, check=False, **kwargs)


def assert_refused(status: int, err: str, *names: str, code: int = 2) -> None:
    """A refusal as every command makes one: exit status `code` (2: bad input), one line on
    stderr, and in it each of `names` (the key, the flag, the path, the value to use instead)
    whatever the words around them, so that a reworded message keeps its tests."""
    assert status == code, err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    missing = [name for name in names if name.strip() not in lines[0]]
    assert not missing, f"{missing} not named in: {lines[0]}"


# ------------------------------------------------------------ prepared datasets (test_data.py)
def write_dataset(root: Path, splits: dict[str, list], tokenizer: Path, dtype: str = "uint16",
                  shards: int = 2) -> str:
    """A dataset laid out as docs/data_format.md says tools/prepare_data.py writes it."""
    import sentencepiece as spm
    from array_record.python.array_record_module import ArrayRecordWriter

    root.mkdir(parents=True)
    shutil.copy(tokenizer, root / "tokenizer.model")
    sp = spm.SentencePieceProcessor(model_file=str(tokenizer))
    described = {}
    for split, docs in splits.items():
        names = [f"{split}-00000-{part:05d}.arrayrecord" for part in range(shards if docs else 0)]
        for part, name in enumerate(names):
            writer = ArrayRecordWriter(str(root / name), "group_size:1")
            for doc in docs[part::shards]:
                writer.write(np.asarray(doc, np.dtype(dtype).newbyteorder("<")).tobytes())
            writer.close()
        described[split] = {"shards": names, "documents": len(docs),
                            "tokens": int(sum(len(d) for d in docs))}
    tok = {"file": "tokenizer.model", "sha256": hashlib.sha256(tokenizer.read_bytes()).hexdigest(),
           "vocab_size": sp.get_piece_size(), "bos_id": sp.bos_id(), "eos_id": sp.eos_id()}
    manifest = {"format": "jaxtron.tokens.v1", "tokenizer": tok, "dtype": dtype,
                "val_fraction": 0.01, "splits": described, "sources": [],
                "bad_input": {"count": 0, "examples": []}}
    (root / "manifest.json").write_text(json.dumps(manifest))
    return str(root)


def random_docs(seed: int, n: int, max_len: int, low: int, high: int) -> list[np.ndarray]:
    """Random documents with tokens in [low, high): the range tells which dataset/split it is."""
    rng = np.random.default_rng(seed)
    return [rng.integers(low, high, rng.integers(1, max_len)).astype(np.int32) for _ in range(n)]


# ------------------------------------------------------------ a small run (test_goodput.py)
SMALL = ["model.num_layers=2", "model.d_model=64", "model.num_heads=2", "model.num_kv_heads=1",
         "model.mlp_dim=128", "train.seq_len=32", "train.batch_size=8", "train.log_every=1",
         "optim.warmup_steps=1", "run.progress=lines"]


def tensorboard_scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """tag -> [(step, value)] as TensorBoard shows run_dir/tensorboard: every event file, oldest
    first, where a SessionLog.START at step s (a resumed attempt's purge_step) hides what was
    logged before it at steps >= s (TFRecord framing: length u64, its crc u32, the Event, its crc
    u32)."""
    from tensorboardX.proto import event_pb2

    scalars: dict[str, list[tuple[int, float]]] = {}
    for path in sorted((run_dir / "tensorboard").glob("events.out.tfevents.*")):
        data, at = path.read_bytes(), 0
        while at < len(data):
            (size,) = struct.unpack("<Q", data[at:at + 8])
            event = event_pb2.Event.FromString(data[at + 12:at + 12 + size])
            at += 12 + size + 4
            if event.session_log.status == event_pb2.SessionLog.START:
                scalars = {tag: [(s, v) for s, v in points if s < event.step]
                           for tag, points in scalars.items()}
            for value in event.summary.value:
                scalars.setdefault(value.tag, []).append((event.step, value.simple_value))
    return scalars


# ------------------------------------------------- Hugging Face parity (test_hf_parity.py)
# Max |logit difference| allowed. Both sides compute in float32 with logits of size ~5-10; the
# measured gaps are ~1e-5 (float32 summation order), while a real bug (wrong RoPE scaling, a
# swapped norm) moves logits by ~1e-1 or more.
HF_TOL = 1e-4

HF_TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               rms_norm_eps=1e-5, attn_implementation="eager")
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 32,
               "rope_theta": 10000.0}


@functools.cache
def _hf_cases() -> dict:
    """HF_CASES: made on first use, as it imports transformers' model classes (seconds)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
    )

    # name: (HF classes, config overrides, sequence length)
    return {
        "llama2": (LlamaConfig, LlamaForCausalLM, 24, dict(
            num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})),
        # head_dim 16 (not hidden/heads = 8) puts one RoPE wavelength (~20) inside the llama3
        # smoothing band (8..32) and makes q_proj [128, 64]; T=64 > 32 so the frequency scaling
        # changes logits.
        "llama3": (LlamaConfig, LlamaForCausalLM, 64, dict(
            num_attention_heads=8, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
            rope_parameters=LLAMA3_ROPE)),
        "qwen2": (Qwen2Config, Qwen2ForCausalLM, 24, dict(
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)),
        # MistralConfig defaults to sliding_window=4096, which the converter refuses; Mistral
        # v0.2+ checkpoints set it to null. rope_theta 1e6 as they do: the other cases all use
        # the 1e4 default, so only this one sees a rope_theta that the converter failed to carry
        # over.
        "mistral": (MistralConfig, MistralForCausalLM, 24, dict(
            num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False,
            sliding_window=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})),
    }


def __getattr__(name: str):
    """`from helpers import HF_CASES`: the cases, made on first import (_hf_cases)."""
    if name == "HF_CASES":
        return _hf_cases()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def hf_case(name: str) -> tuple[torch.nn.Module, ModelConfig, dict, dict]:
    """HF model with random weights, our config, the HF tensors and our converted params."""
    import torch

    from jaxtron.config import ModelConfig
    from jaxtron.hf import config_json
    from jaxtron.hf import mapping as hf_mapping

    config_cls, model_cls, _, overrides = _hf_cases()[name]
    torch.manual_seed(0)
    hf_model = model_cls(config_cls(**HF_TINY, **overrides)).eval()
    with torch.no_grad():
        for pname, p in hf_model.named_parameters():  # tied weights are listed once
            if pname.endswith("norm.weight"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    hf_tensors = {k: v.numpy() for k, v in hf_model.state_dict().items()}
    overrides = config_json.config_from_hf(hf_model.config.to_dict())
    cfg = ModelConfig(**overrides, dtype="float32", param_dtype="float32")
    return hf_model, cfg, hf_tensors, hf_mapping.hf_to_params(hf_tensors, cfg)


def saved_and_read(model: torch.nn.Module, path: Path) -> tuple[ModelConfig, dict]:
    """`model` saved by transformers to `path`, read back by jaxtron: (config, params)."""
    from jaxtron import hf

    model.save_pretrained(path)
    return hf.from_pretrained(path)


def logit_diff(model: torch.nn.Module, cfg: ModelConfig, params: dict, tokens: np.ndarray,
               positions: np.ndarray) -> float:
    """The largest |our logit - transformers'| on one unpacked batch (printed with the scale)."""
    from jaxtron import hf

    ref = hf_logits(model, tokens, positions)
    diff = float(np.abs(hf.logits(cfg, params, tokens) - ref).max())
    print(f"max |logit diff| {diff:.2e} (logit scale {np.abs(ref).max():.1f})")
    return diff


def assert_greedy_as_transformers(model: torch.nn.Module, cfg: ModelConfig, params: dict,
                                  prompt: list[int], new: int) -> None:
    """Our greedy continuation of `prompt` (`new` tokens, no end token) is transformers'."""
    import torch

    from jaxtron.model import generate as gen

    with torch.no_grad():
        want = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=new,
                              eos_token_id=None, pad_token_id=0)[0, len(prompt):].tolist()
    assert gen.generate(cfg, params, prompt, new) == want


def assert_config_refused(hf_config: dict, match: str) -> None:
    """config.json's settings are refused in one line matching `match`."""
    import pytest

    from jaxtron.hf import config_json

    with pytest.raises(ValueError, match=match) as err:
        config_json.config_from_hf(hf_config)
    assert "\n" not in str(err.value)


def hf_logits(model: torch.nn.Module, tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """HF logits for one unpacked batch."""
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(tokens).long(),
                    position_ids=torch.from_numpy(positions).long())
    return out.logits.numpy()


def assert_exported_as_read(model: torch.nn.Module, path: Path, cfg: ModelConfig, params: dict,
                            out: Path, model_type: str, tokens: np.ndarray,
                            positions: np.ndarray) -> None:
    """`params` read from transformers' directory `path`, written back as `model_type` to `out`:
    the same tensor names, dtypes and values; transformers loads it as that architecture with
    no missing or unexpected weight, its config reads back the same, and its logits are
    `model`'s."""
    import json  # noqa: PLC0415

    from transformers import AutoModelForCausalLM  # noqa: PLC0415

    from jaxtron import hf  # noqa: PLC0415
    from jaxtron.hf import config_json  # noqa: PLC0415

    source = hf.read_tensors(path)
    written = hf.read_tensors(hf.save_pretrained(cfg, params, out, model_type))
    assert sorted(written) == sorted(source)
    for name, value in source.items():
        assert written[name].dtype == value.dtype and np.array_equal(written[name], value), name
    back, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert type(back).__name__ == hf.ARCHITECTURES[model_type]
    read = lambda p: config_json.config_from_hf(json.loads((p / "config.json").read_text()))
    assert read(out) == read(path)
    assert np.abs(hf_logits(back.eval(), tokens, positions)
                  - hf_logits(model, tokens, positions)).max() < HF_TOL


def hf_inputs(seq_len: int, batch: int = 2, seed: int = 0):
    tokens = np.random.default_rng(seed).integers(0, HF_TINY["vocab_size"], (batch, seq_len),
                                                  np.int32)
    positions = np.tile(np.arange(seq_len, dtype=np.int32), (batch, 1))
    return tokens, positions, np.ones_like(tokens)


# ---------------------------------------------------- two-process runs (test_multiprocess.py)
PROCESSES = 2
# decay_steps fixed: the learning rate of a step does not depend on train.steps, so a run of 4
# steps resumed to 6 follows the same schedule as a straight 6-step run.
MULTIPROCESS_OVERRIDES = ["train.log_every=1", "train.seq_len=64", "train.eval_every=0",
                          "checkpoint.every=2", "optim.warmup_steps=2", "optim.decay_steps=8",
                          "run.tensorboard=false", "run.progress=lines"]
# fp32: the cross-process all-reduce sums in another order than the in-process one
MULTIPROCESS_RTOL = 1e-5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def multiprocess_env() -> dict:
    """This environment with 4 CPU devices per process and nothing that suggests a cluster."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SLURM_", "OMPI_", "JAX_COORDINATOR"))}
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env.update(XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu", JAX_NUM_CPU_DEVICES="4",
               JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo", PYTHONUNBUFFERED="1")
    return env


def start_processes(run_dir: Path, logs: Path, name: str, *overrides: str,
                    pythonpath: dict[int, Path] | None = None,
                    own: dict[int, list[str]] | None = None) -> list[subprocess.Popen]:
    """Both processes of one run; their output goes to logs/<name>-<i>.txt. `pythonpath` gives
    a process a directory to import first (a sitecustomize.py that breaks something there),
    `own` a process overrides of its own."""
    port = free_port()
    procs = []
    for i in range(PROCESSES):
        env = multiprocess_env()
        if i in (pythonpath or {}):
            env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(pythonpath[i]),
                                                              env.get("PYTHONPATH")]))
        log = (logs / f"{name}-{i}.txt").open("w")
        procs.append(subprocess.Popen(
            [sys.executable, str(ROOT / "launch.py"), "--coordinator", f"127.0.0.1:{port}",
             "--num-processes", str(PROCESSES), "--process-id", str(i), *MULTIPROCESS_OVERRIDES,
             f"run.dir={run_dir}", *overrides, *(own or {}).get(i, [])],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def wait_processes(procs: list[subprocess.Popen], timeout: float = 400) -> list[int]:
    deadline = time.monotonic() + timeout
    return [p.wait(timeout=max(deadline - time.monotonic(), 1)) for p in procs]


def metrics_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ---------------------------------------------------- sharding parity (test_parallel.py)
PARALLEL_STEPS = 5


def parallel_config(tmp_path, mesh: dict, *extra: str,
                    inputs: DataConfig | None = None) -> config.Config:
    cfg = tiny_config(*(f"mesh.{axis}={size}" for axis, size in mesh.items()),
                      f"train.steps={PARALLEL_STEPS}", "train.log_every=1", "train.batch_size=16",
                      "train.seq_len=128", "optim.warmup_steps=0", *extra,
                      run_dir=tmp_path / "run")
    return cfg if inputs is None else dataclasses.replace(cfg, data=inputs)


def initial_gradients(tmp_path, devices, mesh: dict, *extra: str,
                      inputs: DataConfig | None = None) -> tuple[float, dict]:
    """Loss and gradients at the initial weights on the first training batch."""
    import jax

    from jaxtron import data, parallel
    from jaxtron.step import empty_histories, global_batch, loss_and_grads
    from jaxtron.step.optim import make_optimizer
    from jaxtron.step.state import init_state, make_plan

    cfg = parallel_config(tmp_path, mesh, *extra, inputs=inputs)
    tx = make_optimizer(cfg)
    plan = make_plan(cfg, tx, len(devices))
    mesh_ = parallel.make_mesh(cfg.mesh, devices)
    grad_fn = jax.jit(lambda params, batch: loss_and_grads(
        params, plan.graphdef, batch, plan.accumulation, plan.pipe,
        histories=empty_histories(plan.histories)))
    with jax.set_mesh(mesh_):
        batch = global_batch(next(data.make_batches(cfg.data, cfg.train, cfg.model.vocab_size)),
                             mesh_)
        loss, grads, _ = grad_fn(init_state(cfg, plan, tx, mesh_)["params"], batch=batch)
    return float(loss), jax.device_get(grads)


# ----------------------------------------------- runs stopped by a signal (test_preemption.py)
def run_until(cmd: list[str], run_dir: Path, step: int, sig: int, saved: int = 0) -> int:
    """Start `cmd`, send `sig` once metrics.jsonl has reached `step` (and checkpoint `saved`, which
    is written in the background, is on disk); return the exit status."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300
        metrics, checkpoint = run_dir / "metrics.jsonl", run_dir / "checkpoints" / str(saved)
        while time.time() < deadline and proc.poll() is None:
            if metrics.exists() and (not saved or checkpoint.is_dir()) and any(
                    json.loads(line)["step"] >= step  # whole lines: the last may be mid-write
                    for line in metrics.read_text().split("\n")[:-1] if line):
                proc.send_signal(sig)
                break
            time.sleep(0.02)
        return proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=60)  # reaped: no zombie, and its files are closed before the next run


def saved_steps(run_dir: Path) -> list[int]:
    return sorted(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())


def child_pids(pid: int) -> list[int]:
    """The processes whose parent is `pid` (Linux /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def task_children(pid: int) -> list[int]:
    """The children of `pid`'s threads, as the kernel lists them (/proc/PID/task/TID/children): a
    second way to child_pids' scan of every process."""
    found = []
    for children in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            found.extend(map(int, children.read_text().split()))
        except OSError:  # gone meanwhile
            continue
    return found


def alive_pids(pids: list[int]) -> list[int]:
    """Those of `pids` still running (not gone, not a zombie waiting to be reaped)."""
    alive = []
    for pid in pids:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if state != "Z":
            alive.append(pid)
    return alive


# ------------------------------------------------ byte-level BPE files (test_tokenizer.py)
STDLIB = Path(sysconfig.get_paths()["stdlib"])
BPE_LINES = [line for name in ("textwrap.py", "string.py")
             for line in (STDLIB / name).read_text().split("\n") if line][:600]
BPE_LEARNED = 500  # byte-level BPE pieces before the special tokens
LLAMA3 = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]


def build_bpe(folder: Path, specials: list[str], config: dict | None = None,
              bos_template: str | None = None) -> Path:
    """folder/tokenizer.json: byte-level BPE trained on BPE_LINES, `specials` added after it, the
    template's token prepended by the post-processor as Llama's tokenizer.json does, and a
    tokenizer_config.json beside it when `config` is given."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, processors, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(BPE_LINES, trainers.BpeTrainer(
        vocab_size=BPE_LEARNED, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    assert hf.get_vocab_size() == BPE_LEARNED
    hf.add_special_tokens(specials)
    if bos_template:
        hf.post_processor = processors.TemplateProcessing(
            single=f"{bos_template} $A", special_tokens=[(bos_template,
                                                          hf.token_to_id(bos_template))])
    folder.mkdir(parents=True, exist_ok=True)
    hf.save(str(folder / "tokenizer.json"))
    if config is not None:
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return folder / "tokenizer.json"


def ids_of(path: Path, *tokens: str) -> list[int]:
    """The ids the tokenizers library gives these tokens in the file's vocabulary."""
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_file(str(path))
    return [hf.token_to_id(t) for t in tokens]


# ---------------------------------------------------------------- cuDNN's attention kernels in jnp
# Stand-ins with cuDNN's semantics for the context-parallel split's kernels on CPU
# (jaxtron/ops/context_attention.py: cudnn_forward, cudnn_backward).
def _attention_mask(q_len, kv_len, causal, t, s):
    import jax.numpy as jnp  # noqa: PLC0415

    allowed = jnp.ones((1, t, s), bool)
    if causal:
        allowed &= jnp.tril(jnp.ones((t, s), bool))[None]
    if q_len is not None:
        allowed &= (jnp.arange(t)[None, :, None] < q_len[:, None, None]) \
            & (jnp.arange(s)[None, None, :] < kv_len[:, None, None])
    return allowed[:, None]  # [B, 1, T, S]


def _attention_scores(q, k, bias, allowed):
    """[B, N, T, S] scaled scores of grouped-query heads, -inf where not allowed."""
    import jax.numpy as jnp  # noqa: PLC0415

    k_rep = jnp.repeat(k, q.shape[2] // k.shape[2], axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k_rep) * q.shape[-1] ** -0.5
    s = s if bias is None else s + bias
    return jnp.where(allowed, s, -jnp.inf), k_rep


def fake_forward(q, k, v, bias, q_len, kv_len, causal):
    """cuDNN's forward semantics in jnp: top-left causal, padding by lengths, statistics the
    natural log-sum-exp of the scaled scores [B, N, T]; rows with no key give 0."""
    import jax  # noqa: PLC0415 (jax only where a helper needs it)
    import jax.numpy as jnp  # noqa: PLC0415

    s, _ = _attention_scores(q, k, bias, _attention_mask(q_len, kv_len, causal, q.shape[1], k.shape[1]))
    lse = jax.nn.logsumexp(s, axis=-1)
    p = jnp.where(jnp.isfinite(lse)[..., None], jnp.exp(s - lse[..., None]), 0)
    v_rep = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2)
    return jnp.einsum("bnts,bsnh->btnh", p, v_rep), lse


def fake_backward(q, k, v, bias, q_len, kv_len, causal, out, lse, d_out):
    """cuDNN's backward from a given output and statistics (flash attention's identities)."""
    import jax.numpy as jnp  # noqa: PLC0415

    s, k_rep = _attention_scores(q, k, bias, _attention_mask(q_len, kv_len, causal, q.shape[1], k.shape[1]))
    p = jnp.where(jnp.isfinite(s), jnp.exp(s - lse[..., None]), 0)
    v_rep = jnp.repeat(v, q.shape[2] // v.shape[2], axis=2)
    d_v = jnp.einsum("bnts,btnh->bsnh", p, d_out)
    d_p = jnp.einsum("btnh,bsnh->bnts", d_out, v_rep)
    d_s = p * (d_p - jnp.einsum("btnh,btnh->bnt", d_out, out)[..., None]) * q.shape[-1] ** -0.5
    group = lambda g: g.reshape(*g.shape[:2], k.shape[2], -1, g.shape[-1]).sum(3)
    return (jnp.einsum("bnts,bsnh->btnh", d_s, k_rep), group(jnp.einsum("bnts,btnh->bsnh", d_s, q)),
            group(d_v))


def run_attention(kernel, q, k, v, segments, cotangent):
    """(kernel's output, its gradients with respect to q, k and v under `cotangent`)."""
    import jax  # noqa: PLC0415 (jax only where a helper needs it)
    import jax.numpy as jnp  # noqa: PLC0415

    loss = lambda q, k, v: jnp.sum(kernel(q, k, v, segments) * cotangent)
    return (kernel(q, k, v, segments), *jax.grad(loss, argnums=(0, 1, 2))(q, k, v))


# ------------------------------------------- pipeline parity (test_pipeline, test_one_f_one_b)
PIPE_MODEL = ["model.num_layers=8", "model.d_model=64", "model.num_heads=4", "model.num_kv_heads=2",
         "model.mlp_dim=128", "model.vocab_size=256", "model.dtype=float32"]
PIPE_TRAIN = ["train.batch_size=16", "train.seq_len=32", "train.microbatches=4", "train.steps=3",
         "optim.warmup_steps=1", "optim.lr=1e-2"]
PIPE_STEPS = 3


def pipeline_cfg(*overrides: str) -> config.Config:
    """tests/test_pipeline.py's small 8-layer model and batch, with `overrides`."""
    from jaxtron import config

    return config.load(["configs/tiny.yaml"], [*PIPE_MODEL, *PIPE_TRAIN, *overrides])


def pipeline_batch(cfg: config.Config) -> dict:
    """A fixed random batch, two packed documents per row (segments 1 and 2), the last 3 tokens
    padding; every step trains on it, so the loss must fall."""
    rng = np.random.default_rng(0)
    b, t = cfg.train.batch_size, cfg.train.seq_len
    tokens = rng.integers(1, cfg.model.vocab_size, (b, t + 1), dtype=np.int32)
    cut, pad = t // 3, t - 3
    segments = np.select([np.arange(t) < cut, np.arange(t) < pad], [1, 2], 0)
    positions = np.where(np.arange(t) < cut, np.arange(t), np.arange(t) - cut)
    ones = np.ones((b, 1), np.int32)
    return {"tokens": tokens[:, :-1], "targets": tokens[:, 1:],
            "segment_ids": (segments * ones).astype(np.int32),
            "positions": (positions * ones).astype(np.int32)}


def pipeline_run(cfg: config.Config, num_devices: int, apart: bool = False
                 ) -> tuple[np.ndarray, dict, dict]:
    """Losses of PIPE_STEPS train steps, and the gradients (in model layer order) at the initial
    and at the last step's parameters. `apart`: the step and the gradient as two programs (two
    1F1B loops side by side in one let a CPU device enter their collectives in another order
    than its peers; on GPUs the order is the program's); else one, sharing the gradient."""
    import jax

    from jaxtron import parallel
    from jaxtron.parallel import pipeline
    from jaxtron.step import BATCH_KEYS, compile_step, loss_and_grads
    from jaxtron.step.optim import make_optimizer
    from jaxtron.step.state import init_state, make_plan

    devices = jax.devices()[:num_devices]
    tx = make_optimizer(cfg)
    plan = make_plan(cfg, tx, num_devices)
    mesh = parallel.make_mesh(cfg.mesh, devices)
    sharding = jax.sharding.NamedSharding(mesh, parallel.batch_spec())
    step_fn = compile_step(cfg, plan, tx, mesh)
    grad_fn = jax.jit(functools.partial(loss_and_grads, graphdef=plan.graphdef,
                                        microbatches=plan.accumulation, pipe=plan.pipe))

    def one_program(state, batch):  # XLA shares the gradient with the step
        return step_fn(state, batch), grad_fn(state["params"], batch=batch)[1]

    def two_programs(state, batch):
        grads = jax.block_until_ready(grad_fn(state["params"], batch=batch)[1])
        return jax.block_until_ready(step_fn(state, batch)), grads

    run = two_programs if apart else jax.jit(one_program)
    with jax.set_mesh(mesh):
        state = init_state(cfg, plan, tx, mesh)
        local = pipeline_batch(cfg)
        batch = {k: jax.device_put(local[k], sharding) for k in BATCH_KEYS}
        losses, grads = [], []
        for _ in range(PIPE_STEPS + 1):
            (new_state, metrics), g = run(state, batch)
            losses.append(float(metrics["loss"]))
            grads.append(g)
            state = new_state
    first, last = jax.device_get((grads[0], grads[-1]))
    model_order = np.arange(cfg.model.num_layers)
    for g in (first, last):
        g["layers"] = pipeline.reorder(g["layers"], plan.layer_order, model_order)
    return np.array(losses), first, last


def assert_close_grads(grads: dict, ref: dict, rtol: float) -> None:
    """Each gradient array within `rtol` of the reference, relative to its norm."""
    import jax

    for path, a, b in zip(jax.tree_util.tree_flatten_with_path(grads)[0],
                          jax.tree.leaves(grads), jax.tree.leaves(ref)):
        err = np.linalg.norm(a - b) / np.linalg.norm(b)
        assert err < rtol, f"{jax.tree_util.keystr(path[0])}: relative error {err:.2e}"


@functools.cache
def pipeline_reference(remat: str, *overrides: str) -> tuple[np.ndarray, dict, dict]:
    """One device's pipeline_run, once per session for each remat policy and overrides."""
    return pipeline_run(pipeline_cfg("mesh.fsdp=1", f"model.remat={remat}", *overrides), 1)
