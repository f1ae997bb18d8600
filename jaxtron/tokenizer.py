"""SentencePiece tokenizers: load a given model, or train (once, cached) one on the default corpus.

The default tokenizer is BPE trained on the corpus's lines with settings for source code: no
normalisation, whitespace kept exactly (runs of spaces become pieces, so an indent is one token),
digits split, byte fallback so nothing is UNK. SentencePiece trains on sentences (lines) and never
sees a line break, so "\\n" is a user-defined symbol: always exactly one token, and encoding then
decoding a whole file gives it back byte for byte with the plain `SentencePieceProcessor` API.
"""

from __future__ import annotations

import hashlib
import io
import os
import tempfile
from pathlib import Path

import sentencepiece as spm

from jaxtron.config import ConfigError, DataConfig

PAD_ID, UNK_ID, BOS_ID, EOS_ID = -1, 0, 1, 2  # no pad piece: padding is masked by segment_ids == 0

TRAINER_SETTINGS = dict(
    model_type="bpe",
    normalization_rule_name="identity",  # no NFKC: code must come back as written
    remove_extra_whitespaces=False,
    add_dummy_prefix=False,
    allow_whitespace_only_pieces=True,  # indentation runs become single pieces
    split_digits=True,
    byte_fallback=True,
    character_coverage=0.9999,  # rarer characters go to byte pieces
    user_defined_symbols=["\n"],
    max_sentence_length=1 << 16,
    input_sentence_size=0,  # every line; ~2 s on 2 cores for the stdlib's 12 MB
    unk_id=UNK_ID,
    bos_id=BOS_ID,
    eos_id=EOS_ID,
    pad_id=PAD_ID,
)


def cache_dir(data: DataConfig) -> Path:
    """Where derived files (tokenizers, token arrays) are cached."""
    path = data.cache_dir or os.environ.get("JAXTRON_CACHE") or Path.home() / ".cache" / "jaxtron"
    return Path(path).expanduser()


def write_atomic(path: Path, payload: bytes) -> None:
    """Write a file so that readers see either nothing or all of it, even with racing writers."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; a shared cache should be readable by others
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def train_tokenizer(lines: list[str], vocab_size: int) -> bytes:
    """A serialized SentencePiece model trained on `lines` (deterministic for given lines)."""
    model = io.BytesIO()
    try:
        spm.SentencePieceTrainer.train(
            sentence_iterator=iter(lines), model_writer=model, vocab_size=vocab_size,
            num_threads=min(os.cpu_count() or 1, 16), minloglevel=2, **TRAINER_SETTINGS,
        )
    except RuntimeError as e:
        reason = str(e).splitlines()[0].split("] ")[-1] if str(e) else type(e).__name__
        message = f"cannot train a tokenizer with model.vocab_size={vocab_size}: {reason}"
        raise ConfigError(message) from None
    return model.getvalue()


def load_tokenizer(data: DataConfig, vocab_size: int) -> spm.SentencePieceProcessor:
    """`data.tokenizer` if given, else the default corpus's tokenizer (trained once, cached)."""
    if data.tokenizer:
        path = Path(data.tokenizer).expanduser()
        if not path.is_file():
            raise ConfigError(f"data.tokenizer={data.tokenizer}: no such SentencePiece model file")
        return spm.SentencePieceProcessor(model_file=str(path))
    from jaxtron import data as data_lib  # local: data.py imports this module

    files = data_lib.source_files(data)
    settings = repr(sorted(TRAINER_SETTINGS.items())).encode()
    key = hashlib.sha256(data_lib.files_digest(files).encode() + settings).hexdigest()[:16]
    path = cache_dir(data) / f"tokenizer-{data.source}-{vocab_size}-{key}.model"
    if not path.is_file():
        lines = [line for text in data_lib.read_texts(files) for line in text.split("\n") if line]
        write_atomic(path, train_tokenizer(lines, vocab_size))
    return spm.SentencePieceProcessor(model_file=str(path))
