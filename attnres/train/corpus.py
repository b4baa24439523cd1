"""A corpus as tokens (``Corpus``) and the tokenizers that make text into tokens: a byte-level
BPE trained on the corpus (``train_bpe``, ``encode``) and a saved model's own (``encode_text``).
The corpora's sources build on it: ``data.py`` (named corpora, the standard library, text files)
and ``hf_shards.py`` (``hf:`` datasets, token folders).
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..cache import cache_dir
from .frozen_corpus import tokens_sha256


@dataclass
class Corpus:
    """Train and validation tokens (1-D integer arrays) and the tokenizer's vocabulary size."""

    train: np.ndarray
    val: np.ndarray
    vocab_size: int
    description: str

    def sha256(self) -> str:
        """A SHA-256 over the train and then the validation tokens (with their dtype and
        length), 64 hex digits: equal for two runs that read the same data."""
        return tokens_sha256(self.train, self.val)

    def digest(self) -> str:
        """The first 16 hex digits of ``sha256``: ``summary.json``'s ``data_sha256``. The
        standard library's corpus is the installed interpreter's, so two machines' runs of one
        command with ``data.source=stdlib`` may read different data; the digest tells that apart
        from their arithmetic."""
        return self.sha256()[:16]


def kind_of(path: Path) -> str:
    """What ``path`` is, in words, when it is neither a file nor a folder."""
    mode = path.stat().st_mode
    for test, name in ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device")):
        if test(mode):
            return name
    return "neither a file nor a folder"


def train_bpe(train: np.ndarray, vocab_size: int, key: str, directory: Path | None = None):
    """A byte-level BPE trained on (up to 20 MB of) the training bytes, cached by content key."""
    try:
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError:
        raise ValueError("data.tokenizer='bpe' needs the 'tokenizers' package: pip install tokenizers") from None
    directory = Path(directory) if directory else cache_dir()
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"bpe-{vocab_size}-{key}.json"
    if path.exists():
        return Tokenizer.from_file(str(path)), path
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    text = bytes(train[:20_000_000]).decode("utf-8", errors="replace")
    tok.train_from_iterator([text[i : i + 100_000] for i in range(0, len(text), 100_000)], trainer)
    tmp = path.with_suffix(".tmp")
    tok.save(str(tmp))
    os.replace(tmp, path)
    return tok, path


def encode(tok, data: np.ndarray, limit: int | None = None) -> np.ndarray:
    """``data`` (UTF-8 bytes) as the ids of the BPE ``tok``, in chunks of a million characters,
    up to ``limit`` tokens: the chunks past it are not tokenized (the ids are those of the whole
    text's, cut at ``limit``)."""
    text = bytes(data).decode("utf-8", errors="replace")
    ids = []
    for i in range(0, len(text), 1_000_000):
        if limit is not None and len(ids) >= limit:
            break
        ids.extend(tok.encode(text[i : i + 1_000_000]).ids)
    return np.asarray(ids[:limit], dtype=np.int32)


def encode_text(tokenizer, data: np.ndarray, limit: int | None = None, chunk: int = 1_000_000) -> np.ndarray:
    """``data`` (UTF-8 bytes, ``uint8``) as the token ids of ``tokenizer`` (``encode(text)``
    without special tokens), in chunks of ``chunk`` characters, up to ``limit`` tokens (the
    chunks past it are not tokenized). A chunk boundary may split a word the tokenizer would
    have kept whole; at a million characters that is rare."""
    text = bytes(data).decode("utf-8", errors="replace")
    ids: list[int] = []
    for i in range(0, len(text), chunk):
        if limit is not None and len(ids) >= limit:
            break
        ids.extend(tokenizer.encode(text[i : i + chunk], add_special_tokens=False))
    return np.asarray(ids[:limit], dtype=np.int64)
