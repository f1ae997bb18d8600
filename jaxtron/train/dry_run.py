"""`jaxtron train --dry-run`: a run's set-up without allocating anything. Every check a run makes
before compiling (paths, layout, data, tokenizer, run.dir and its checkpoints,
checkpoint.restore, run.compile_cache), through the same set-up path (plan/setup.py), then the
plan printed: mesh, parameters, every term of the per-device memory, and a verdict against the
device's memory (a GPU's, or this machine's for CPU devices)."""

from __future__ import annotations

import fcntl
from pathlib import Path

import jax

from jaxtron import cli, data, parallel
from jaxtron import config as config_lib
from jaxtron.checkpoint import IN_USE, LOCK_FILE, weights
from jaxtron.config import Config, ConfigError
from jaxtron.data import prepared
from jaxtron.data.prepared import tokenizer_check
from jaxtron.data.tokenizer import CORPUS_PIECES
from jaxtron.model import moe
from jaxtron.parallel import pipeline
from jaxtron.plan import memory
from jaxtron.plan.setup import set_up
from jaxtron.program import aot
from jaxtron.step import optim
from jaxtron.train import doctor
from jaxtron.train.run_dir import check_paths
from jaxtron.train.start import RESTORE_UNUSED, check_start, describe_start, resumed_schedule_jump


def _gib(n: int) -> str:
    return f"{n:,} bytes ({n / 2**30:.2f} GiB)"


def dry_run(cfg, num_devices: int, gpu: str | None, flags: list[str]) -> None:
    """Check everything a run checks before compiling (layout, data, tokenizer, run.dir and its
    checkpoints, checkpoint.restore, run.compile_cache) and print the mesh, parameter count, every
    term of the per-device memory, the total against the device's memory with a verdict, then the
    resolved config; allocate and write nothing."""

    if not (finished := nothing_to_do(cfg)):  # a finished run writes nothing: any storage will do
        check_paths(cfg)  # in the order a run checks: paths, layout, data
        _check_unlocked(Path(cfg.run.dir))
    # the run's own set-up, for any machine: the attention kernel stays as configured
    setup = set_up(cfg, num_devices, None, aot.usable_on(gpu, cfg, jax.devices()))
    cfg, chosen, plan = setup.cfg, setup.chosen, setup.plan
    data_check = _check_data(cfg)
    no_room = [] if finished else doctor.check_disk(cfg.run.dir, plan.checkpoint_bytes())
    if no_room and not gpu and num_devices == jax.device_count():  # as a run here refuses it
        raise config_lib.ConfigError(no_room[0])
    print(f"xla flags: {' '.join(flags) or 'none'}")
    for warning in config_lib.check_warnings(cfg):
        print(f"warning: {warning}")
    print("mesh: " + parallel.describe(plan.mesh_sizes)
          + f" ({cli.plural(num_devices, 'device')})")
    print(f"parameters: {moe.describe_params(cfg.model, plan.num_params)}"
          + (f"\n{chosen}" if chosen else ""))
    print(f"parameter bytes per device: {_gib(plan.bytes_per_device('params'))}")
    print(optim.describe(cfg))
    print(f"optimizer bytes per device: {_gib(plan.bytes_per_device('opt_state'))}")
    if plan.pipe:
        print(pipeline.describe(plan.pipe, cfg.pipeline.schedule, plan.accumulation))
    print(data_check)
    for line in no_room:  # planned for other machines: their run.dir may have the room
        print(f"warning: here, {line}")
    print(f"start: {finished}" if finished else describe_start(
        Path(cfg.run.dir), cfg.checkpoint.restore, cfg.checkpoint.weights_only, cfg.train.steps))
    if cfg.checkpoint.local_dir and not finished:
        print(f"local tier: every {cfg.checkpoint.local_every} steps into "
              f"checkpoint.local_dir={cfg.checkpoint.local_dir} on each host; a start asks every "
              "host what it holds and resumes from it when newer than the start above")
    if steps := weights.run_checkpoints(Path(cfg.run.dir)):
        if jump := resumed_schedule_jump(weights.read_meta(steps[-1]), cfg):
            print(f"warning: {jump}")
        if not finished and (inexact := _resume_warning(steps[-1], cfg)):
            print(f"warning: {inexact}")
        if cfg.checkpoint.restore:
            print(f"note: {RESTORE_UNUSED.format(cfg.checkpoint.restore)}")
    terms = memory.estimate(cfg, plan)
    total = sum(terms.values())
    print(f"memory per device, estimated: {_gib(total)}, of which (model.remat={cfg.model.remat}):")
    for name, size in terms.items():
        print(f"  {name}: {_gib(size)}")
    print(_verdict(terms, gpu, cfg, num_devices))
    print("resolved config:")
    print(config_lib.to_yaml(cfg), end="")


