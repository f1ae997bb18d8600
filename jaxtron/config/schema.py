"""Typed, frozen run configuration: YAML presets + gin-style `section.key=value` overrides.
OmegaConf merges and converts types against the dataclass schema (presets.py reads the files);
here: closest-name suggestions for unknown keys, range checks, one-line `ConfigError`s."""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from omegaconf import OmegaConf
from omegaconf import errors as oc_errors

from jaxtron.config import presets
from jaxtron.config.errors import ConfigError  # every module imports it from here
from jaxtron.config.model import (  # noqa: F401 - the model section, re-exported
    FLAT_MOE,
    MLAConfig,
    ModelConfig,
    MoEConfig,
    model_config,
    nested,
)

DTYPES = ("float32", "bfloat16", "float16")
OPTIMIZERS = ("adamw", "muon")
SCHEDULES = ("cosine", "wsd", "constant")
COOLDOWNS = ("linear", "cosine", "sqrt")
MUON_LAYOUTS = ("spread", "gathered", "sharded")
SOURCES = ("stdlib", "arrayrecord")  # data.source: the built-in corpus, or prepared datasets
_KINDS = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


@dataclass(frozen=True)
class MeshConfig:
    """Device counts per mesh axis; one of them may be -1 ("all remaining devices")."""

    data: int = 1
    fsdp: int = -1
    tensor: int = 1
    stage: int = 1
    expert: int = 1  # splits the experts (model.moe.num_experts); the batch is split over it too
    # splits each sequence (context parallelism, jaxtron/parallel/context.py); weights are split
    # over it too (ZeRO-3), the batch is not
    context: int = 1


@dataclass(frozen=True)
class DatasetEntry:
    """One prepared dataset (a directory made by jaxtron prepare-data) and its mixture weight."""

    path: str = ""
    weight: float = 1.0


@dataclass(frozen=True)
class DataConfig:
    # "stdlib": the Python standard library's sources; "arrayrecord": mixture
    source: str = "stdlib"
    mixture: list[DatasetEntry] = field(default_factory=list)  # source=arrayrecord: the datasets
    tokenizer: str = ""  # .model, HF tokenizer.json, or a dir with one; "" trains a .model, cached
    cache_dir: str = ""  # "" -> $JAXTRON_CACHE or ~/.cache/jaxtron
    workers: int = 0  # Grain worker processes that prepare batches ahead; 0: in the main process


@dataclass(frozen=True)
class TrainConfig:
    steps: int = 200
    batch_size: int = 16  # global, in sequences
    seq_len: int = 256
    # batch_size is split into this many microbatches: run one after another (gradient
    # accumulation), or with mesh.stage > 1 flowing through the pipeline stages; auto (read as 0)
    microbatches: int = 1
    seed: int = 0
    log_every: int = 10
    eval_every: int = 0  # steps between evaluations on the held-out split; 0: never
    eval_batches: int = 4  # batches (of batch_size sequences) per evaluation
    on_nonfinite: str = "skip"  # a NaN/inf loss or gradient: "skip" the update, or "stop" the run
    max_nonfinite_skips: int = 10  # with "skip": stop after this many in a row
    # the LM head and loss run over chunks of this many positions, so that the float32 logits
    # [batch, seq, vocab] never exist whole (same loss and gradient); 0: one chunk
    loss_chunk: int = 1024


# the schedules whose ticks run the loss and the backward themselves (parallel/one_f_one_b.py)
EXPLICIT_SCHEDULES = ("1f1b", "interleaved_1f1b", "zb_h1")


@dataclass(frozen=True)
class PipelineConfig:
    """How microbatches flow through the mesh.stage pipeline stages (see docs/parallelism.md)."""

    # gpipe | circular (`repeats` layer groups per stage) | 1f1b | interleaved_1f1b (repeats too,
    # 1 included) | zb_h1 (1F1B with the weight gradients filling the bubble). Whatever M, 1f1b
    # keeps S microbatches' activations per stage (half_ticks), interleaved_1f1b and zb_h1
    # (R+1)*S - 1 items of one repeat's layers (one_f_one_b)
    schedule: str = "gpipe"
    repeats: int = 1  # circular: layer groups per stage; bubble (S-1)/(repeats*M+S-1)
    passes: int = 1  # microbatches go through the pipeline in this many sequential passes
    # (gradient accumulation around the pipeline): activation memory ~ microbatches / passes
    # The stage gradient's float32 sum over fsdp: sharded (a reduce-scatter per iteration) or
    # whole (one per pass, 4 bytes per stage parameter / tensor more per GPU). docs/parallelism.md
    grad_sum: str = "sharded"

    @property
    def explicit(self) -> bool:
        """A 1F1B schedule: forward and backward in one loop of ticks (parallel/one_f_one_b.py),
        the backward its own rather than autodiff's."""
        return self.schedule in EXPLICIT_SCHEDULES


