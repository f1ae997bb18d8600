"""Tokenizers: a SentencePiece `.model` or a Hugging Face `tokenizer.json` behind one small class
with SentencePiece's method names, and the default SentencePiece model trained (once, cached) on
the default corpus.

`from_path` takes either file, or a directory holding one (tokenizer.json first: Hugging Face model
directories of Llama 2 or Mistral ship both, and the .json is what transformers loads). `encode`
adds no special tokens: the data pipeline puts BOS and EOS around every document itself. A
tokenizer.json splits its special tokens out of the text, as transformers does by default (a
document holding the text `<|end_of_text|>` gets that token), so the ids depend on tokenizer.json
alone and `sha256` (of that file) identifies them; BOS and EOS are kept apart (`bos_id`, `eos_id`).
A generation prompt starts as a document does (`encode_prompt`), and a continuation ends at the
document end or at the turn end a tokenizer_config.json names as its eos_token (`end_ids`).

BOS and EOS, the tokens each document starts and ends with:
- SentencePiece: the model's bos and eos pieces.
- tokenizer.json, EOS: `tokenizer_config.json`'s `eos_token` (beside the file), except that a chat
  turn's end (`<|eot_id|>` in Llama 3 instruct, `<|im_end|>` in Qwen2 instruct, ...) gives way to
  the family's document end when the vocabulary has one: documents end where a document does, so
  the base and instruct tokenizers of one family make the same data. With no config, or none naming
  an eos_token, the first of `<|end_of_text|>` (Llama 3), `<|endoftext|>` (Qwen2, GPT-2), `</s>`
  (Llama 2, Mistral), `<eos>` (Gemma) the vocabulary holds.
- tokenizer.json, BOS: the config's `bos_token` (null, or `add_bos_token: false`: none); with no
  config or no such key, the first of `<|begin_of_text|>` (Llama 3), `<s>` (Llama 2, Mistral),
  `<bos>` (Gemma) the vocabulary holds, else none.
- No BOS (Qwen2, GPT-2): the EOS id starts documents too, GPT-2's convention: the model sees the
  separator before a document's first token, as it does after the previous document's end.
A tokenizer without an EOS is refused.

The default tokenizer is BPE trained on the corpus's lines with settings for source code: no
normalisation, whitespace kept exactly (runs of spaces become pieces, so an indent is one token),
digits split, byte fallback so nothing is UNK. SentencePiece trains on sentences (lines) and never
sees a line break, so "\\n" is a user-defined symbol: always exactly one token, and encoding then
decoding a whole file gives it back byte for byte with the plain `SentencePieceProcessor` API.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import sentencepiece as spm

from jaxtron.config import ConfigError, DataConfig
from jaxtron.data import corpus

PAD_ID, UNK_ID, BOS_ID, EOS_ID = -1, 0, 1, 2  # no pad piece: padding is masked by segment_ids == 0

TRAINER_SETTINGS = {
    "model_type": "bpe",
    "normalization_rule_name": "identity",  # no NFKC: code must come back as written
    "remove_extra_whitespaces": False,
    "add_dummy_prefix": False,
    "allow_whitespace_only_pieces": True,  # indentation runs become single pieces
    "split_digits": True,
    "byte_fallback": True,
    "character_coverage": 0.9999,  # rarer characters go to byte pieces
    "user_defined_symbols": ["\n"],
    "max_sentence_length": 1 << 16,
    "input_sentence_size": 0,  # every line; ~2 s on 2 cores for the stdlib's 12 MB
    "unk_id": UNK_ID,
    "bos_id": BOS_ID,
    "eos_id": EOS_ID,
    "pad_id": PAD_ID,
}

# A tokenizer's files under the names a copy of it gets (a dataset's, a checkpoint's).
SP_FILE, HF_FILE, HF_CONFIG = "tokenizer.model", "tokenizer.json", "tokenizer_config.json"
# The default corpus (~13 MB of Python) trains at most ~108k pieces, and a Llama 3 preset asks
# 128,256: its tokenizer is capped at GPT-2's size, the rows above left for a real tokenizer's.
CORPUS_PIECES = 50304
FILE_NAMES = (HF_FILE, HF_CONFIG, SP_FILE)
DOC_STARTS = ("<|begin_of_text|>", "<s>", "<bos>")  # Llama 3; Llama 2, Mistral; Gemma
DOC_ENDS = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>")  # Llama 3; Qwen2, GPT-2; ...
TURN_ENDS = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>")  # instruct configs' eos


class Tokenizer:
    """A SentencePiece model or a Hugging Face tokenizer, with SentencePiece's method names."""

    def __init__(self, files: dict[str, bytes], where: str):
        """`files` maps FILE_NAMES to contents: SP_FILE, or HF_FILE and maybe HF_CONFIG; `where`
        opens error messages (the path or option the tokenizer came from)."""
        self.files = files  # what to copy to have this tokenizer elsewhere
        self.file = SP_FILE if SP_FILE in files else HF_FILE  # the file the ids depend on
        self.sha256 = hashlib.sha256(files[self.file]).hexdigest()
        self._sp = self._hf = None
        self._config: dict = {}  # tokenizer_config.json's settings (a tokenizer.json's)
        if self.file == SP_FILE:
            self._sp = _sentencepiece(files[SP_FILE], where)
            bos, eos = self._sp.bos_id(), self._sp.eos_id()
            self._size = self._sp.get_piece_size()
            if eos < 0:
                raise ConfigError(f"{where}: the SentencePiece model has no eos piece; train it "
                                  "with eos_id set")
        else:
            self._hf = _hf_tokenizer(files[HF_FILE], where)
            self._config = config = _hf_config(files.get(HF_CONFIG), where)
            eos = _hf_eos(self._hf, config, where)
            bos = _hf_bos(self._hf, config, where)
            self._size = max(self._hf.get_vocab(with_added_tokens=True).values()) + 1
        self._bos, self._eos = (bos if bos >= 0 else eos), eos

    def encode(self, text: str) -> list[int]:
        """The ids of `text`, with no BOS or EOS added."""
        if self._sp is not None:
            return self._sp.encode(text)
        return self._hf.encode(text, add_special_tokens=False).ids

    def encode_prompt(self, text: str) -> list[int]:
        """The ids of `text` as training starts a document: `bos_id()` then `encode(text)`, for
        both kinds (so Qwen2's prompts start with <|endoftext|>, which transformers does not
        add). A text that already starts with the BOS token (Llama 3's written out) keeps one."""
        ids = self.encode(text)
        return ids if ids[:1] == [self._bos] else [self._bos, *ids]

    def encode_batch(self, texts: Sequence[str], threads: int = 0) -> list[list[int]]:
        """`encode` of each text, on `threads` threads (0: every core). A tokenizer.json encodes on
        its library's own thread pool, sized by RAYON_NUM_THREADS (every core if unset)."""
        if self._sp is not None:
            return self._sp.encode(list(texts), num_threads=threads or os.cpu_count() or 1)
        return [e.ids for e in self._hf.encode_batch_fast(list(texts), add_special_tokens=False)]

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """The text of `ids`. SentencePiece drops its control pieces (bos, eos); a tokenizer.json
        writes special tokens out, so decoding `encode(text)` gives `text` back, unless
        `skip_special` (a continuation's text, without its `</s>`, as transformers'
        skip_special_tokens=True)."""
        ids = [int(i) for i in ids]
        if self._sp is not None:
            return self._sp.decode(ids)
        return self._hf.decode(ids, skip_special_tokens=skip_special)

    def bos_id(self) -> int:
        """The id each document starts with (the EOS id when the tokenizer has no BOS)."""
        return self._bos

    def eos_id(self) -> int:
        """The id each document ends with."""
        return self._eos

    def end_ids(self) -> list[int]:
        """The ids a generated continuation ends at: the document end, then the token a
        tokenizer_config.json names as eos_token when that is another (an instruct model's
        turn end, <|im_end|>), as an export's generation_config.json lists them."""
        token = _named(self._config, "eos_token")
        named = self._hf.token_to_id(token) if token is not None else None  # config: hf only
        return [self._eos] + ([named] if named not in (None, self._eos) else [])

    def get_piece_size(self) -> int:
        """One more than the largest id, added and special tokens included: the smallest
        model.vocab_size that fits."""
        return self._size

    def piece_to_id(self, piece: str) -> int | None:
        """The id of a token given as its text in the vocabulary; None if it has none."""
        if self._sp is not None:
            i = self._sp.piece_to_id(piece)
            return i if self._sp.id_to_piece(i) == piece else None
        return self._hf.token_to_id(piece)

    def id_to_piece(self, i: int) -> str:
        """The vocabulary's text of id `i`."""
        return self._sp.id_to_piece(i) if self._sp is not None else self._hf.id_to_token(i)