def _check_unlocked(run_dir: Path) -> None:
    """A run in progress in run.dir (its lock, checkpoint.RunDirLock, tested without taking it)
    is refused as a second run would be."""

    if (run_dir / LOCK_FILE).is_file():
        with open(run_dir / LOCK_FILE) as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except OSError:
                raise ConfigError(IN_USE.format(run_dir, f.read().strip())) from None


def _resume_warning(step_dir: Path, cfg) -> str | None:
    """The warning a run gives when the checkpoint's input position cannot be resumed exactly
    with this config's data layout (jaxtron/data/pipeline.py); None when it can, or was not
    saved."""
    try:
        saved = data.saved_iterator_state(step_dir / "data", 0, 1)
    except (OSError, ValueError):
        return None
    return data.resume_warning(saved, data.layout_of(cfg.data, cfg.train))


def _check_data(cfg) -> str:
    """The data checks a run makes before compiling (sources, mixture, tokenizer against the
    vocabulary; the default corpus's tokenizer is trained and cached if it is not yet); what was
    checked, and a warning for a vocabulary far larger than the tokenizer's."""
    prepared.check_dataset(cfg.data, cfg.model.vocab_size)
    prepared.check_eval(cfg.data, cfg.train.eval_every)
    tok = prepared.checked_tokenizer(cfg.data, cfg.model.vocab_size)  # a ConfigError if too small
    if cfg.data.source == "arrayrecord":
        checked = f"data: {cli.plural(len(cfg.data.mixture), 'prepared dataset')} checked"
        read = cfg.train.steps * cfg.train.batch_size * cfg.train.seq_len
        over = [f"{e.path} {times:,.1f} times over ({s['tokens']:,} tokens, weight {e.weight:g})"
                for e, s, share in prepared.mixture_shares(cfg.data)
                if s["tokens"] and (times := read * share / s["tokens"]) > 1]
        if over:
            checked += f"; the run reads {read:,} tokens, so it reads {', '.join(over)}"
    else:
        made = f"data.tokenizer={cfg.data.tokenizer}" if cfg.data.tokenizer else "trained, cached"
        if not cfg.data.tokenizer and cfg.model.vocab_size > CORPUS_PIECES:
            made += f"; at most {CORPUS_PIECES:,} here: give data.tokenizer for more"
        checked = (f"data: the standard library's sources, a tokenizer of "
                   f"{tok.get_piece_size():,} pieces ({made})")
    warnings = filter(None, [prepared.unread(cfg.data, cfg.train),
                             prepared.unused_vocab(cfg.data, cfg.model)])
    return checked + "".join(f"\nwarning: {w}" for w in warnings)


CLOSE_CALL = 0.1  # nearer the limit than this share, the estimate cannot tell: compile it
ACTIVATIONS = ("saved_activations", "lm_head_and_loss", "layer_backward", "embedding_backward",
               "pipeline_buffers")  # memory.estimate's terms that shrink with the microbatch


