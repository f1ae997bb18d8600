"""Hugging Face model directories to jaxtron checkpoints and back, one tensor at a time.

    jaxtron convert-hf import ~/Llama-3.2-1B imports/llama3_1b
    jaxtron train --config imports/llama3_1b/config.yaml           # fine-tune it, on any mesh
    jaxtron convert-hf export runs/llama3_1b hf/llama3_1b    # the newest checkpoint of a run

`import` reads `config.json` and the safetensors weights (sharded with an index or not; pickled
`.bin`/`.pt` only with --allow-pickle, which needs PyTorch) and writes OUT_DIR/checkpoints/0 (the
weights, one layer per Orbax partial save), OUT_DIR/config.yaml (a preset that fine-tunes them:
the model section read from config.json, the tokenizer copied beside it, checkpoint.restore and
weights_only set) and the tokenizer files. `export` takes a checkpoint saved on any mesh or
pipeline layout (a step directory, or the newest of a run or import directory) and writes
config.json (with `architectures`, and the tokenizer's bos/eos/pad ids, also written as
generation_config.json, which transformers' generate() reads; the eos ids of the directory a run
was imported from join them), safetensors shards with an index,
and the run's tokenizer files (a SentencePiece model with a tokenizer_config.json that makes
transformers add the BOS training put before each document).
Host memory stays near one layer plus the largest tensor either way. Bad input: one line, exit 2.
Either way the output is written beside OUT_DIR and renamed to it when complete, so a failure or
a stop (Ctrl-C, SIGTERM: one line, exit 130) leaves no OUT_DIR; an export is refused inside a
checkpoints directory, whose rotation would delete it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import glob
import json
import os
import secrets
import shlex
import shutil
import signal
import socket
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import sentencepiece as spm
import yaml

from jaxtron import cli, hf, lifecycle
from jaxtron.checkpoint import weights
from jaxtron.config import ConfigError, ModelConfig
from jaxtron.data import prepared
from jaxtron.data import tokenizer as tokenizer_lib
from jaxtron.hf import mapping as hf_mapping
from jaxtron.hf.config_json import rope_interleave
from jaxtron.lifecycle import EXIT_STOPPED, one_line_errors

DTYPES = ("float32", "bfloat16", "float16")
CONTEXT = 2048  # the preset's train.seq_len, or the model's own context when shorter
_signalled: list[int] = []  # the signals that arrived while main() ran
_held = [False]  # True while Orbax saves: a signal then stops the work at the next _stop_point
T = TypeVar("T")


def _on_signal(signum: int, frame) -> None:
    """The first SIGINT/SIGTERM stops the work with one KeyboardInterrupt, at once or, while
    Orbax saves, at the next _stop_point; later ones are only recorded, so that they cannot cut
    the clean-up short."""
    if lifecycle.deferred(signum, frame):
        return
    _signalled.append(signum)
    if len(_signalled) == 1 and not _held[0]:
        raise KeyboardInterrupt


def _stop_point() -> None:
    """Stop here (KeyboardInterrupt) if a signal has arrived."""
    if _signalled:
        raise KeyboardInterrupt


@contextlib.contextmanager
def _signals_held():
    """Signals stop the work only at _stop_point within: Orbax writes in its own threads, so a
    save cut short goes on writing into the directory being removed (tracebacks, and a
    directory left behind)."""
    _held[0] = True
    try:
        yield
    finally:
        _held[0] = False


_HOST = socket.gethostname().replace("-", "_")  # in a partial directory's name, with its pid


def _remove_stale_partials(target: Path) -> None:
    """What a killed command (kill -9, a lost node) left beside `target`: its partial directories
    of this host whose process is gone (a model's size each), removed with a line saying so."""
    for stale in target.parent.glob(f"{glob.escape(target.name)}.partial-{_HOST}-*-*"):
        try:
            os.kill(int(stale.name.rsplit("-", 2)[1]), 0)
            continue  # a command still writing it
        except ProcessLookupError:
            pass
        except (ValueError, PermissionError):  # not ours, or another user's live process
            continue
        shutil.rmtree(stale, ignore_errors=True)
        print(f"removed {stale}, left by a command that was killed", flush=True)


def _write_new_dir(path: Path, write: Callable[[Path], T]) -> T:
    """write(a new sibling directory of `path`)'s result, once that directory is renamed to
    `path`: a failure or a stop leaves no `path` (an empty one that was there stays as it was)
    and nothing half-written, and of two commands writing the same new `path` at once the second
    is refused, not mixed in. A `path` that holds something (nothing is overwritten) or is a file
    is refused first."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path} is a file; name a new output directory")
    if path.is_dir() and any(path.iterdir()):
        raise ConfigError(f"{path} already exists and is not empty; choose a new output directory")
    target = path.absolute()
    made = [p for p in (target.parent, *target.parent.parents) if not p.exists()]  # deepest first
    _remove_stale_partials(target)
    partial = target.with_name(f"{target.name}.partial-{_HOST}-{os.getpid()}-"
                               f"{secrets.token_hex(3)}")
    try:
        partial.mkdir(parents=True)
    except OSError as e:
        raise ConfigError(f"cannot make the output directory {path}: {e.strerror}") from None
    try:
        result = write(partial)
        _stop_point()  # one that came while signals were held, or whose interrupt was lost
        try:
            os.rename(partial, target)  # replaces an empty directory only
        except OSError as e:
            if e.errno not in (errno.ENOTEMPTY, errno.EEXIST):
                raise ConfigError(f"cannot rename the output to {path}: {e.strerror}") from None
            raise ConfigError(f"{path} was written by another command meanwhile; it is kept "
                              "as that one wrote it; choose a new output directory") from None
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        for parent in made:  # the directories made for it, while nothing else is in them
            try:
                parent.rmdir()
            except OSError:
                break
        raise
    return result


def _check_outside_checkpoints(out: Path, step_dir: Path) -> None:
    """An export is not written into a checkpoint, nor into a checkpoints directory of a run
    or import: a later run's checkpoint rotation would delete it with the checkpoints."""
    target, source = out.expanduser().resolve(), step_dir.resolve().parent
    holder = source if source in (target, *target.parents) else weights.checkpoints_holding(out)
    if holder is not None:
        raise ConfigError(f"{out} is inside the checkpoints directory {holder}, whose old "
                          "checkpoints a run deletes with what is in them; export to a "
                          f"directory outside it, e.g. {holder.parent / 'hf'}")


def _context(config_json: dict) -> int:
    """The preset's train.seq_len: the model's max_position_embeddings when it is a positive
    count below CONTEXT, else CONTEXT (a longer context fine-tunes at CONTEXT first)."""
    limit = config_json.get("max_position_embeddings")
    return limit if isinstance(limit, int) and 0 < limit < CONTEXT else CONTEXT


def _preset(cfg: ModelConfig, out: Path, tokenizer: str | None,
            context: int, compute_dtype: str) -> dict:
    """The config preset that fine-tunes an imported model."""
    skip = {"scan_layers", "remat", "attention", "attention_check", "collective_matmul",
            "weights_ahead", "init_std", "moe", "mla"}
    skip |= set() if cfg.sliding_window else {"sliding_window", "global_every"}
    model = {f: getattr(cfg, f) for f in ModelConfig.__dataclass_fields__ if f not in skip}
    if cfg.moe.num_experts:  # a dense model's preset has no experts' section
        model["moe"] = dataclasses.asdict(cfg.moe)
    if cfg.mla.kv_lora_rank:  # nor latent attention's
        model["mla"] = dataclasses.asdict(cfg.mla)
    preset = {
        "model": {**model, "dtype": compute_dtype},
        "train": {"seq_len": min(context, CONTEXT)},
        "checkpoint": {"restore": str(out.absolute()), "weights_only": True},
        "run": {"dir": f"runs/{out.name}"},
    }
    if tokenizer:
        preset["data"] = {"tokenizer": str((out / tokenizer).absolute())}
    return preset


def _write_tokenizer(tok: tokenizer_lib.Tokenizer, out: Path) -> str:
    """Write a tokenizer's files into `out`; a one-line description."""
    for name, content in tok.files.items():
        (out / name).write_bytes(content)
    return (f"{', '.join(tok.files)} ({tok.get_piece_size()} tokens, bos {tok.bos_id()}, "
            f"eos {tok.eos_id()})")


def _source_tokenizer(source: Path, vocab_size: int) -> tuple[tokenizer_lib.Tokenizer | None, str]:
    """(the directory's tokenizer, or None without a usable one; why not). A tokenizer with ids
    past config.json's vocab_size is refused: those ids have no embedding row, and fine-tuning
    on it is refused later, where raising model.vocab_size makes it another model."""
    try:
        tok = tokenizer_lib.from_path(source)
    except ConfigError as err:
        return None, f"no tokenizer copied ({err}); set data.tokenizer before training on text"
    if tok.get_piece_size() > vocab_size:
        raise ConfigError(
            f"{source}: the tokenizer ({tok.file}) has {tok.get_piece_size()} ids but "
            f"config.json's vocab_size is {vocab_size}, so ids {vocab_size} and up have no "
            f"embedding row; give the model one per id first (in transformers: "
            f"model.resize_token_embeddings({tok.get_piece_size()}); model.save_pretrained(DIR)) "
            "and import DIR, or move the tokenizer files out to import the weights alone")
    return tok, ""


def import_model(source: Path, out: Path, dtype: str, compute_dtype: str | None,
                 allow_pickle: bool) -> None:
    """HF directory -> OUT_DIR/{checkpoints/0, config.yaml, tokenizer files}."""
    if not source.is_dir():
        raise ConfigError(f"{source}: {'not a' if source.exists() else 'no such'} directory; "
                          "give a Hugging Face model directory (config.json and *.safetensors)")
    if not (source / "config.json").exists() and (
            weights.is_complete(source) or weights.checkpoints_holding(source) is not None
            or (source / "config.yaml").is_file() or weights.run_checkpoints(source)):
        raise ConfigError(f"{source} is a jaxtron run or checkpoint, not a Hugging Face model; "
                          f"to make one of it: jaxtron convert-hf export {source} OUT")
    config_json = hf.read_hf_config(source)  # its own message when there is none
    cfg = hf.read_config(source, dtype)
    get = hf.check_tensors(source, cfg, allow_pickle)
    stored = get("model.embed_tokens.weight").dtype.name
    compute_dtype = compute_dtype or (stored if stored in DTYPES else "float32")
    tok, no_tokenizer = _source_tokenizer(source, cfg.vocab_size)
    eos = hf.eos_ids(source, config_json)  # those no tokenizer file names too (<|eom_id|>)

    def write(into: Path) -> tuple:
        try:
            note = f"tokenizer: {_write_tokenizer(tok, into)}" if tok else no_tokenizer
            preset = _preset(cfg, out, tok and tok.file, _context(config_json), compute_dtype)
            text = (f"# {config_json['model_type']} weights imported from {source.absolute()}\n"
                    f"# by jaxtron convert-hf; fine-tune: {_fine_tune(out)}\n"
                    + yaml.safe_dump(preset, sort_keys=False))
            (into / "config.yaml").write_text(text)
            run_cfg = weights.config_of({"config": text})  # the preset loads through the schema
            meta = {"step": 0, "tokens_seen": 0, "config": text, "source": str(source.absolute()),
                    "hf_model_type": config_json["model_type"],
                    "hf_max_position_embeddings": config_json.get("max_position_embeddings"),
                    "hf_eos_token_id": eos,
                    "layer_order": list(range(cfg.num_layers))}
            top = hf_mapping.nest(hf_mapping.top_params(get, cfg))
            layers = _layers(get, cfg, rope_interleave(config_json))
            with _signals_held():  # a stop waits for the layer in hand (one partial save)
                weights.write_layers(into.absolute() / "checkpoints" / "0",  # Orbax: absolute
                                     top, layers, meta)
            return run_cfg, note
        except ConfigError:
            raise
        except (ValueError, KeyError) as err:  # a tensor that does not fit
            raise ConfigError(f"{source}: {err}") from None

    # written next to OUT and renamed to it; the paths written in it name OUT itself
    run_cfg, tokenizer_note = _write_new_dir(out, write)
    print(f"imported {cli.plural(cfg.num_layers, 'layer')} of {source} ({stored}) into "
          f"{out}/checkpoints/0 ({run_cfg.model.param_dtype}); preset: "
          f"model.dtype={run_cfg.model.dtype}, train.seq_len={run_cfg.train.seq_len}; "
          f"{tokenizer_note}")
    print(f"fine-tune: {_fine_tune(out)}")


def _layers(get: hf.Getter, cfg: ModelConfig, rope_interleave: bool) -> Iterator[dict]:
    """Each layer's params in our nested form, in model order, their paths inside the layer
    (weights.write_layers; its stack, `layers` or DeepSeek-V3's `dense_layers`, is the model
    layer's weights.layer_slots); a signal stops before the next. `rope_interleave`: config.json's
    (DeepSeek-V3): the import holds the rotated dims as halves, as our RoPE takes them."""
    for i, (stack, _) in enumerate(weights.layer_slots(cfg)):
        _stop_point()
        params = hf_mapping.layer_params(get, cfg, i, rope_interleave=rope_interleave)
        assert all(path[0] == stack for path in params), (i, stack)
        yield hf_mapping.nest({path[1:]: value for path, value in params.items()})


def _fine_tune(out: Path) -> str:
    """The command that fine-tunes an import, to paste into a shell."""
    return f"jaxtron train --config {shlex.quote(str(out / 'config.yaml'))}"


def export_model(source: Path, out: Path, model_type: str | None, dtype: str | None,
                 tokenizer: Path | None) -> None:
    """A checkpoint (any mesh, any pipeline layout) -> HF directory."""
    cfg, meta, get = weights.reader(source)
    _, step_dir = weights.locate(source)
    kind = model_type or meta.get("hf_model_type") or hf.model_type_of(cfg.model)
    tok = tokenizer_lib.from_path(tokenizer) if tokenizer else _run_tokenizer(cfg, meta)
    _check_outside_checkpoints(out, step_dir)

    source_ends = imported(cfg, meta, "hf_eos_token_id") or []
    # gpt-oss's experts come as MXFP4 from OpenAI and go out in a float dtype: bf16 by default
    dtype = dtype or ("bfloat16" if kind == "gpt_oss" else None)

    def write(into: Path) -> str:
        hf.write_pretrained(cfg.model, get, into, kind, dtype, _trained_context(cfg, meta),
                            token_ids=_token_ids(tok, source_ends) or None)
        if not tok:
            return "no tokenizer (pass --tokenizer)"
        note = _write_tokenizer(tok, into)
        if tokenizer_lib.SP_FILE in tok.files:
            config = _sentencepiece_config(tok)
            (into / tokenizer_lib.HF_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
            note += f" with {tokenizer_lib.HF_CONFIG} (add_bos_token)"
        return f"tokenizer: {note}"

    note = _write_new_dir(out, write)
    quantized = f"; every tensor in {dtype}, the experts too (not MXFP4)" if kind == "gpt_oss" \
        else ""
    print(f"exported step {meta['step']} of {step_dir} as {hf.ARCHITECTURES[kind]} to {out}"
          f"{quantized}; {note}")


def _trained_context(cfg, meta: dict) -> int:
    """config.json's max_position_embeddings: the context the model was trained at (the run's
    train.seq_len), or the imported model's own when longer (fine-tuning Llama 3 at 2048 keeps
    its 131,072), or Llama 3 scaling's original length. An import keeps its number in its meta;
    a run that fine-tuned one finds it through checkpoint.restore."""
    known = [cfg.train.seq_len, imported(cfg, meta, "hf_max_position_embeddings")]
    if cfg.model.rope_scaling_factor > 0:
        known.append(cfg.model.rope_original_max_len)
    return max(n for n in known if isinstance(n, int) and n > 0)


def imported(cfg, meta: dict, key: str):
    """meta[key] of an import (an hf_ key: what it kept of the Hugging Face directory), or of
    the import a run fine-tuned, found through checkpoint.restore (a run's own meta has none);
    None for a run trained from scratch, or when that import was moved or removed."""
    if key in meta or not cfg.checkpoint.restore or meta.get("layout") == weights.LAYERED:
        return meta.get(key)
    try:
        return weights.read_meta(weights.locate(cfg.checkpoint.restore)[1]).get(key)
    except (ConfigError, OSError):
        return None


def _token_ids(tok: tokenizer_lib.Tokenizer | None, source_ends: list[int]) -> dict:
    """config.json's and generation_config.json's ids: the tokenizer's bos, eos (its end_ids():
    the document end, and the chat turn's end that tokenizer_config.json may name as eos_token,
    as Llama 3 instruct's config.json lists them) and pad where it has one; the eos list gets
    `source_ends`, those of the directory the run was imported from, too ({} for neither)."""
    ends = tok.end_ids() if tok else []
    ends += [i for i in source_ends if i not in ends]
    ids: dict = {"bos_token_id": tok.bos_id()} if tok else {}
    if ends:
        ids["eos_token_id"] = ends[0] if len(ends) == 1 else ends
    pad = _pad_id(tok) if tok else None
    if pad is not None:
        ids["pad_token_id"] = pad
    return ids


def _pad_id(tok: tokenizer_lib.Tokenizer) -> int | None:
    """The pad id: a SentencePiece model's pad piece, or the pad_token tokenizer_config.json
    names beside a tokenizer.json; None where there is no such token."""
    if tokenizer_lib.SP_FILE in tok.files:
        pad = spm.SentencePieceProcessor(model_proto=tok.files[tokenizer_lib.SP_FILE]).pad_id()
        return pad if pad >= 0 else None
    config = json.loads(tok.files.get(tokenizer_lib.HF_CONFIG, b"{}"))  # checked by Tokenizer
    token = config.get("pad_token")
    token = token.get("content") if isinstance(token, dict) else token  # an AddedToken
    return tok.piece_to_id(token) if isinstance(token, str) else None


def _sentencepiece_config(tok: tokenizer_lib.Tokenizer) -> dict:
    """tokenizer_config.json beside an exported SentencePiece model. From the .model alone
    transformers (5.x) adds no BOS, where every training document starts with one, and a Qwen
    model_type picks Qwen2's tokenizer class, which splits text otherwise: the generic class and
    add_bos_token make AutoTokenizer encode as training did, [bos] + the model's pieces (the
    eos piece first when the model has no bos piece, as the data pipeline does)."""
    sp = spm.SentencePieceProcessor(model_proto=tok.files[tokenizer_lib.SP_FILE])
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "add_bos_token": True,
              "add_eos_token": False, "bos_token": tok.id_to_piece(tok.bos_id()),
              "eos_token": tok.id_to_piece(tok.eos_id())}
    for name, i in (("unk_token", sp.unk_id()), ("pad_token", sp.pad_id())):
        if i >= 0:
            config[name] = sp.id_to_piece(i)
    return config


def _run_tokenizer(cfg, meta: dict) -> tokenizer_lib.Tokenizer | None:
    """The tokenizer the run trained with: data.tokenizer, the prepared datasets' own, or the
    default corpus's. None for an import that came without one."""
    if meta.get("layout") == weights.LAYERED and not cfg.data.tokenizer:
        return None
    return prepared.dataset_tokenizer(cfg.data, cfg.model.vocab_size)


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(command="tools/convert_hf.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser("import", command="tools/convert_hf.py import",
                         help="Hugging Face directory -> jaxtron checkpoint and preset")
    imp.add_argument("hf_dir", type=Path)
    imp.add_argument("out_dir", type=Path)
    imp.add_argument("--dtype", choices=DTYPES, default="float32",
                     help="stored weights (model.param_dtype); default float32 master weights")
    imp.add_argument("--compute-dtype", choices=DTYPES,
                     help="the preset's model.dtype; default: the source weights' dtype")
    imp.add_argument("--allow-pickle", action="store_true",
                     help="read .bin/.pt weights (they run code when loaded: trusted sources only)")
    exp = sub.add_parser("export", command="tools/convert_hf.py export",
                         help="jaxtron checkpoint -> Hugging Face directory")
    exp.add_argument("ckpt_dir", type=Path, help="a checkpoint, or a run or import directory")
    exp.add_argument("hf_dir", type=Path)
    exp.add_argument("--model-type", choices=sorted(hf.ARCHITECTURES),
                     help="default: the imported model's, else the family that computes the "
                     "model: qwen3_moe (experts, q/k norms), mixtral (experts), qwen2 (QKV "
                     "biases), qwen3 (q/k norms), mistral (an attention window), else llama")
    exp.add_argument("--dtype", choices=DTYPES, help="default: the checkpoint's param dtype")
    exp.add_argument("--tokenizer", type=Path,
                     help="tokenizer file or directory to include (default: the run's own)")
    args = parser.parse_args(argv)
    if args.command == "import":
        run = lambda: import_model(args.hf_dir, args.out_dir, args.dtype, args.compute_dtype,
                                   args.allow_pickle)
    else:
        run = lambda: export_model(args.ckpt_dir, args.hf_dir, args.model_type, args.dtype,
                                   args.tokenizer)
    stopped_early = lifecycle.take_over_signals()
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    _signalled.clear()
    try:
        if stopped_early:
            raise KeyboardInterrupt
        for sig, handler in handlers.items():
            if handler is not signal.SIG_IGN:  # nohup's choice stays
                signal.signal(sig, _on_signal)
        return one_line_errors(run)
    except KeyboardInterrupt:
        print(f"{lifecycle.script_name()}: stopped by a signal; nothing was written to "
              f"{args.out_dir if args.command == 'import' else args.hf_dir} (run the command "
              "again)", file=sys.stderr)
        return EXIT_STOPPED
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        lifecycle.ignore_signals_when_done()