def from_path(path: str | Path) -> Tokenizer:
    """The tokenizer of a SentencePiece `.model`, a Hugging Face `tokenizer.json` (with the
    `tokenizer_config.json` beside it, if any), or a directory holding either (tokenizer.json
    first). A ConfigError's one line starts with `path` as given."""
    return _load(Path(path).expanduser(), str(path))


def _load(path: Path, where: str) -> Tokenizer:
    """from_path, with error messages opened by `where`."""
    if path.is_dir():
        found = [path / name for name in (HF_FILE, SP_FILE) if (path / name).is_file()]
        if not found:
            raise ConfigError(f"{where}: the directory holds no {HF_FILE} or {SP_FILE}")
        path, where = found[0], f"{where} ({found[0].name})"
    elif not path.is_file():
        raise ConfigError(f"{where}: no such file or directory; give a SentencePiece .model, a "
                          f"{HF_FILE}, or a directory holding one")
    if path.suffix != ".json":
        return Tokenizer({SP_FILE: path.read_bytes()}, where)
    config = path.parent / HF_CONFIG
    extra = {HF_CONFIG: config.read_bytes()} if config.is_file() else {}
    return Tokenizer({HF_FILE: path.read_bytes(), **extra}, where)


def _sentencepiece(model: bytes, where: str) -> spm.SentencePieceProcessor:
    """A SentencePiece processor of a serialized model."""
    try:
        return spm.SentencePieceProcessor(model_proto=model)
    except RuntimeError:
        raise ConfigError(f"{where}: not a SentencePiece model") from None


