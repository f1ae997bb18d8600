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
from pathlib import Path

import sentencepiece as spm

from jaxtron import corpus
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
    files = corpus.source_files(data)
    settings = repr(sorted(TRAINER_SETTINGS.items())).encode()
    key = hashlib.sha256(corpus.files_digest(files).encode() + settings).hexdigest()[:16]
    path = corpus.cache_dir(data) / f"tokenizer-{data.source}-{vocab_size}-{key}.model"
    if not path.is_file():
        lines = [line for text in corpus.read_texts(files) for line in text.split("\n") if line]
        corpus.write_atomic(path, train_tokenizer(lines, vocab_size))
    return spm.SentencePieceProcessor(model_file=str(path))
