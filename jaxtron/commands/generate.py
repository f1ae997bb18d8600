"""Continue a prompt with a model, to check it by eye: greedy by default, or sampled.

    jaxtron generate ~/Llama-3.2-1B --prompt "The capital of France is"
    jaxtron generate runs/tiny --prompt "def main(" --temperature 0.8 --top-p 0.95
    jaxtron generate runs/tiny/checkpoints/200 --tokens 1,523,99 --max-new-tokens 16

PATH is a Hugging Face directory (config.json and *.safetensors) or a jaxtron run, checkpoints or
checkpoint directory. --prompt text is encoded by the model's tokenizer (a tokenizer.json or
tokenizer.model in PATH; else the run's own: data.tokenizer, its datasets' or the default
corpus's) and starts with the BOS training puts before every document (Qwen2's <|endoftext|>
too, which transformers does not add); the continuation is printed as text without special
tokens. --tokens takes comma-separated ids, fed as given (no BOS added: put it first yourself),
and prints the new ids the same way. Generation stops after --max-new-tokens or at any
end-of-sequence id: a Hugging Face directory's (its generation_config.json, else config.json),
else the tokenizer's (its document end, and the turn end its tokenizer_config.json names), read
for --tokens too; a jaxtron import, and a run fine-tuned from one, also stop at the ids of the
directory it was imported from (Llama 3.1 instruct's <|eom_id|>, which no tokenizer file
names). Greedy output equals transformers' generate(do_sample=False) for the same ids.
Bad input: one line on stderr, exit 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable
from pathlib import Path

from jaxtron import cli, hf, lifecycle
from jaxtron.checkpoint import weights
from jaxtron.cli import plural
from jaxtron.commands import convert_hf
from jaxtron.config import ConfigError, ModelConfig
from jaxtron.data import prepared, tokenizer
from jaxtron.lifecycle import one_line_errors
from jaxtron.model.generate import check, generate, prompt_array
from jaxtron.program import xla_flags


@dataclasses.dataclass(frozen=True)
class Loaded:
    """A model read from PATH, with what generation needs to know about it."""

    cfg: ModelConfig
    params: dict
    max_len: int | None  # positions the model takes (None: not recorded)
    limit: str  # where max_len comes from, for the error message
    open_tokenizer: Callable[[], tokenizer.Tokenizer]  # a ConfigError if there is none
    eos_ids: list[int]  # ids that end a continuation, from config files or an import's meta
    with_tokenizer_ends: bool  # whether the tokenizer's end ids end it too


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = cli.Parser(command="tools/generate.py", description=__doc__.splitlines()[0])
    parser.add_argument("path", type=Path, metavar="PATH",
                        help="a Hugging Face directory or a jaxtron run/checkpoint directory")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--prompt", help="text to continue (needs the tokenizer in PATH)")
    source.add_argument("--tokens", type=token_ids,
                        help="token ids to continue, e.g. 1,2,3, fed as given: no BOS is added")
    parser.add_argument("--max-new-tokens", type=int, default=64, metavar="N",
                        help="tokens to generate at most (default 64; an end-of-text stops sooner)")
    parser.add_argument("--temperature", type=float, default=0.0, metavar="T",
                        help="0 (default): greedy; > 0: sample from softmax(logits / T)")
    parser.add_argument("--top-k", type=int, default=0, metavar="K",
                        help="sample among the K most likely tokens (0: all)")
    parser.add_argument("--top-p", type=float, default=1.0, metavar="P",
                        help="then among the fewest whose probability reaches P, in (0, 1]")
    parser.add_argument("--seed", type=int, default=0, metavar="S",
                        help="the sampling seed (default 0; the same seed, the same text)")
    return parser.parse_args(argv)


def token_ids(text: str) -> list[int]:
    """'1,2, 3' -> [1, 2, 3]; anything else (no id, an empty item, a word, a negative id) is a
    usage error."""
    try:
        ids = [int(part) for part in text.split(",")]  # int() takes the spaces around an id
    except ValueError:  # a word, or nothing between two commas
        ids = [-1]
    if min(ids) < 0:
        raise argparse.ArgumentTypeError(f"'{text}' is not a list of token ids (0 or more), such "
                                         "as 1,2,3")
    return ids


def main(argv: list[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    args = parse_args(argv)
    return one_line_errors(lambda: run(args))


def run(args: argparse.Namespace) -> None:
    """Load PATH, encode the prompt, generate, print."""
    check(args.max_new_tokens, args.temperature, args.top_k, args.top_p, flags=True)  # first
    model = load(args.path)
    tok = model.open_tokenizer() if args.prompt is not None else None
    prompt = tok.encode_prompt(args.prompt) if tok else args.tokens  # BOS first, as trained
    prompt_array(model.cfg, prompt)  # ids the model has, before their count
    _check_length(model, len(prompt), args.max_new_tokens)
    eos = model.eos_ids
    if model.with_tokenizer_ends:
        ends = _tokenizer_ends(model, tok, args.max_new_tokens, known=bool(eos))
        eos = ends + [i for i in eos if i not in ends]
    new = generate(model.cfg, model.params, prompt, args.max_new_tokens,
                   temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                   seed=args.seed, eos_id=eos or None)
    print(tok.decode(new, skip_special=True) if tok else ",".join(map(str, new)))


def _tokenizer_ends(model: Loaded, tok: tokenizer.Tokenizer | None, max_new: int,
                    known: bool) -> list[int]:
    """The tokenizer's end ids, read for --tokens too; none when there is no tokenizer to read
    them from, with a note on stderr unless other end ids are `known`."""
    try:
        return (tok or model.open_tokenizer()).end_ids()
    except ConfigError as err:
        if known:
            return []
        reason = str(err).split(";")[0]
        print(f"{lifecycle.script_name()}: note: no end-of-sequence id known ({reason}); "
              f"generating all {plural(max_new, 'token')}", file=sys.stderr)
        return []


def load(path: Path) -> Loaded:
    """A Hugging Face directory (config.json) or a jaxtron checkpoint, run or checkpoints dir."""
    if not path.expanduser().exists():
        raise ConfigError(f"{path}: no such file or directory")
    xla_flags.start_backend()  # before the weights go to a device: one that cannot start, one line
    if (path.expanduser() / "config.json").is_file():
        return _load_hf(path.expanduser())
    return _load_checkpoint(path)


def _load_hf(path: Path) -> Loaded:
    """Weights in float32; the position limit and end ids from the directory's JSON files."""
    config = hf.read_hf_config(path)  # its own one-line error first
    cfg, params = hf.from_pretrained(path)
    eos = hf.eos_ids(path, config)

    def open_tokenizer() -> tokenizer.Tokenizer:
        if not _has_tokenizer(path):
            raise ConfigError(f"{path}: no tokenizer.json or tokenizer.model; --prompt needs "
                              "one: give --tokens ids instead")
        return tokenizer.from_path(path)

    return Loaded(cfg, params, config.get("max_position_embeddings"),
                  "max_position_embeddings in config.json", open_tokenizer, eos, not eos)


