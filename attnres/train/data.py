"""Corpora as token arrays, and deterministic batches.

The default is a named, versioned corpus whose bytes are the same on every machine and every
Python (``frozen_corpus.py``: ``sdists-v1``, the documentation and source of nine Python
projects, fetched once by ``attnres corpus``). ``stdlib`` reads the installed interpreter's
standard library sources instead (another Python reads other bytes: runs and tables made on it
say which Python's). Either is split into train and validation by file (a stable hash of the
relative path), so no file contributes to both.

Other sources: any text file or folder (a run folder inside it left out: ``text_files``), folders
of token files (``train.bin``/``val.bin``), and ``hf:NAME[:CONFIG]``, a Hugging Face dataset
streamed into token shards (``hf_shards.py``). Tokens are bytes by
default; ``tokenizer="bpe"`` trains a byte-level BPE on the training split with the
``tokenizers`` library and caches it; it reads text, so each file must be UTF-8 unless
``decode_errors="replace"`` (``check_utf8``).

Batches are a pure function of ``(seed, step)``: every design of a comparison sees the same
batches in the same order, and a resumed run continues with exactly the batches it would have seen.
"""

from __future__ import annotations

import hashlib
import platform
import sysconfig
from pathlib import Path

import numpy as np
import torch

from .config import DATA_SEED_STRIDE
from .corpus import Corpus, encode, encode_text, kind_of, train_bpe
from .frozen_corpus import frozen, is_validation, read_frozen  # noqa: F401 (is_validation: read here by its users)
from .lock import LOCK_FILE
from .run_files import RUN_FILES

EXCLUDED_DIRS = {"test", "tests", "site-packages", "dist-packages", "idlelib", "__pycache__"}
TEXT_SUFFIXES = {".txt", ".md", ".rst", ".py", ".c", ".h", ".js", ".html", ".json", ".csv", ".tex"}


# -- the standard library ------------------------------------------------------------------

def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(root: Path | None = None) -> list[Path]:
    """Sorted ``.py`` files of the standard library, tests and third-party packages excluded."""
    root = root or stdlib_root()
    files = [
        p for p in root.rglob("*.py")
        if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts[:-1])
        and not p.name.startswith("test_")
    ]
    return sorted(files)


def split_files(files: list[Path], root: Path, val_fraction: float) -> tuple[list[Path], list[Path]]:
    train, val = [], []
    for p in files:
        (val if is_validation(p.relative_to(root).as_posix(), val_fraction) else train).append(p)
    return train, val


def check_utf8(path: Path, data: bytes) -> None:
    """``ValueError`` naming ``path`` and its first byte that is not UTF-8 (its offset in the
    file): a tokenizer that reads text would read it as U+FFFD. Checked per file, whole, before
    any slicing (a slice may cut a character that the file holds whole)."""
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text: byte 0x{data[err.start]:02x} at offset {err.start} "
                         f"({err.reason}); data.tokenizer='bpe' reads text: convert the file to UTF-8, or set "
                         f"data.decode_errors=replace to read such bytes as U+FFFD") from None


def read_bytes(files: list[Path], utf8: bool = False) -> np.ndarray:
    """Concatenate files as uint8 tokens (byte b is token b); with ``utf8``, each file checked to
    be UTF-8 text (``check_utf8``)."""
    chunks = []
    for p in files:
        data = p.read_bytes()
        if utf8:
            check_utf8(p, data)
        chunks.append(np.frombuffer(data, dtype=np.uint8))
    return np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint8)


def stdlib_corpus(val_fraction: float = 0.05, utf8: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Byte tokens ``(train, val)`` of the standard library sources, split by file."""
    root = stdlib_root()
    train_files, val_files = split_files(stdlib_files(root), root, val_fraction)
    return read_bytes(train_files, utf8), read_bytes(val_files, utf8)


# -- other sources ---------------------------------------------------------------------------

def is_run_file(path: Path, root: Path) -> bool:
    """Whether ``path`` (under the data folder ``root``) is a file of a training run: it lies,
    under one of the names a run writes (``RUN_FILES``, a cached BPE tokenizer ``bpe-*.json``),
    in a folder that holds a run's lock (``.lock``, made as the run starts). A run folder
    inside its own data folder (``--data D --run-dir D/run``) would otherwise add its config,
    summary and tokenizer to the corpus once it has written them: a resumed run would train on
    other data than it started on. A comparison's or a sweep's folder inside the data folder
    (``compare --data D --out D/runs``: ``compare.json`` or ``sweep.json`` beside its runs) is
    left out whole, its report and results with it."""
    rel = path.relative_to(root).parts
    for depth in range(len(rel)):
        folder = root.joinpath(*rel[:depth])
        if depth and ((folder / "compare.json").is_file() or (folder / "sweep.json").is_file()):
            return True
        if (folder / LOCK_FILE).is_file():
            name = rel[depth]
            if name in RUN_FILES or (depth == len(rel) - 1 and name.startswith("bpe-") and name.endswith(".json")):
                return True
    return False


def text_files(path: Path) -> list[Path]:
    """The text file ``path``, or the text files of folder ``path`` (by suffix, ``TEXT_SUFFIXES``)
    but a run's own files (``is_run_file``)."""
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise ValueError(f"data path {path} is {kind_of(path)}; data.source takes a text file, a folder of text "
                         f"files or of train.bin/val.bin token files")
    files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in TEXT_SUFFIXES
                   and not is_run_file(p, path))
    if not files:
        raise ValueError(f"data folder {path} holds no text files (suffixes {sorted(TEXT_SUFFIXES)})")
    return files


