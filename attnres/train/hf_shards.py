"""Token shards: a Hugging Face dataset streamed and tokenized into the cache, and folders of
token files (``train.bin``/``val.bin``) read back.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from .data import Corpus, kind_of


def token_file_corpus(folder: Path, vocab_size: int):
    """nanoGPT-style ``train.bin`` and ``val.bin``: uint16 token ids, memory-mapped."""
    out = []
    for name in ("train.bin", "val.bin"):
        path = folder / name
        if not path.exists():
            raise ValueError(f"token folder {folder} lacks {name}")
        if not path.is_file():
            raise ValueError(f"{path} is {'a folder' if path.is_dir() else kind_of(path)}, not a file of uint16 tokens")
        size = path.stat().st_size
        if size == 0:
            raise ValueError(f"{path} is empty: a token file holds uint16 token ids, 2 bytes each")
        if size % 2:
            raise ValueError(f"{path} holds {size} bytes, an odd number: a token file holds uint16 token ids, 2 bytes "
                             f"each; was it cut short?")
        tokens = np.memmap(path, dtype=np.uint16, mode="r")
        if len(tokens) and int(tokens.max()) >= vocab_size:
            raise ValueError(
                f"{path} holds token id {int(tokens.max())}, outside the model's vocabulary [0, {vocab_size})"
            )
        out.append(tokens)
    return out[0], out[1]


def hf_text(spec: str, val_fraction: float) -> tuple[bytes, bytes]:
    try:
        import datasets
    except ImportError:
        raise ValueError(f"data.source={spec!r} needs the 'datasets' package: pip install datasets") from None
    name, _, config = spec[len("hf:"):].partition(":")
    ds = datasets.load_dataset(name, config or None, split="train")
    column = "text" if "text" in ds.column_names else ds.column_names[0]
    texts = ds[column]
    cut = max(1, int(len(texts) * (1 - val_fraction)))
    join = lambda rows: "\n".join(rows).encode()  # noqa: E731
    return join(texts[:cut]), join(texts[cut:])



def shard_folder_corpus(folder: Path, cfg, model_vocab_size: int) -> Corpus:
    """A folder of token files (``train.bin``, ``val.bin``) as a ``Corpus``."""
    if cfg.tokenizer != "byte":
        raise ValueError(f"{folder} holds pre-tokenized files; data.tokenizer={cfg.tokenizer!r} must stay 'byte'")
    train, val = token_file_corpus(folder, model_vocab_size)
    return Corpus(train[: cfg.max_train_tokens], val[: cfg.max_val_tokens], model_vocab_size,
                  f"token files in {folder}")


def hf_corpus(cfg, model_vocab_size: int, tokenizer=None, bpe_dir: Path | None = None) -> Corpus:
    """``data.source=hf:NAME[:CONFIG]`` as a ``Corpus``."""
    from .data import encode, train_bpe  # noqa: F401

    train_text, val_text = hf_text(cfg.source, cfg.val_fraction)
    train, val = np.frombuffer(train_text, np.uint8), np.frombuffer(val_text, np.uint8)
    return Corpus(train[: cfg.max_train_tokens], val[: cfg.max_val_tokens], 256,
                  f"Hugging Face dataset {cfg.source[3:]}, byte tokens")