@dataclass(frozen=True)
class XlaConfig:
    """XLA compiler flags, set before JAX starts a backend (jaxtron/program/xla_flags.py)."""

    preset: str = "auto"  # none | gpu | auto (gpu when a CUDA build of jax is installed)
    flags: list[str] = field(default_factory=list)  # raw flags, e.g. ["--xla_dump_to=/tmp/hlo"]
    # jax's GPU memory share (XLA_PYTHON_CLIENT_MEM_FRACTION wins when set); its own 0.75
    # idles 20 GB
    mem_fraction: float = 0.9


@dataclass(frozen=True)
class OptimConfig:
    # adamw, or muon: Newton-Schulz orthogonalised momentum for the hidden matrices, AdamW for
    # the rest (embeddings, head, norms, biases, routers), at the same lr and weight decay
    # (Moonlight's update-RMS matching; docs/optimizers.md)
    name: str = "adamw"
    lr: float = 3e-4
    # cosine (warm-up, then down to lr * min_lr_ratio at decay_steps), wsd (warm-up, constant,
    # then cooldown_steps down to lr * min_lr_ratio at decay_steps) or constant (after warm-up)
    schedule: str = "cosine"
    warmup_steps: int = 100
    decay_steps: int = 0  # the step the decay ends at; 0 -> train.steps
    min_lr_ratio: float = 0.1
    cooldown_steps: int = 0  # wsd's decay length; 0 -> a fifth of the decay's end step
    cooldown_shape: str = "linear"  # wsd's decay: linear, cosine or sqrt (1 - sqrt of progress)
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    clip_norm: float = 1.0  # global-norm clipping; 0 disables
    # Adam's first moment (and Muon's momentum) in this dtype ("": the params'); bfloat16 saves
    # 2 bytes per parameter (Adam's second moment stays in the params' dtype: its square would
    # lose range)
    mu_dtype: str = ""
    # muon: momentum, Newton-Schulz iterations, and where each matrix is orthogonalised: spread
    # (whole matrices dealt out over the devices that shard them), gathered (every device
    # orthogonalises every matrix it holds a piece of) or sharded (in the weights' own layout)
    muon_beta: float = 0.95
    muon_steps: int = 5
    muon_layout: str = "spread"


@dataclass(frozen=True)
class CheckpointConfig:
    every: int = 500  # steps between saves; 0 saves only at the end (and on SIGTERM/SIGINT/SIGHUP)
    keep: int = 3  # the latest this many are kept ...
    keep_every: int = 0  # ... plus, permanently, every step that is a multiple of this (0: none)
    # if run.dir has none, start from this checkpoint (.../checkpoints/<step>), or the newest of a
    # run or import directory (jaxtron convert-hf import)
    restore: str = ""
    # with restore: take the params only (fine-tuning): fresh optimizer, step 0
    weights_only: bool = False
    # The local tier: node-local storage (NVMe, /dev/shm; $VARS expanded on each host), "" = off.
    # Each process saves its own shards there every local_every steps, and a copy of a peer
    # host's process's shards: losing any one host loses nothing (docs/faults.md)
    local_dir: str = ""
    local_every: int = 10
    local_keep: int = 2  # local steps kept on each host (its own and its peer's copies)


@dataclass(frozen=True)
class RunConfig:
    dir: str = "runs/default"
    tensorboard: bool = True
    progress: str = "auto"  # auto (bar on a terminal) | bar | lines
    # [first, last]: a JAX profiler trace of these steps into run.dir/profile/
    # (TensorBoard, Perfetto)
    profile_steps: list[int] = field(default_factory=list)
    # every process traces into profile/process_<i>; else only 0
    profile_all_processes: bool = False
    # JAX's persistent compilation cache: a restart loads compiled programs from DIR; "" = off
    compile_cache: str = ""
    # Several processes: one that stops answering (killed, frozen, node down) ends the run within
    # this many seconds, the others exit 75 naming it (JAX's heartbeat timeout: half of it)
    peer_timeout_s: int = 60
    # ... one whose restore, step, save or eval batch stalls this long exits 75; 0: no bound
    stuck_timeout_s: int = 1800
    # Several hosts: every this many steps the hosts' own time per step (input and dispatch, not
    # the wait for each other) is gathered; a host slower than the median by more than
    # straggler_margin of a step is named in the log, metrics and goodput; 0: off
    straggler_every: int = 50
    straggler_margin: float = 0.2
    on_straggler: str = "warn"  # warn | stop (exit 75 naming it, for a restart without it)


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    xla: XlaConfig = field(default_factory=XlaConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)