def text_corpus(path: Path, val_fraction: float, utf8: bool = False):
    """Bytes of a text file or folder: split by file when there are several, else the last
    ``val_fraction`` of the one file is validation; with ``utf8``, each file UTF-8 text."""
    files = text_files(path)
    if len(files) == 1:
        data = read_bytes(files, utf8=utf8)
        cut = int(len(data) * (1 - val_fraction))
        train, val = data[:cut], data[cut:]
    else:
        train_files, val_files = split_files(files, path, val_fraction)
        if not val_files:  # tiny folders: hold out the last file
            train_files, val_files = files[:-1], files[-1:]
        train, val = read_bytes(train_files, utf8=utf8), read_bytes(val_files, utf8=utf8)
    return train, val


# -- entry point -----------------------------------------------------------------------------

def is_path_source(source: str) -> bool:
    """Whether ``data.source`` names a file or folder (not a named corpus, ``stdlib`` or an
    ``hf:`` dataset): a name wins over a folder of that name in the working directory (write
    ``./NAME`` for the folder)."""
    return frozen(source) is None and source != "stdlib" and not source.startswith("hf:")


def load_corpus(cfg, model_vocab_size: int, bpe_dir: Path | None = None, tokenizer=None) -> Corpus:
    """The corpus ``cfg`` (a ``DataConfig``) describes, tokenized: with ``tokenizer="model"``
    by ``tokenizer`` (a model folder's, ``encode(text) -> ids``; ``model_vocab_size`` its
    model's vocabulary)."""
    src = cfg.source
    # a tokenizer that reads text (BPE, a model folder's) needs UTF-8; bytes need no check
    utf8 = cfg.tokenizer in ("bpe", "model") and cfg.decode_errors == "strict"
    if frozen(src) is not None:  # UTF-8 text by construction (frozen_corpus.kept_text)
        train, val = read_frozen(frozen(src))
        desc = frozen(src).describe()
    elif src == "stdlib":
        train, val = stdlib_corpus(cfg.val_fraction, utf8=utf8)
        desc = f"Python {platform.python_version()} standard library sources, split by file"
    elif src.startswith("hf:"):
        from .hf_shards import hf_corpus

        return hf_corpus(cfg, model_vocab_size, tokenizer=tokenizer, bpe_dir=bpe_dir)
    else:
        path = Path(src).expanduser()
        if not path.exists():
            raise ValueError(f"data path {path} does not exist")
        if path.is_dir() and (path / "train.bin").exists():
            from .hf_shards import shard_folder_corpus

            return shard_folder_corpus(path, cfg, model_vocab_size)
        train, val = text_corpus(path, cfg.val_fraction, utf8)
        desc = f"text from {path}"
    vocab = 256
    if cfg.tokenizer == "model":
        train, val = encode_text(tokenizer, train, cfg.max_train_tokens), encode_text(tokenizer, val, cfg.max_val_tokens)
        vocab = model_vocab_size
        desc += ", the model's tokenizer"
    elif cfg.tokenizer == "bpe":
        key = hashlib.sha256(desc.encode() + str(len(train)).encode()).hexdigest()[:12]
        tok, _ = train_bpe(train, cfg.bpe_vocab_size, key, bpe_dir)
        train, val = encode(tok, train, cfg.max_train_tokens), encode(tok, val, cfg.max_val_tokens)
        vocab = tok.get_vocab_size()
        desc += f", byte-level BPE ({vocab} tokens)"
    else:
        desc += ", byte tokens"
    return Corpus(train[: cfg.max_train_tokens], val[: cfg.max_val_tokens], vocab, desc)


def check_length(tokens: np.ndarray, seq_len: int, split: str) -> None:
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"the {split} split has {len(tokens)} tokens, shorter than one sequence of "
            f"run.seq_len={seq_len} + 1 tokens"
        )


#: the seed of the evaluation batches (``batch_at``), the same for every run and design
EVAL_SEED = 20_260_315


def batch_at(tokens: np.ndarray, batch_size: int, seq_len: int, seed: int, index: int):
    """Batch number ``index`` of a run seeded ``seed``: ``(inputs, targets)`` ``[B, T]`` int64
    at offsets drawn from a generator seeded by ``(seed, index)`` alone."""
    g = torch.Generator().manual_seed(seed * DATA_SEED_STRIDE + index)
    return random_batch(tokens, batch_size, seq_len, g)


def random_batch(tokens: np.ndarray, batch_size: int, seq_len: int, generator: torch.Generator):
    """``(inputs, targets)`` ``[B, T]`` int64 at random offsets drawn from ``generator``."""
    check_length(tokens, seq_len, "data")
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator).tolist()
    window = torch.from_numpy(np.stack([np.asarray(tokens[s : s + seq_len + 1], dtype=np.int64) for s in starts]))
    return window[:, :-1], window[:, 1:]