def _verdict(terms: dict[str, int], gpu: str | None, cfg, num_devices: int) -> str:
    """The estimate against what jax may allocate on --gpu's devices, or on the local one (CPU
    devices: this machine's available memory, which they share). On GPUs, an estimate within
    CLOSE_CALL of the limit is no verdict: the compiled program says."""

    total, local = sum(terms.values()), jax.devices()[0]
    if gpu:
        usable, where = (int(aot.capacity_bytes(gpu) * aot.usable_fraction(cfg)),
                         f"one {gpu.upper()}")
    elif local.platform == "cpu" and num_devices == jax.local_device_count():
        return _host_verdict(terms, cfg, num_devices)
    else:
        usable, where = ((local.memory_stats() or {}).get("bytes_limit", 0),
                         f"this {local.device_kind}")
    if not usable:
        return (f"verdict: no device memory limit known here ({local.platform}); "
                "add --gpu h100 (or h200) to compare")
    if gpu and abs(total - usable) <= CLOSE_CALL * usable:
        return (f"verdict: too close to call: {total / 2**30:.1f} GiB estimated, "
                f"{usable / 2**30:.1f} GiB usable on {where}, nearer than the estimate's "
                f"{CLOSE_CALL:.0%}; compile it to know: add --compile-for {gpu} --devices "
                f"{num_devices} in place of --dry-run")
    if total <= usable:
        return (f"verdict: fits: {total / 2**30:.1f} of {usable / 2**30:.1f} GiB usable on "
                f"{where} ({1 - total / usable:.0%} spare)")
    return (f"verdict: DOES NOT FIT: {total / 2**30:.1f} GiB per device, {usable / 2**30:.1f} "
            f"GiB usable on {where}; {_advice(terms, cfg)}")


def _advice(terms: dict[str, int], cfg) -> str:
    """What shrinks the largest terms: more microbatches for activations, more sharding for
    the state; the two largest terms named."""
    top = sorted(terms, key=terms.get, reverse=True)[:2]
    named = " and ".join(f"{name} {terms[name] / 2**30:.1f} GiB" for name in top)
    remat = "" if cfg.model.remat == "full" else ", model.remat=full"
    if sum(terms[t] for t in ACTIVATIONS if t in terms) > sum(terms.values()) / 2:
        return (f"mostly activations ({named}): raise train.microbatches (now "
                f"{cfg.train.microbatches}){remat}, or shard more (mesh.tensor, mesh.stage)")
    return f"mostly state ({named}): shard more (mesh.fsdp, mesh.tensor, mesh.stage){remat}"


HOST_CLOSE_CALL = 0.25  # nearer than this share of the available memory: run it to know


def _host_verdict(terms: dict[str, int], cfg, num_devices: int) -> str:
    """CPU devices share this machine's memory: all of them, as a CPU program uses it, plus the
    process, against what is available (counting this process's memory, which a run would
    have instead)."""
    if not (available := memory.available_host_bytes()):
        return "verdict: no memory limit known here (cpu); add --gpu h100 (or h200) to compare"
    here = memory.process_bytes()
    need = memory.host_need(sum(terms.values()), num_devices, here)
    available += here
    devices = f"{num_devices} CPU device{'s' if num_devices > 1 else ''}"
    said = (f"{need / 2**30:.1f} GiB for {devices} (the estimate x{memory.HOST_FACTOR} as a CPU "
            f"program uses it, and the process), {available / 2**30:.1f} GiB available on this "
            "machine")
    if need > available:
        return (f"verdict: DOES NOT FIT: {said}; {_advice(terms, cfg)}; or run a smaller preset "
                "here (--config tiny), or size it for GPUs with --devices N --gpu h100")
    if need > (1 - HOST_CLOSE_CALL) * available:
        return (f"verdict: too close to call: {said}; run a few steps (train.steps=3) and watch "
                f"its memory, or leave room: {_advice(terms, cfg)}")
    return f"verdict: fits: {said}"


def nothing_to_do(cfg: Config) -> str | None:
    """'nothing to do' when run.dir's newest checkpoint is at train.steps or past it (and holds
    this model: check_start), before anything is written; else None."""
    run_dir = Path(cfg.run.dir)
    steps = weights.run_checkpoints(run_dir)
    if not steps or int(steps[-1].name) < cfg.train.steps:
        return None
    check_start(run_dir, cfg.model, "", tokenizer_check(cfg.data, cfg.model.vocab_size),
                cfg.optim.name)
    return (f"nothing to do: {run_dir} is trained to step {steps[-1].name} (train.steps="
            f"{cfg.train.steps}); raise train.steps to train on, or set run.dir to a new directory")