def _load_checkpoint(path: Path) -> Loaded:
    """Params as saved; the limit is the sequence length the run trained on; end ids are the
    run's tokenizer's and those its import recorded from the Hugging Face directory."""
    cfg, params = weights.read_params(path)
    meta = weights.read_meta(weights.locate(path)[1])

    def open_tokenizer() -> tokenizer.Tokenizer:
        if _has_tokenizer(path):
            return tokenizer.from_path(path)
        # an import without one: the default corpus's would be trained for a foreign vocabulary
        if meta.get("layout") == weights.LAYERED and not cfg.data.tokenizer:
            raise ConfigError(f"{path}: imported without a tokenizer; --prompt needs one: "
                              "give --tokens ids instead")
        return prepared.dataset_tokenizer(cfg.data, cfg.model.vocab_size)  # the run's own

    return Loaded(cfg.model, params, cfg.train.seq_len, "train.seq_len it was trained with",
                  open_tokenizer, convert_hf.imported(cfg, meta, "hf_eos_token_id") or [], True)


def _has_tokenizer(path: Path) -> bool:
    """Whether the directory holds a tokenizer file that tokenizer.from_path reads."""
    return any((path / name).is_file() for name in ("tokenizer.json", "tokenizer.model"))


def _check_length(model: Loaded, prompt_len: int, max_new: int) -> None:
    """The prompt and the continuation fit in the positions the model takes."""
    if model.max_len is None or prompt_len + max_new <= model.max_len:
        return
    if prompt_len >= model.max_len:
        raise ConfigError(f"the prompt is {plural(prompt_len, 'token')}, more than the model "
                          f"takes ({model.max_len}, {model.limit}); shorten it")
    raise ConfigError(f"the prompt ({plural(prompt_len, 'token')}) and --max-new-tokens {max_new} "
                      f"pass the {model.max_len} positions the model takes ({model.limit}); use "
                      f"--max-new-tokens {model.max_len - prompt_len} or less")