def _closest(name: str, options: list[str], where: str) -> str:
    """A suggestion for an unknown key: the same key in another section first (`train.lr` ->
    `optim.lr`), else the closest name in its own section."""
    if where.count(".") == 1:
        sections = typing.get_type_hints(Config)
        elsewhere = [f"{section}.{name}" for section, schema in sections.items()
                     if dataclasses.is_dataclass(schema) and name in typing.get_type_hints(schema)]
        if elsewhere:
            return f" (did you mean '{elsewhere[0]}'?)"
    match = difflib.get_close_matches(name, options, n=1, cutoff=0.5)
    return f" (did you mean '{where}{match[0]}'?)" if match else ""


def _check_keys(tree: dict, schema: type, where: str) -> None:
    """Reject keys the schema does not have, naming the closest valid one."""
    hints = typing.get_type_hints(schema)
    for key, value in tree.items():
        path = f"{where}{key}"
        if key not in hints and ":" in str(key):  # YAML read `{path:/data}` as one key
            raise ConfigError(f"'{path}': YAML needs a space after the colon, e.g. "
                              f"{{{str(key).replace(':', ': ', 1)}}}")
        if key not in hints and schema is ModelConfig and key in FLAT_MOE:
            raise ConfigError(f"'{path}' is 'model.moe.{FLAT_MOE[key]}' now")
        if key not in hints:
            raise ConfigError(f"unknown config key '{path}'{_closest(key, list(hints), where)}")
        sub = hints[key]
        if dataclasses.is_dataclass(sub):
            if not isinstance(value, dict):
                raise ConfigError(f"'{path}' is a section; set its keys, e.g. {path}.<key>=...")
            _check_keys(value, sub, path + ".")
        elif sub is bool and not isinstance(value, bool):  # OmegaConf takes yes, off, 1 too
            raise ConfigError(f"{path} must be true or false, got {value}")
        elif sub is str and isinstance(value, bool):  # as typed (OmegaConf would say "True")
            tree[key] = str(value).lower()
        elif typing.get_origin(sub) is list and dataclasses.is_dataclass(typing.get_args(sub)[0]):
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise ConfigError(f"'{path}' is a list of mappings, e.g. {path}=[{{path: ...}}]")
            for i, item in enumerate(value):
                _check_keys(item, typing.get_args(sub)[0], f"{path}[{i}].")


def load(files: list[str | Path] = (), overrides: list[str] = ()) -> Config:
    """Schema defaults <- each YAML file (with its bases) <- `section.key=value` overrides."""
    for item in overrides:  # YAML folds a newline in a value into a space: check it as typed
        key, _, value = item.partition("=")
        _check_no_control(key.strip(), value)
    layers = [(f"{f}: ", presets.read(presets.find(f))) for f in files]  # errors name the file
    layers += [("", presets.parse_override(item)[1]) for item in overrides]  # the last one wins
    layers = [(where, presets.auto_microbatches(layer)) for where, layer in layers]
    merged = OmegaConf.structured(Config)
    for where, layer in layers:
        try:
            _check_keys(layer, Config, "")
            merged = OmegaConf.merge(merged, layer)
        except oc_errors.ValidationError as e:
            raise ConfigError(where + presets.bad_value(e, Config, _KINDS, layer)) from None
        except ConfigError as e:
            raise ConfigError(where + str(e)) from None
    cfg = _home_expanded(OmegaConf.to_object(merged))
    check_values(cfg)
    return cfg


CREATED_DIRS = ("run.dir", "run.compile_cache")  # directories a run makes when they are missing


def _check_no_control(key: str, value: str) -> None:
    """A directory a run would make, named with a control character (a newline or tab from a
    paste or a broken quote): refused, as it would be made under a name no one meant."""
    if key in CREATED_DIRS and (bad := [c for c in value if ord(c) < 32 or ord(c) == 127]):
        raise ConfigError(f"{key}={value!r} holds a control character ({bad[0]!r}), probably "
                          f"from a paste or a broken quote; retype {key} without it")


