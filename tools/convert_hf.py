"""Hugging Face model directories to jaxtron checkpoints and back, one tensor at a time.

    python tools/convert_hf.py import ~/Llama-3.2-1B imports/llama3_1b
    python launch.py --config imports/llama3_1b/config.yaml          # fine-tune it, on any mesh
    python tools/convert_hf.py export runs/llama3_1b hf/llama3_1b    # the newest checkpoint of a run

`import` reads `config.json` and the safetensors weights (sharded with an index or not; pickled
`.bin`/`.pt` only with --allow-pickle, which needs PyTorch) and writes OUT_DIR/checkpoints/0 (the
weights, one layer per Orbax partial save), OUT_DIR/config.yaml (a preset that fine-tunes them:
the model section read from config.json, the tokenizer copied beside it, checkpoint.restore and
weights_only set) and the tokenizer files. `export` takes a checkpoint saved on any mesh or
pipeline layout (a step directory, or the newest of a run or import directory) and writes
config.json (with `architectures`), safetensors shards with an index, and the run's tokenizer files.
Host memory stays near one layer plus the largest tensor either way. Bad input: one line, exit 2.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

if __name__ == "__main__":  # first: a Python without jaxtron gets one line naming the fix
    import _environment  # noqa: F401

import yaml

from jaxtron import cli, hf, hf_mapping, prepared, weights
from jaxtron import tokenizer as tokenizer_lib
from jaxtron.cli import one_line_errors
from jaxtron.config import ConfigError, ModelConfig

DTYPES = ("float32", "bfloat16", "float16")
CONTEXT = 2048  # the preset's train.seq_len, or the model's own context when shorter


def _fresh_dir(path: Path) -> None:
    """Make the output directory, refusing one that already holds something (nothing is
    overwritten) or a place that cannot hold one."""
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{path} is a file; name a new output directory")
    if path.is_dir() and any(path.iterdir()):
        raise ConfigError(f"{path} already exists and is not empty; choose a new output directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cannot make the output directory {path}: {e.strerror}") from None


def _context(config_json: dict) -> int:
    """The preset's train.seq_len: the model's max_position_embeddings when it is a positive
    count below CONTEXT, else CONTEXT (a longer context fine-tunes at CONTEXT first)."""
    limit = config_json.get("max_position_embeddings")
    return limit if isinstance(limit, int) and 0 < limit < CONTEXT else CONTEXT


def _preset(cfg: ModelConfig, out: Path, tokenizer: str | None,
            context: int, compute_dtype: str) -> dict:
    """The config preset that fine-tunes an imported model."""
    skip = {"scan_layers", "remat", "attention", "attention_check", "collective_matmul",
            "init_std"} | (set() if cfg.sliding_window else {"sliding_window"})
    model = {f: getattr(cfg, f) for f in ModelConfig.__dataclass_fields__ if f not in skip}
    preset = {
        "model": {**model, "dtype": compute_dtype},
        "train": {"seq_len": min(context, CONTEXT, cfg.sliding_window or CONTEXT)},
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


def _import_tokenizer(source: Path, out: Path) -> tuple[str | None, str]:
    """Copy the directory's tokenizer next to the checkpoint: (its file for data.tokenizer, or
    None without a usable one; a line saying what was copied or why not)."""
    try:
        tok = tokenizer_lib.from_path(source)
    except ConfigError as err:
        return None, f"no tokenizer copied ({err}); set data.tokenizer before training on text"
    return tok.file, f"tokenizer: {_write_tokenizer(tok, out)}"


def import_model(source: Path, out: Path, dtype: str, compute_dtype: str | None,
                 allow_pickle: bool) -> None:
    """HF directory -> OUT_DIR/{checkpoints/0, config.yaml, tokenizer files}."""
    if not source.is_dir():
        raise ConfigError(f"{source}: {'not a' if source.exists() else 'no such'} directory; "
                          "give a Hugging Face model directory (config.json and *.safetensors)")
    config_json = hf.read_hf_config(source)  # its own message when there is none
    cfg = hf.read_config(source, dtype)
    get = hf.check_tensors(source, cfg, allow_pickle)
    stored = get("model.embed_tokens.weight").dtype.name
    compute_dtype = compute_dtype or (stored if stored in DTYPES else "float32")
    _fresh_dir(out)
    try:
        tokenizer_file, tokenizer_note = _import_tokenizer(source, out)
        preset = _preset(cfg, out, tokenizer_file, _context(config_json), compute_dtype)
        text = (f"# {config_json['model_type']} weights imported from {source.absolute()}\n"
                f"# by tools/convert_hf.py; fine-tune: python launch.py --config {out}/config.yaml\n"
                + yaml.safe_dump(preset, sort_keys=False))
        (out / "config.yaml").write_text(text)
        run_cfg = weights.config_of({"config": text})  # the preset loads through the schema
        meta = {"step": 0, "tokens_seen": 0, "config": text, "source": str(source.absolute()),
                "hf_model_type": config_json["model_type"],
                "hf_max_position_embeddings": config_json.get("max_position_embeddings"),
                "layer_order": list(range(cfg.num_layers))}
        layers = (hf_mapping.nest({path[1:]: value for path, value  # path[0] is "layers"
                                   in hf_mapping.layer_params(get, cfg, i).items()})
                  for i in range(cfg.num_layers))
        weights.write_layers(out.absolute() / "checkpoints" / "0",  # Orbax takes no relative path
                             hf_mapping.nest(hf_mapping.top_params(get, cfg)), layers, meta)
    except (ValueError, KeyError) as err:
        shutil.rmtree(out, ignore_errors=True)  # nothing half-written is left to be mistaken
        raise ConfigError(f"{source}: {err}") from None
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    print(f"imported {cli.plural(cfg.num_layers, 'layer')} of {source} ({stored}) into "
          f"{out}/checkpoints/0 ({run_cfg.model.param_dtype}); preset: "
          f"model.dtype={run_cfg.model.dtype}, train.seq_len={run_cfg.train.seq_len}; {tokenizer_note}")
    print(f"fine-tune: python launch.py --config {out}/config.yaml")


def export_model(source: Path, out: Path, model_type: str | None, dtype: str | None,
                 tokenizer: Path | None) -> None:
    """A checkpoint (any mesh, any pipeline layout) -> HF directory."""
    cfg, meta, get = weights.reader(source)
    _, step_dir = weights.locate(source)
    kind = model_type or meta.get("hf_model_type") or ("qwen2" if cfg.model.qkv_bias else "llama")
    tok = tokenizer_lib.from_path(tokenizer) if tokenizer else _run_tokenizer(cfg, meta)
    _fresh_dir(out)
    try:
        hf.write_pretrained(cfg.model, get, out, kind, dtype, _trained_context(cfg, meta))
        note = f"tokenizer: {_write_tokenizer(tok, out)}" if tok else "no tokenizer (pass --tokenizer)"
    except BaseException:
        shutil.rmtree(out, ignore_errors=True)
        raise
    print(f"exported step {meta['step']} of {step_dir} as {hf.ARCHITECTURES[kind]} to {out}; "
          f"{note}")


def _trained_context(cfg, meta: dict) -> int:
    """config.json's max_position_embeddings: the context the model was trained at (the run's
    train.seq_len), or the imported model's own when longer (fine-tuning Llama 3 at 2048 keeps
    its 131,072), or Llama 3 scaling's original length. An import keeps its number in its meta;
    a run that fine-tuned one finds it through checkpoint.restore."""
    known = [cfg.train.seq_len, meta.get("hf_max_position_embeddings")]
    if cfg.model.rope_scaling_factor > 0:
        known.append(cfg.model.rope_original_max_len)
    if cfg.checkpoint.restore and meta.get("layout") != weights.LAYERED:
        try:
            known.append(weights.read_meta(weights.locate(cfg.checkpoint.restore)[1])
                         .get("hf_max_position_embeddings"))
        except (ConfigError, OSError):
            pass  # the import was moved or removed: the run's own length stands
    return max(n for n in known if isinstance(n, int) and n > 0)


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
                     help="default: the imported model's, else qwen2 with QKV biases, else llama")
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
    return one_line_errors(run)


if __name__ == "__main__":
    sys.exit(main())
