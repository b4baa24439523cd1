"""Text corpora as byte tokens.

The embedded default is the Python standard library's own source files: real text that every
Python install carries, so nothing is downloaded. The split into train and validation is by
file (a stable hash of the relative path), so no file contributes to both.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

import numpy as np
import torch

EXCLUDED_DIRS = {"test", "tests", "site-packages", "dist-packages", "idlelib", "__pycache__"}


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


def is_validation(relative_path: str, val_fraction: float) -> bool:
    """Deterministic per-file split: the same file always lands on the same side."""
    digest = hashlib.sha256(relative_path.encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < val_fraction


def split_files(files: list[Path], root: Path, val_fraction: float) -> tuple[list[Path], list[Path]]:
    train, val = [], []
    for p in files:
        (val if is_validation(p.relative_to(root).as_posix(), val_fraction) else train).append(p)
    return train, val


def read_bytes(files: list[Path], max_bytes: int | None = None) -> np.ndarray:
    """Concatenate files as uint8 tokens (byte b is token b), up to ``max_bytes``."""
    chunks, total = [], 0
    for p in files:
        data = p.read_bytes()
        chunks.append(np.frombuffer(data, dtype=np.uint8))
        total += len(data)
        if max_bytes is not None and total >= max_bytes:
            break
    tokens = np.concatenate(chunks) if chunks else np.zeros(0, dtype=np.uint8)
    return tokens[:max_bytes] if max_bytes is not None else tokens


def stdlib_corpus(val_fraction: float = 0.05, max_train_bytes: int | None = None,
                  max_val_bytes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Byte tokens ``(train, val)`` of the standard library sources, split by file."""
    root = stdlib_root()
    train_files, val_files = split_files(stdlib_files(root), root, val_fraction)
    return read_bytes(train_files, max_train_bytes), read_bytes(val_files, max_val_bytes)


def random_batch(tokens: np.ndarray, batch_size: int, seq_len: int, generator: torch.Generator):
    """``(inputs, targets)`` ``[B, T]`` int64 at random offsets drawn from ``generator``."""
    if len(tokens) < seq_len + 1:
        raise ValueError(
            f"corpus of {len(tokens)} tokens is shorter than one sequence of {seq_len} + 1 tokens"
        )
    starts = torch.randint(0, len(tokens) - seq_len, (batch_size,), generator=generator)
    window = np.stack([tokens[s : s + seq_len + 1] for s in starts.tolist()]).astype(np.int64)
    window = torch.from_numpy(window)
    return window[:, :-1], window[:, 1:]