def _home_expanded(cfg: Config) -> Config:
    """`~` at the start of a path field is the home directory (a shell leaves run.dir=~/x's)."""
    home = os.path.expanduser
    d = cfg.data
    data = dataclasses.replace(d, tokenizer=home(d.tokenizer), cache_dir=home(d.cache_dir),
                               mixture=[dataclasses.replace(e, path=home(e.path))
                                        for e in d.mixture])
    run = dataclasses.replace(cfg.run, dir=home(cfg.run.dir),
                              compile_cache=home(cfg.run.compile_cache))
    restore = dataclasses.replace(cfg.checkpoint, restore=home(cfg.checkpoint.restore))
    return dataclasses.replace(cfg, data=data, run=run, checkpoint=restore)


def _ranges(cfg: Config) -> tuple:
    """(key, value, holds, range in words) of every bounded numeric field."""
    m, t, o, c, p = cfg.model, cfg.train, cfg.optim, cfg.checkpoint, cfg.pipeline
    at_least = lambda low: (lambda v: v >= low, f">= {low}")
    above_0 = (lambda v: v > 0, "> 0")
    unit = (lambda v: 0 <= v < 1, "in [0, 1)")
    return (
        ("model.head_dim", m.head_dim, *at_least(0)), ("model.rope_theta", m.rope_theta, *above_0),
        ("model.rope_scaling_factor", m.rope_scaling_factor, *at_least(0)),
        ("model.rope_low_freq_factor", m.rope_low_freq_factor, *above_0),
        ("model.rope_high_freq_factor", m.rope_high_freq_factor, *above_0),
        ("model.rope_original_max_len", m.rope_original_max_len, *above_0),
        ("model.moe.capacity_factor", m.moe.capacity_factor, *at_least(0)),
        ("model.moe.aux_coef", m.moe.aux_coef, *at_least(0)),
        ("model.moe.z_coef", m.moe.z_coef, *at_least(0)),
        ("model.moe.num_experts", m.moe.num_experts, *at_least(0)),
        ("model.moe.mlp_dim", m.moe.mlp_dim, *at_least(0)),
        ("model.norm_eps", m.norm_eps, *above_0), ("model.init_std", m.init_std, *above_0),
        ("train.eval_every", t.eval_every, *at_least(0)),
        ("train.eval_batches", t.eval_batches, *at_least(1)),
        ("train.max_nonfinite_skips", t.max_nonfinite_skips, *at_least(0)),
        ("optim.lr", o.lr, *at_least(0)), ("optim.warmup_steps", o.warmup_steps, *at_least(0)),
        ("optim.decay_steps", o.decay_steps, *at_least(0)),
        ("optim.min_lr_ratio", o.min_lr_ratio, lambda v: 0 <= v <= 1, "in [0, 1]"),
        ("optim.b1", o.b1, *unit), ("optim.b2", o.b2, *unit), ("optim.eps", o.eps, *above_0),
        ("optim.weight_decay", o.weight_decay, *at_least(0)),
        ("optim.clip_norm", o.clip_norm, *at_least(0)),
        ("optim.cooldown_steps", o.cooldown_steps, *at_least(0)),
        ("optim.muon_beta", o.muon_beta, *unit), ("optim.muon_steps", o.muon_steps, *at_least(1)),
        ("checkpoint.every", c.every, *at_least(0)), ("checkpoint.keep", c.keep, *at_least(1)),
        ("checkpoint.keep_every", c.keep_every, *at_least(0)),
        ("checkpoint.local_every", c.local_every, *at_least(1)),
        ("checkpoint.local_keep", c.local_keep, *at_least(1)),
        ("run.peer_timeout_s", cfg.run.peer_timeout_s, *at_least(4)),
        ("run.stuck_timeout_s", cfg.run.stuck_timeout_s, *at_least(0)),
        ("run.straggler_every", cfg.run.straggler_every, *at_least(0)),
        ("run.straggler_margin", cfg.run.straggler_margin, *above_0),
        ("pipeline.repeats", p.repeats, *at_least(1)), ("pipeline.passes", p.passes, *at_least(1)),
        ("data.workers", cfg.data.workers, *at_least(0)),
        ("xla.mem_fraction", cfg.xla.mem_fraction, lambda v: 0 < v <= 1, "in (0, 1]"),
    )


