"""Data loaders on real files: the standard library, text folders, token files, BPE."""

import numpy as np
import pytest
import torch

from attnres.train.config import DataConfig
from attnres.train.data import (
    batch_at,
    is_validation,
    load_corpus,
    stdlib_files,
    stdlib_root,
)


def test_stdlib_split_is_by_file_and_excludes_tests():
    root = stdlib_root()
    files = stdlib_files(root)
    assert len(files) > 300
    rels = [p.relative_to(root).as_posix() for p in files]
    assert not any("/test/" in f"/{r}" or "site-packages" in r for r in rels)
    val = [r for r in rels if is_validation(r, 0.05)]
    assert 0.02 < len(val) / len(rels) < 0.09
    assert [is_validation(r, 0.05) for r in rels] == [is_validation(r, 0.05) for r in rels]


def test_stdlib_corpus_is_real_python_source():
    corpus = load_corpus(DataConfig(max_train_tokens=100_000, max_val_tokens=50_000), 256)
    text = bytes(corpus.train[:20_000]).decode("utf-8", errors="replace")
    assert "def " in text and "import " in text
    assert corpus.vocab_size == 256 and len(corpus.val) == 50_000


def test_text_folder_splits_by_file(tmp_path):
    for i in range(30):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i} " * 50)
    (tmp_path / "image.png").write_bytes(b"\x89PNG not text")
    corpus = load_corpus(DataConfig(source=str(tmp_path), val_fraction=0.2), 256)
    assert len(corpus.train) + len(corpus.val) == sum(len(f"document {i} " * 50) for i in range(30))
    assert b"PNG" not in bytes(corpus.train) + bytes(corpus.val)
    assert len(corpus.val) > 0


def test_single_text_file_holds_out_its_tail(tmp_path):
    f = tmp_path / "book.txt"
    f.write_text("abcdefghij" * 100)
    corpus = load_corpus(DataConfig(source=str(f), val_fraction=0.1), 256)
    assert len(corpus.train) == 900 and len(corpus.val) == 100


def test_token_files(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    (np.arange(200, dtype=np.uint16) + 7).tofile(tmp_path / "val.bin")
    corpus = load_corpus(DataConfig(source=str(tmp_path)), 1024)
    assert corpus.train[5] == 5 and corpus.val[0] == 7 and corpus.vocab_size == 1024
    with pytest.raises(ValueError, match=r"train.bin holds token id 999, outside the model's vocabulary \[0, 256\)"):
        load_corpus(DataConfig(source=str(tmp_path)), 256)


def test_missing_paths_and_short_corpora(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_corpus(DataConfig(source=str(tmp_path / "nope")), 256)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="holds no text files"):
        load_corpus(DataConfig(source=str(tmp_path / "empty")), 256)
    with pytest.raises(ValueError, match="shorter than one sequence"):
        batch_at(np.zeros(10, dtype=np.uint8), 2, 32, 0, 0)


def test_batches_depend_on_seed_and_step_only():
    tokens = np.arange(10_000, dtype=np.int64) % 256
    a = batch_at(tokens, 4, 16, seed=3, index=7)
    b = batch_at(tokens, 4, 16, seed=3, index=7)
    c = batch_at(tokens, 4, 16, seed=3, index=8)
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])
    x, y = a
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one


def test_bpe_tokenizer_is_trained_and_cached(tmp_path, monkeypatch):
    monkeypatch.delenv("ATTNRES_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    (tmp_path / "text.txt").write_text("the quick brown fox jumps over the lazy dog. " * 400)
    cfg = DataConfig(source=str(tmp_path / "text.txt"), tokenizer="bpe", bpe_vocab_size=300)
    corpus = load_corpus(cfg, 256)
    assert 256 < corpus.vocab_size <= 300
    assert len(corpus.train) < 0.5 * 0.95 * len("the quick brown fox jumps over the lazy dog. " * 400)
    cached = list((tmp_path / "cache" / "attnres").glob("bpe-300-*.json"))
    assert len(cached) == 1
    again = load_corpus(cfg, 256)
    assert np.array_equal(again.train, corpus.train)


def test_one_cache_folder_for_tokenizers_and_kernels(tmp_path, monkeypatch):
    from attnres.cache import cache_dir

    monkeypatch.delenv("ATTNRES_CACHE_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "attnres"
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path / "mine"))
    assert cache_dir() == tmp_path / "mine"
    (tmp_path / "text.txt").write_text("a small corpus for a tokenizer. " * 300)
    load_corpus(DataConfig(source=str(tmp_path / "text.txt"), tokenizer="bpe", bpe_vocab_size=280), 256)
    assert len(list((tmp_path / "mine").glob("bpe-280-*.json"))) == 1