def _hf_tokenizer(text: bytes, where: str) -> Any:
    """A `tokenizers.Tokenizer` of a tokenizer.json's bytes."""
    try:
        import tokenizers  # only tokenizer.json needs it; transformers brings it
    except ImportError:
        raise ConfigError(f"{where}: reading a {HF_FILE} needs the tokenizers package "
                          "(pip install tokenizers)") from None
    try:
        return tokenizers.Tokenizer.from_str(text.decode("utf-8"))
    except Exception as e:  # noqa: BLE001 - tokenizers raises plain Exception on a bad file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{where}: not a Hugging Face {HF_FILE} ({reason})") from None


def _hf_config(text: bytes | None, where: str) -> dict:
    """The tokenizer_config.json beside a tokenizer.json, {} when there is none."""
    if text is None:
        return {}
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ConfigError(f"{where}: the {HF_CONFIG} beside it is not JSON ({e})") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{where}: the {HF_CONFIG} beside it is not a JSON object")
    return config


def _named(config: dict, key: str) -> str | None:
    """A config's special token: a string, or an AddedToken dict's "content"; None if unset."""
    value = config.get(key)
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _config_id(hf: Any, config: dict, key: str, where: str) -> int:
    """The id of the token the config names under `key`, which the vocabulary must hold."""
    token = _named(config, key)
    i = hf.token_to_id(token)
    if i is None:
        raise ConfigError(f"{where}: the {HF_CONFIG} beside it names {key} {token!r}, which is "
                          "not in the vocabulary")
    return i