def check_values(cfg: Config) -> None:
    """Checks of the schema's own values: dtypes, ranges and divisibility inside the model. Names
    that other modules define (remat policies, attention kernels) are checked by their owners
    (model.check), so the schema imports nothing of the code that uses it."""
    m, t = cfg.model, cfg.train
    _check_no_control("run.dir", cfg.run.dir)  # a YAML file's "a\nb" keeps its newline
    _check_no_control("run.compile_cache", cfg.run.compile_cache)
    for key, value, holds, words in _ranges(cfg):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{key}={value} is not a finite number; it must be {words}")
        if not holds(value):
            raise ConfigError(f"{key}={value} is out of range: it must be {words}")
    if cfg.optim.mu_dtype and cfg.optim.mu_dtype not in DTYPES:
        raise ConfigError(f"optim.mu_dtype={cfg.optim.mu_dtype} is not one of {', '.join(DTYPES)}"
                          " or '' (the params' dtype)")
    for key, value, options in (
            ("optim.name", cfg.optim.name, OPTIMIZERS), ("optim.schedule", cfg.optim.schedule,
                                                          SCHEDULES),
            ("optim.cooldown_shape", cfg.optim.cooldown_shape, COOLDOWNS),
            ("optim.muon_layout", cfg.optim.muon_layout, MUON_LAYOUTS)):
        if value not in options:
            raise ConfigError(f"{key}={value} is not one of {', '.join(options)}")
    for key, value in (("model.dtype", m.dtype), ("model.param_dtype", m.param_dtype)):
        if value not in DTYPES:
            raise ConfigError(f"{key}={value} is not one of {', '.join(DTYPES)}")
    if t.on_nonfinite not in ("skip", "stop"):
        raise ConfigError(f"train.on_nonfinite={t.on_nonfinite} is not one of skip, stop")
    if cfg.checkpoint.weights_only and not cfg.checkpoint.restore:
        raise ConfigError("checkpoint.weights_only=true needs checkpoint.restore=PATH")
    if cfg.run.progress not in ("auto", "bar", "lines"):
        raise ConfigError(f"run.progress={cfg.run.progress} is not one of auto, bar, lines")
    if cfg.run.on_straggler not in ("warn", "stop"):
        raise ConfigError(f"run.on_straggler={cfg.run.on_straggler} is not one of warn, stop")
    traced = cfg.run.profile_steps
    if traced and (len(traced) != 2 or not 0 <= traced[0] <= traced[1] <= t.steps):
        first = min(10, t.steps // 2)
        raise ConfigError(f"run.profile_steps={list(traced)} must be [first, last] with 0 <= first "
                          f"<= last <= train.steps={t.steps}, e.g. [{first}, "
                          f"{min(first + 2, t.steps)}]; [] for no trace")
    positive = {
        "model.vocab_size": m.vocab_size, "model.num_layers": m.num_layers,
        "model.d_model": m.d_model, "model.num_heads": m.num_heads,
        "model.num_kv_heads": m.num_kv_heads, "model.mlp_dim": m.mlp_dim,
        "train.steps": t.steps, "train.batch_size": t.batch_size, "train.seq_len": t.seq_len,
        "train.log_every": t.log_every,
    }
    for key, value in positive.items():
        if value <= 0:
            raise ConfigError(f"{key}={value} must be positive")
    for key, value in (("train.loss_chunk", t.loss_chunk), ("train.microbatches", t.microbatches)):
        if value < 0:  # 0: one chunk; auto
            raise ConfigError(f"{key}={value} must be "
                              f"{'0 (one chunk)' if 'loss' in key else 'auto'} or positive")
    if m.num_heads % m.num_kv_heads:
        raise ConfigError(
            f"model.num_heads={m.num_heads} must be a multiple of "
            f"model.num_kv_heads={m.num_kv_heads}"
        )
    if not m.head_dim and m.d_model % m.num_heads:
        raise ConfigError(
            f"model.d_model={m.d_model} is not divisible by model.num_heads={m.num_heads}; "
            "change them or set model.head_dim"
        )
    if m.head_size % 2:
        raise ConfigError(f"head size {m.head_size} must be even for RoPE; set model.head_dim")
    if m.moe.num_experts and not 1 <= m.moe.experts_per_token <= m.moe.num_experts:
        raise ConfigError(f"model.moe.experts_per_token={m.moe.experts_per_token} must be between "
                          f"1 and model.moe.num_experts={m.moe.num_experts}")


def check_warnings(cfg: Config) -> list[str]:
    """Settings that are valid but probably not meant, one line each naming the fix (a run
    prints them as warnings and goes on)."""
    o, t = cfg.optim, cfg.train
    found = []
    if o.warmup_steps > t.steps:
        found.append(f"optim.warmup_steps={o.warmup_steps} is more than train.steps={t.steps}: "
                     f"the run ends during warm-up, before the learning rate reaches "
                     f"optim.lr={o.lr}; lower optim.warmup_steps (or raise train.steps)")
    # Keys the schedule does not read: a constant rate never decays, only wsd cools down.
    ignored = (("decay_steps",) if o.schedule == "constant" else ()) + (
        () if o.schedule == "wsd" else ("cooldown_steps", "cooldown_shape"))
    unused = [f"optim.{key}={getattr(o, key)}" for key in ignored
              if getattr(o, key) != getattr(OptimConfig, key)]
    if unused:
        why = "it never decays" if o.schedule == "constant" else "only wsd has a cool-down"
        found.append(f"{', '.join(unused)} {'does' if len(unused) == 1 else 'do'} nothing with "
                     f"optim.schedule={o.schedule} ({why}); drop "
                     f"{'it' if len(unused) == 1 else 'them'}, or set optim.schedule=wsd")
    muon_keys = [f"optim.{key}={getattr(o, key)}" for key in ("muon_beta", "muon_steps",
                                                              "muon_layout")
                 if getattr(o, key) != getattr(OptimConfig, key)]
    if o.name != "muon" and muon_keys:
        found.append(f"{', '.join(muon_keys)} {'does' if len(muon_keys) == 1 else 'do'} nothing "
                     f"with optim.name={o.name}; drop {'it' if len(muon_keys) == 1 else 'them'}, "
                     "or set optim.name=muon")
    decays, end = o.schedule != "constant", o.decay_steps or t.steps  # the step the decay ends
    if decays and 0 < o.decay_steps <= o.warmup_steps:
        found.append(f"optim.decay_steps={o.decay_steps} is not past optim.warmup_steps="
                     f"{o.warmup_steps} (it counts the warm-up): the learning rate drops from "
                     f"optim.lr to its minimum in one step after the warm-up; raise it")
    elif decays and o.decay_steps > t.steps:
        found.append(f"optim.decay_steps={o.decay_steps} is more than train.steps={t.steps}: the "
                     "run ends before the decay does (meant if a later run goes on); "
                     "0 decays over train.steps")
    if o.schedule == "wsd" and end > o.warmup_steps and o.cooldown_steps > end - o.warmup_steps:
        found.append(f"optim.cooldown_steps={o.cooldown_steps} is more than the "
                     f"{end - o.warmup_steps} steps from the warm-up's end (optim.warmup_steps="
                     f"{o.warmup_steps}) to the decay's end ("
                     f"{'optim.decay_steps' if o.decay_steps else 'train.steps'}={end}): the "
                     "cool-down starts as the warm-up ends, with no stable phase; lower "
                     "optim.cooldown_steps")
    if o.lr == 0:
        found.append("optim.lr=0: the weights never change; set the peak learning rate")
    p, stages, per_pass = cfg.pipeline, cfg.mesh.stage, t.microbatches // cfg.pipeline.passes
    if p.schedule == "circular" and p.repeats > 1 and stages == 1:
        found.append(f"pipeline.repeats={p.repeats} does nothing with mesh.stage=1 (no pipeline); "
                     "set mesh.stage > 1, or drop it")
    if p.schedule == "zb_h1" and stages > 1 and not cfg.model.weight_grads_apart(
            cfg.mesh.tensor):
        found.append(f"pipeline.schedule=zb_h1 with mesh.tensor={cfg.mesh.tensor}: the "
                     "collective matmuls compute the weight gradients inside their rings, "
                     "so none waits to fill the bubble and it runs as interleaved_1f1b at "
                     "pipeline.repeats=1 (2S-1 microbatches alive; 1f1b keeps S); "
                     "model.collective_matmul=false frees them (at their exposed traffic)")
    if 1 < stages and per_pass < stages:  # the circular schedule refuses this outright
        found.append(f"{per_pass} microbatch{'es' if per_pass > 1 else ''} per pass through "
                     f"mesh.stage={stages} stages: they idle "
                     f"{(stages - 1) / (per_pass + stages - 1):.0%}"
                     " of each step (bubble (S-1)/(M+S-1)); raise train.microbatches")
    return found


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what `config.yaml` in the run directory holds)."""
    return yaml.safe_dump(dataclasses.asdict(cfg), sort_keys=False)
