"""``data.source=hf:NAME[:CONFIG]`` streamed into token shards in the cache, and folders of token
files read back (``attnres/train/hf_shards.py``). Offline: the datasets are folders of JSON lines
written here, read by the real ``datasets`` and tokenized by real tokenizers."""

import json
import threading
from pathlib import Path

import numpy as np
import pytest

from attnres.train.config import DataConfig, apply_overrides, tiny
from attnres.train.data import is_validation, load_corpus
from attnres.train.hf_shards import SHARDS_JSON, hf_shards
from attnres.train.validate import check_run
from tests.conftest import cli_in_process

WORDS = "the of residual attention layer block depth query key value stream token".split()


def document(i: int) -> str:
    """Document ``i``: a few dozen words, different for each ``i``."""
    rng = np.random.default_rng(i)
    return f"document {i}: " + " ".join(WORDS[k] for k in rng.integers(0, len(WORDS), 12 + i % 9))


def write_jsonl(path: Path, docs: list[str]) -> None:
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))


@pytest.fixture(autouse=True)
def offline(monkeypatch, tmp_path):
    """No Hub, and the cache in the test's own folder."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path / "cache"))


@pytest.fixture
def with_split(tmp_path):
    """A dataset folder with a train and a validation file."""
    folder = tmp_path / "with-split"
    folder.mkdir()
    write_jsonl(folder / "train.jsonl", [document(i) for i in range(300)])
    write_jsonl(folder / "validation.jsonl", [document(i) for i in range(1000, 1040)])
    return folder


@pytest.fixture
def without_split(tmp_path):
    """A dataset folder with one file of documents: its validation is chosen by hash."""
    folder = tmp_path / "one-file"
    folder.mkdir()
    write_jsonl(folder / "data.jsonl", [document(i) for i in range(200)])
    return folder


def text(tokens) -> bytes:
    """Byte tokens (stored as uint16) as the bytes they are."""
    return bytes(np.asarray(tokens, dtype=np.uint8))


def shard_folders(tmp_path) -> list[Path]:
    return sorted(p for p in (tmp_path / "cache" / "shards").iterdir() if p.is_dir())


def states(folder: Path) -> dict:
    """Each file of ``folder`` with its inode and modification time: what a rewrite changes."""
    return {p.name: (p.stat().st_ino, p.stat().st_mtime_ns) for p in folder.iterdir()}


def test_shards_are_written_once_and_read_back(tmp_path, with_split, capfd):
    cfg = DataConfig(source=f"hf:{with_split}", max_train_tokens=5000, max_val_tokens=1000)
    first = load_corpus(cfg, 256)
    assert "data: tokenizing hf:" in capfd.readouterr().err
    [folder] = shard_folders(tmp_path)
    meta = json.loads((folder / SHARDS_JSON).read_text())
    assert meta["dataset"] == str(with_split) and meta["config"] is None and meta["revision"].startswith("files:")
    assert (meta["tokenizer"], meta["vocab_size"], meta["dtype"]) == ("byte", 256, "uint16")
    assert meta["tokens"] == {"train": 5000, "val": 1000} and meta["validation"] == "the validation split"
    assert meta["digest"] == first.digest() and first.vocab_size == 256 and first.train.dtype == np.uint16
    assert text(first.train).startswith((document(0) + "\n" + document(1) + "\n").encode())
    assert text(first.val).startswith((document(1000) + "\n").encode())
    before = states(folder)

    second = load_corpus(cfg, 256)  # the same settings: read from disk, nothing tokenized or rewritten
    err = capfd.readouterr().err
    assert "reading the token shards" in err and "tokenizing" not in err
    assert states(folder) == before and second.digest() == first.digest()
    assert second.description == first.description

    as_folder = load_corpus(DataConfig(source=str(folder)), 64)  # --data SHARDS_FOLDER: the folder's vocabulary
    assert as_folder.vocab_size == 256 and as_folder.digest() == first.digest()

    write_jsonl(with_split / "train.jsonl", [document(i) for i in range(1, 301)])  # the data changed: new shards
    assert load_corpus(cfg, 256).digest() != first.digest() and len(shard_folders(tmp_path)) == 2


def test_validation_by_document_hash(tmp_path, without_split):
    cfg = DataConfig(source=f"hf:{without_split}", val_fraction=0.2, max_train_tokens=10**6)
    corpus = load_corpus(cfg, 256)
    docs = [document(i) for i in range(200)]
    held = [d for d in docs if is_validation(d, 0.2)]
    assert 0 < len(held) < 100
    assert text(corpus.val) == "".join(d + "\n" for d in held).encode()
    assert text(corpus.train) == "".join(d + "\n" for d in docs if d not in held).encode()
    meta = json.loads((shard_folders(tmp_path)[0] / SHARDS_JSON).read_text())
    assert meta["documents"] == {"train": 200 - len(held), "val": len(held)}
    assert meta["validation"].startswith("documents hashed")


def test_bpe_is_trained_on_the_stream_and_saved_with_the_shards(tmp_path, without_split):
    cfg = DataConfig(source=f"hf:{without_split}", tokenizer="bpe", bpe_vocab_size=300, max_train_tokens=2000,
                     val_fraction=0.2)
    corpus = load_corpus(cfg, 256)
    [folder] = shard_folders(tmp_path)
    meta = json.loads((folder / SHARDS_JSON).read_text())
    assert meta["tokenizer"] == "bpe" and corpus.vocab_size == meta["vocab_size"] > 256
    assert (folder / meta["tokenizer_file"]).is_file()
    assert len(corpus.train) == 2000 and int(corpus.train.max()) >= 256  # merges were used
    with pytest.raises(ValueError, match=r"data.tokenizer='model' but .* made with data.tokenizer='bpe'"):
        load_corpus(DataConfig(source=str(folder), tokenizer="model"), 256)


def large_vocab_tokenizer(size: int):
    """A real fast tokenizer (what a model folder's ``AutoTokenizer`` gives) of ``size`` words."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(WORDS)} | {f"w{i}": i for i in range(len(WORDS), size - 1)}
    tok = Tokenizer(models.WordLevel(vocab | {"[UNK]": size - 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def test_a_vocabulary_past_65536_is_stored_as_uint32(tmp_path, with_split):
    tokenizer = large_vocab_tokenizer(70_000)
    cfg = DataConfig(source=f"hf:{with_split}", tokenizer="model", max_train_tokens=3000, max_val_tokens=500)
    corpus = load_corpus(cfg, 70_000, tokenizer=tokenizer)
    assert corpus.train.dtype == np.uint32 and corpus.vocab_size == 70_000
    assert int(corpus.train.max()) == 69_999  # "document" and "0:" are unknown words
    [folder] = shard_folders(tmp_path)
    meta = json.loads((folder / SHARDS_JSON).read_text())
    assert (meta["dtype"], meta["tokenizer"], meta["vocab_size"]) == ("uint32", "model", 70_000)
    read = load_corpus(DataConfig(source=str(folder)), 256)  # byte, the default, reads the folder's tokens
    assert read.vocab_size == 70_000 and read.train.dtype == np.uint32 and read.digest() == corpus.digest()
    with pytest.raises(ValueError, match=r"data.tokenizer='bpe' but .* made with data.tokenizer='model'"):
        load_corpus(DataConfig(source=str(folder), tokenizer="bpe"), 256)


def test_max_train_tokens_is_required(tmp_path, with_split):
    cfg = apply_overrides(tiny(), [f"data.source=hf:{with_split}", "data.max_train_tokens=None"])
    proc = cli_in_process("train", "--preset", "tiny", "--set", f"data.source=hf:{with_split}", "--set",
                          "data.max_train_tokens=None", "--run-dir", tmp_path / "run")
    assert proc.returncode == 2 and "needs data.max_train_tokens" in proc.stderr, proc.stderr
    assert not (tmp_path / "run").exists()
    check_run(cfg)  # a saved config is still read back (export, report): the check is a new run's
    with pytest.raises(ValueError, match=r"needs data.max_train_tokens"):
        load_corpus(cfg.data, 256)
    assert not (tmp_path / "cache").exists()


def test_a_hub_name_offline_is_refused_naming_what_to_do(tmp_path):
    cfg = DataConfig(source="hf:attnres-test/no-such-dataset:cfg", max_train_tokens=1000)
    with pytest.raises(ValueError, match=r"cannot reach .*HF_DATASETS_OFFLINE") as err:
        load_corpus(cfg, 256)
    shards = tmp_path / "cache" / "shards"
    assert f"here to {shards}/attnres-test--no-such-dataset--cfg-" in str(err.value) and "--data" in str(err.value)
    proc = cli_in_process("train", "--preset", "tiny", "--set", "data.source=hf:attnres-test/no-such-dataset",
                          "--run-dir", tmp_path / "run")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "cannot reach" in lines[0], proc.stderr


def test_two_processes_making_the_same_shards_wait_for_one(tmp_path, without_split, capfd):
    cfg = DataConfig(source=f"hf:{without_split}", max_train_tokens=4000, val_fraction=0.2)
    folders = []
    threads = [threading.Thread(target=lambda: folders.append(hf_shards(cfg, 256))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(folders) == 2 and folders[0] == folders[1] and shard_folders(tmp_path) == [folders[0]]
    assert capfd.readouterr().err.count("tokenized ") == 1
    assert sorted(p.name for p in folders[0].iterdir()) == ["shards.json", "train.bin", "val.bin"]


def test_a_nanogpt_folder_reads_as_before(tmp_path):
    np.arange(1000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(200, dtype=np.uint16).tofile(tmp_path / "val.bin")
    corpus = load_corpus(DataConfig(source=str(tmp_path)), 1024)
    assert corpus.vocab_size == 1024 and corpus.train.dtype == np.uint16
    assert corpus.description == f"token files in {tmp_path}"
    with pytest.raises(ValueError, match="data.tokenizer='bpe' must stay 'byte'"):
        load_corpus(DataConfig(source=str(tmp_path), tokenizer="bpe"), 1024)


def test_train_on_a_streamed_dataset_records_the_shards_digest(tmp_path, with_split):
    run = tmp_path / "run"
    proc = cli_in_process("train", "--preset", "tiny", "--set", f"data.source=hf:{with_split}",
                          "--set", "data.max_train_tokens=8000", "--set", "data.max_val_tokens=2000",
                          "--set", "run.steps=2", "--set", "run.eval_batches=1", "--set", "run.progress=false",
                          "--set", "run.tensorboard=false", "--run-dir", run)
    assert proc.returncode == 0, proc.stderr
    [folder] = shard_folders(tmp_path)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["data_sha256"] == json.loads((folder / SHARDS_JSON).read_text())["digest"]


def test_attnres_shards_makes_the_shards_a_run_reads_and_trains_nothing(tmp_path, with_split):
    """`attnres shards` with a run's settings prints the folder of the shards that run reads (made
    here: what an offline machine is told to do elsewhere); a source that is not hf: is refused."""
    settings = ["--preset", "tiny", "--data", f"hf:{with_split}", "--set", "data.max_train_tokens=3000"]
    proc = cli_in_process("shards", *settings)
    assert proc.returncode == 0, proc.stderr
    folder = Path(proc.stdout.strip().splitlines()[-1])
    assert shard_folders(tmp_path) == [folder] and "tokenizing" in proc.stderr
    again = cli_in_process("shards", *settings)
    assert again.stdout == proc.stdout and "nothing to tokenize" in again.stderr
    assert not list(tmp_path.glob("runs*"))
    refused = cli_in_process("shards", "--preset", "tiny")
    assert refused.returncode == 2 and "makes the token shards of an hf:NAME[:CONFIG] source" in refused.stderr


def test_a_model_vocabulary_other_than_the_shards_is_refused(tmp_path, with_split):
    """A folder with ``shards.json`` names its vocabulary; a ``--set model.vocab_size`` that differs
    from it is refused before any work (the model would otherwise take the folder's, silently)."""
    made = cli_in_process("shards", "--preset", "tiny", "--data", f"hf:{with_split}", "--set", "data.max_train_tokens=3000")
    assert made.returncode == 0, made.stderr
    folder = Path(made.stdout.strip().splitlines()[-1])
    vocab = json.loads((folder / SHARDS_JSON).read_text())["vocab_size"]
    run = tmp_path / "run"
    refused = cli_in_process("train", "--preset", "tiny", "--data", folder, "--set", f"model.vocab_size={vocab + 44}",
                             "--run-dir", run)
    assert refused.returncode != 0 and not run.exists()
    assert (f"model.vocab_size={vocab + 44}" in refused.stderr and f"{vocab}-token" in refused.stderr
            and str(folder / SHARDS_JSON) in refused.stderr), refused.stderr
    same = cli_in_process("train", "--preset", "tiny", "--data", folder, "--set", f"model.vocab_size={vocab}",
                          "--set", "run.steps=2", "--set", "run.eval_batches=1", "--run-dir", run)
    assert same.returncode == 0, same.stderr
    assert json.loads((run / "config.json").read_text())["model"]["vocab_size"] == vocab