def _hf_eos(hf: Any, config: dict, where: str) -> int:
    """The document end of a tokenizer.json (module docstring)."""
    named = _named(config, "eos_token")
    if named is not None and named not in TURN_ENDS:
        return _config_id(hf, config, "eos_token", where)
    for token in (*DOC_ENDS, named):
        if token is not None and hf.token_to_id(token) is not None:
            return hf.token_to_id(token)
    raise ConfigError(f"{where}: no end-of-document token (none of {' '.join(DOC_ENDS)} is in the "
                      f"vocabulary); add a {HF_CONFIG} beside it whose eos_token names the token "
                      "that ends a document")


def _hf_bos(hf: Any, config: dict, where: str) -> int:
    """The document start of a tokenizer.json (module docstring); -1 when it has none."""
    if config.get("add_bos_token") is False:
        return -1
    if "bos_token" in config:
        return -1 if _named(config, "bos_token") is None else _config_id(hf, config, "bos_token",
                                                                        where)
    ids = [hf.token_to_id(token) for token in DOC_STARTS]
    return next((i for i in ids if i is not None), -1)


def train_tokenizer(lines: list[str], vocab_size: int, setting: str = "model.vocab_size={}",
                    more_text: str = "more text") -> bytes:
    """A serialized SentencePiece model trained on `lines` (deterministic for given lines); a
    refusal names the fix in `setting`, the caller's name for the vocabulary size."""
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
            num_threads=min(os.cpu_count() or 1, 16), minloglevel=2, **TRAINER_SETTINGS,
        )
    except RuntimeError as e:
        reason = _trainer_advice(str(e).splitlines()[0] if str(e) else type(e).__name__,
                                 setting, more_text)
        message = f"cannot train a tokenizer with {setting.format(vocab_size)}: {reason}"
        raise ConfigError(message) from None
    return model.getvalue()


def _trainer_advice(reason: str, setting: str, more_text: str) -> str:
    """SentencePiece's reason for refusing to train, as what the user can change (its own advice
    names flags of its trainer, such as --character_coverage, that jaxtron has not)."""
    if found := re.search(r"smaller than required_chars\. \d+ vs (\d+)", reason):
        return (f"too few pieces for the sample's characters and the 256 byte pieces; use "
                f"{setting.format(found[1])} or more")
    if found := re.search(r"Vocabulary size too high \(\d+\)\. .* <= (\d+)", reason):
        return (f"the sample is too small for that many pieces; use {setting.format(found[1])} "
                f"or less, or {more_text}")
    if "!sentences_.empty()" in reason:  # every line is longer than the trainer takes
        return (f"no line of the text is shorter than {TRAINER_SETTINGS['max_sentence_length']:,} "
                "bytes, and longer lines are not trained on; give text with line breaks")
    return reason.split("] ")[-1] or reason


def load_tokenizer(data: DataConfig, vocab_size: int) -> Tokenizer:
    """`data.tokenizer` if given (anything `from_path` takes), else the default corpus's
    SentencePiece model of model.vocab_size pieces, at most CORPUS_PIECES (trained once, cached)."""
    if data.tokenizer:
        return _load(Path(data.tokenizer).expanduser(), f"data.tokenizer={data.tokenizer}")
    files = corpus.source_files(data)
    settings = repr(sorted(TRAINER_SETTINGS.items())).encode()
    key = hashlib.sha256(corpus.files_digest(files).encode() + settings).hexdigest()[:16]
    vocab_size = min(vocab_size, CORPUS_PIECES)
    path = corpus.cache_dir(data) / f"tokenizer-{data.source}-{vocab_size}-{key}.model"
    if not path.is_file():
        lines = [line for text in corpus.read_texts(files) for line in text.split("\n") if line]
        corpus.write_atomic(path, train_tokenizer(lines, vocab_size))
    return _load(path, str(path))
