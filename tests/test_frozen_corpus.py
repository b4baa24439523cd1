"""The default corpus, sdists-v1: the same bytes on every machine and Python, its committed
digest checked where it is read, and a run's data_sha256 pinned."""

import json
import shutil
import sysconfig

import numpy as np
import pytest

from attnres.names import CORPUS_NAMES
from attnres.train.config import DataConfig, preset
from attnres.train.data import load_corpus
from attnres.train.frozen_corpus import (
    DEFAULT_CORPUS,
    FROZEN,
    SDISTS_V1,
    is_validation,
    kept_text,
    read_frozen,
    tokens_sha256,
)

#: the tiny preset's tokens (its first 200,000 training and 20,000 validation bytes of sdists-v1)
TINY_DATA_SHA256 = "e285f2bbe43e89f6"


def test_the_corpus_files_digest_is_the_committed_one():
    """The files on this machine (built by `attnres corpus` in `make setup`) hash to the digest
    written in the code, and corpus.json records it with its sdists' pins."""
    train, val = read_frozen(SDISTS_V1)
    assert tokens_sha256(np.fromfile(SDISTS_V1.folder / "train.bin", dtype=np.uint8),
                         np.fromfile(SDISTS_V1.folder / "val.bin", dtype=np.uint8)) == SDISTS_V1.sha256
    meta = json.loads((SDISTS_V1.folder / "corpus.json").read_text())
    assert meta["sha256"] == SDISTS_V1.sha256 and meta["train_tokens"] == len(train) > 100_000_000
    assert meta["val_tokens"] == len(val) > 3_000_000
    assert [(s["name"], s["version"], s["sha256"]) for s in meta["sdists"]] == [
        (s.name, s.version, s.sha256) for s in SDISTS_V1.sdists]
    assert DataConfig().source == DEFAULT_CORPUS == "sdists-v1" and list(FROZEN) == list(CORPUS_NAMES)


def test_a_tiny_run_reads_the_tokens_a_test_holds(tmp_path):
    """The tiny preset's corpus digest, from load_corpus and from a run's summary.json, equals
    the literal above; its text is English prose and Python from several of the projects."""
    from attnres.train.trainer import train

    data = preset("tiny").data
    corpus = load_corpus(data, 256)
    assert corpus.digest() == TINY_DATA_SHA256 and (len(corpus.train), len(corpus.val)) == (200_000, 20_000)
    text = bytes(corpus.train).decode("utf-8", errors="replace")
    assert "def " in text and " the " in text
    cfg = preset("tiny")
    cfg.run.steps, cfg.run.progress, cfg.run.tensorboard = 1, False, False
    summary = train(cfg, tmp_path / "run").summary
    assert summary["data_sha256"] == TINY_DATA_SHA256 and summary["data"].startswith("corpus sdists-v1: ")


def test_the_corpus_does_not_depend_on_the_interpreters_library(tmp_path, monkeypatch):
    """With sysconfig's standard-library path pointed at another folder, data.source=stdlib reads
    that folder, and the default corpus the same bytes as before."""
    before = load_corpus(DataConfig(max_train_tokens=50_000, max_val_tokens=5_000), 256).digest()
    (tmp_path / "lib" / "pkg").mkdir(parents=True)
    for i in range(40):
        (tmp_path / "lib" / "pkg" / f"mod{i}.py").write_text(f"def f{i}():\n    return {i}\n" * 20)
    paths = {**sysconfig.get_paths(), "stdlib": str(tmp_path / "lib")}
    monkeypatch.setattr(sysconfig, "get_paths", lambda *a, **k: paths)
    stdlib = load_corpus(DataConfig(source="stdlib"), 256)
    assert len(stdlib.train) + len(stdlib.val) == sum(len(f"def f{i}():\n    return {i}\n" * 20) for i in range(40))
    assert load_corpus(DataConfig(max_train_tokens=50_000, max_val_tokens=5_000), 256).digest() == before


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """``(the corpus's folder on this machine, an empty one)``: the cache is now the test's own."""
    real = SDISTS_V1.folder
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path / "cache"))
    SDISTS_V1.folder.mkdir(parents=True)
    return real, SDISTS_V1.folder


def test_a_changed_corpus_is_refused_naming_both_digests(elsewhere):
    real, copy = elsewhere
    for name in ("val.bin", "corpus.json"):
        shutil.copy(real / name, copy / name)
    train = np.fromfile(real / "train.bin", dtype=np.uint8)
    train[12345] ^= 1
    train.tofile(copy / "train.bin")
    changed = tokens_sha256(train, np.fromfile(real / "val.bin", dtype=np.uint8))
    with pytest.raises(ValueError) as err:
        load_corpus(DataConfig(), 256)
    assert str(err.value) == (f"corpus sdists-v1 in {copy} has digest {changed}, but attnres expects "
                              f"{SDISTS_V1.sha256}: its files were changed or built by another rule; remove {copy} "
                              f"and run `attnres corpus` to fetch and build it again")


def test_a_missing_corpus_says_how_to_get_it(elsewhere):
    with pytest.raises(ValueError, match=r"corpus sdists-v1 is not on this machine \(looked in .*\): `attnres corpus` "
                                         r"downloads its 9 sdists from PyPI with pip"):
        load_corpus(DataConfig(), 256)


@pytest.mark.parametrize("name, data, kept", [
    ("django-5.2.19/docs/intro/overview.txt", b"Django was invented to meet fast-moving newsroom deadlines.\n", True),
    ("sympy-1.14.0/sympy/core/basic.py", b"def f(x):\n    return x + 1\n", True),
    ("django-5.2.19/Django.egg-info/SOURCES.txt", b"django/__init__.py\n", False),
    ("django-5.2.19/django/conf/locale/fr/LC_MESSAGES/django.po", b'msgid "Hello"\nmsgstr "Bonjour"\n', False),
    ("django-5.2.19/tests/data/raster.numpy.txt", b"0.125 0.25 1.0 2.5 3.75\n" * 100, False),
    ("twisted-26.10.0/docs/latin1.txt", "caf\u00e9\n".encode("latin-1"), False),
    ("sympy-1.14.0/empty.py", b"", True),
])
def test_which_files_of_an_sdist_the_corpus_keeps(name, data, kept):
    assert kept_text(name, data) is kept


def test_the_split_is_a_fixed_share_of_files_by_their_paths_hash():
    names = [f"project-1.0/docs/page{i}.rst" for i in range(4000)]
    held = [n for n in names if is_validation(n, SDISTS_V1.val_share)]
    assert 0.02 < len(held) / len(names) < 0.04
    assert held == [n for n in names if is_validation(n, SDISTS_V1.val_share)]


@pytest.mark.slow
def test_attnres_corpus_downloads_and_builds_the_committed_bytes(tmp_path):
    """`attnres corpus` in an empty cache: pip downloads the pinned sdists (their hashes
    required) and the build gives the committed digest (the files are byte-identical to the
    machine's own)."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, ATTNRES_CACHE_DIR=str(tmp_path))
    done = subprocess.run([sys.executable, "-m", "attnres", "corpus"], capture_output=True, text=True, env=env,
                          check=False, timeout=600)
    assert done.returncode == 0, done.stderr
    built = tmp_path / "corpora" / "sdists-v1"
    assert done.stdout.strip().splitlines()[-1] == str(built)
    for name in ("train.bin", "val.bin", "corpus.json"):
        assert (built / name).read_bytes() == (SDISTS_V1.folder / name).read_bytes()
