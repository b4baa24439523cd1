"""What a new user's folders and files meet: a run recognized by its config, not by a file name;
data read as the user wrote it, or refused naming the file; exports and conversions a serving
account can read and no partial folder left behind; a run whose ``latest`` is gone still read."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import cli_in_process

QUIET = ["--set", "run.progress=false", "--set", "run.tensorboard=false"]
TINY = ["--preset", "tiny", *QUIET]


def files_of(folder: Path) -> dict:
    """Every file under ``folder`` (links too, by their target's name) with its bytes: what a
    refusal must leave as it was."""
    out = {}
    for p in sorted(Path(folder).rglob("*")):
        if p.is_symlink():
            out[p] = ("link", os.readlink(p))
        elif p.is_file():
            out[p] = p.read_bytes()
    return out


def one_line(proc) -> str:
    """The one error line of a refused command (no traceback)."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "error" in lines[0], proc.stderr
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny run of 8 steps with checkpoints at steps 4 and 8."""
    folder = tmp_path_factory.mktemp("run") / "run"
    proc = cli_in_process("train", *TINY, "--set", "run.steps=8", "--set", "run.ckpt_every=4",
                          "--run-dir", folder)
    assert proc.returncode == 0, proc.stderr
    return folder


# -- checkpoints -----------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["generate", "export", "resume"])
def test_a_missing_latest_falls_back_to_the_newest_complete_checkpoint(run, tmp_path, command):
    """Without ``checkpoints/latest`` (deleted, or lost in a copy) the newest complete checkpoint
    is read, not "no checkpoint" beside a complete ``step-0000008/``; a garbage ``latest`` is
    still refused."""
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    (folder / "checkpoints" / "latest").unlink()
    if command == "generate":
        proc = cli_in_process("generate", folder, "--prompt", "def ", "--max-new-tokens", "4")
    elif command == "export":
        proc = cli_in_process("export", folder, tmp_path / "out")
    else:
        proc = cli_in_process("train", "--run-dir", folder, "--resume", "--set", "run.steps=10", *QUIET)
    assert proc.returncode == 0, proc.stderr
    if command == "export":
        assert "exported step 8" in proc.stdout
    if command == "resume":
        rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows if r["split"] == "train"] == [2, 4, 6, 8, 10]  # from step 8 on
        (folder / "checkpoints" / "latest").write_text("garbage")
        proc = cli_in_process("generate", folder, "--prompt", "def ", "--max-new-tokens", "4")
        assert proc.returncode == 1 and "latest" in proc.stderr and "garbage" in proc.stderr, proc.stderr


# -- a run folder, recognized ----------------------------------------------------------------

@pytest.mark.parametrize("name, flags", [("config.json", []), ("config.json", ["--overwrite"]),
                                         ("metrics.jsonl", ["--overwrite"]), ("checkpoints", [])])
def test_a_folder_with_a_run_file_name_but_no_run_is_not_a_run_folder(tmp_path, name, flags):
    """A project's own ``config.json`` (or another name a run writes) is not a run: refused as
    "not a run folder", naming it, with or without --overwrite, and nothing in it changes (was:
    "already holds a run ... start over with --overwrite", which replaced the user's file)."""
    folder = tmp_path / "project"
    folder.mkdir()
    (folder / "main.py").write_text("print('hello')\n")
    if name == "checkpoints":
        (folder / name).mkdir()
        (folder / name / "model.bin").write_bytes(b"\x00\x01")
    else:
        (folder / name).write_text('{"name": "my app", "port": 8080}\n')
    before = files_of(folder)
    line = one_line(cli_in_process("train", *TINY, "--run-dir", folder, *flags))
    assert "not a run folder" in line and name in line and str(folder) in line, line
    assert files_of(folder) == before


def test_a_run_is_known_by_its_config_and_overwrite_removes_only_its_files(run, tmp_path):
    """A run saved on a GPU machine with a value refused today (``optim.lr=-1``) is still a
    run: refused without --overwrite; --overwrite replaces the run's own files and leaves the
    files the run did not write (beside it, and in its checkpoints folder)."""
    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    config = json.loads((folder / "config.json").read_text())
    config["run"]["device"], config["optim"]["lr"] = "cuda", -1.0
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "notes.txt").write_text("what I tried\n")
    (folder / "checkpoints" / "README").write_text("keep me\n")
    before = files_of(folder)
    line = one_line(cli_in_process("train", *TINY, "--run-dir", folder, "--set", "run.steps=2"))
    assert "already holds a run" in line
    assert files_of(folder) == before
    proc = cli_in_process("train", *TINY, "--run-dir", folder, "--set", "run.steps=2", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert (folder / "notes.txt").read_text() == "what I tried\n"
    assert (folder / "checkpoints" / "README").read_text() == "keep me\n"
    assert sorted(p.name for p in (folder / "checkpoints").iterdir()) == ["README", "latest", "step-0000002"]
    assert json.loads((folder / "config.json").read_text())["run"]["steps"] == 2


# -- data ------------------------------------------------------------------------------------

def _text_folder(folder: Path) -> Path:
    folder.mkdir()
    for k in range(4):
        (folder / f"part{k}.txt").write_text("".join(f"line {i} of part {k}: some words to read\n" for i in range(60)))
    return folder


def test_a_run_folder_inside_its_data_folder_is_left_out_of_the_corpus(tmp_path):
    """``--data D --run-dir D/run``: the run's own files (config, summary, log) are not read as
    data, so a resumed run trains on the corpus it started on (was: 53,001 -> 71,768 tokens)."""
    from attnres.train.config import DataConfig
    from attnres.train.data import load_corpus

    data = _text_folder(tmp_path / "data")
    alone = load_corpus(DataConfig(source=str(data)), 256)
    proc = cli_in_process("train", *TINY, "--set", "run.steps=2", "--data", data, "--run-dir", data / "run")
    assert proc.returncode == 0, proc.stderr
    assert (data / "run" / "config.json").is_file() and (data / "run" / "summary.json").is_file()
    again = load_corpus(DataConfig(source=str(data)), 256)
    assert np.array_equal(again.train, alone.train) and np.array_equal(again.val, alone.val)
    proc = cli_in_process("train", "--run-dir", data / "run", "--resume", "--set", "run.steps=4", *QUIET)
    assert proc.returncode == 0, proc.stderr
    assert np.array_equal(load_corpus(DataConfig(source=str(data)), 256).train, alone.train)


def test_text_that_is_not_utf8_is_refused_for_bpe_naming_the_file_and_offset(tmp_path):
    """A BPE tokenizer reads text: a file that is not UTF-8 is refused naming it and its first
    bad byte (was: each such byte read silently as U+FFFD), unless ``data.decode_errors=replace``;
    checked per file before the split, which may cut a character the file holds whole."""
    from attnres.train.config import DataConfig
    from attnres.train.data import load_corpus

    bad = tmp_path / "latin1.txt"
    bad.write_bytes(("caf\xe9 au lait, " * 400).encode("latin-1"))
    bpe = ["--set", "data.tokenizer=bpe", "--set", "data.bpe_vocab_size=300", "--set", "run.steps=2"]
    before = files_of(tmp_path)
    line = one_line(cli_in_process("train", *TINY, *bpe, "--data", bad, "--run-dir", tmp_path / "run"))
    assert str(bad) in line and "byte 0xe9 at offset 3" in line and "data.decode_errors=replace" in line, line
    assert files_of(tmp_path) == before and not (tmp_path / "run").exists()
    line = one_line(cli_in_process("train", *TINY, *bpe, "--set", "data.decode_errors=ignore", "--data", bad,
                                   "--run-dir", tmp_path / "run"))
    assert "data.decode_errors='ignore' must be one of ('strict', 'replace')" in line, line
    proc = cli_in_process("train", *TINY, *bpe, "--set", "data.decode_errors=replace", "--data", bad,
                          "--run-dir", tmp_path / "run")
    assert proc.returncode == 0, proc.stderr
    cut = tmp_path / "accents.txt"  # 2002 bytes of two-byte characters: the split falls inside one
    cut.write_text("\xe9" * 1001)
    corpus = load_corpus(DataConfig(source=str(cut), tokenizer="bpe", bpe_vocab_size=300), 256,
                         bpe_dir=tmp_path / "bpe")
    assert len(corpus.train) and len(corpus.val)


def test_a_run_saved_before_decode_errors_resumes_as_it_read_its_data(run, tmp_path):
    """A run saved without ``data.decode_errors`` reads as ``replace`` (what it did), so it
    still resumes: its saved data settings agree with the ones it is resumed with."""
    import torch

    from attnres.train.run_files import load_run_config

    folder = tmp_path / "run"
    shutil.copytree(run, folder)
    config = json.loads((folder / "config.json").read_text())
    del config["data"]["decode_errors"]
    (folder / "config.json").write_text(json.dumps(config))
    for state_file in (folder / "checkpoints").glob("step-*/state.pt"):
        state = torch.load(state_file, weights_only=True)
        del state["config"]["data"]["decode_errors"]
        torch.save(state, state_file)
    assert load_run_config(folder).data.decode_errors == "replace"
    proc = cli_in_process("train", "--run-dir", folder, "--resume", "--set", "run.steps=10", *QUIET)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("fault", ["odd train.bin", "empty train.bin", "fifo"])
def test_a_data_error_names_the_file_and_what_is_wrong(tmp_path, fault):
    """An odd-size or empty ``train.bin`` and a FIFO given as the data are refused in one line
    naming the file and what is wrong (was: numpy's "cannot mmap an empty file", or a FIFO
    called a "data folder")."""
    data = tmp_path / "data"
    if fault == "fifo":
        os.mkfifo(data)
        path, what = data, "named pipe (FIFO)"
    else:
        data.mkdir()
        path = data / "train.bin"
        path.write_bytes(np.arange(99, dtype=np.uint16).tobytes()[: 1 if fault.startswith("odd") else 0])
        (data / "val.bin").write_bytes(np.arange(99, dtype=np.uint16).tobytes())
        what = "odd number" if fault.startswith("odd") else "is empty"
    line = one_line(cli_in_process("train", *TINY, "--data", data, "--run-dir", tmp_path / "run"))
    assert str(path) in line and what in line, line
    assert not (tmp_path / "run").exists()


# -- exports and conversions -----------------------------------------------------------------

@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """A tiny Llama saved as a Hugging Face folder with the byte tokenizer: what convert reads."""
    import torch
    import transformers

    from attnres.hf.tokenizer import byte_tokenizer

    folder = tmp_path_factory.mktemp("source") / "llama"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder


def _write(command, run, source, dst, *extra):
    if command == "export":
        return ["export", run, dst, *extra]
    return ["convert", source, dst, "--heads", "4", "--block-layers", "1", *extra]


def test_export_refuses_a_vocabulary_the_byte_tokenizer_does_not_cover(tmp_path):
    """A run on token files with ``model.vocab_size=1000`` is not exported with the byte
    tokenizer's 256 tokens (was: written beside the 1000-token model): refused naming both."""
    data = tmp_path / "tokens"
    data.mkdir()
    rng = np.random.default_rng(0)
    for name in ("train.bin", "val.bin"):
        rng.integers(0, 1000, 4000, dtype=np.uint16).tofile(data / name)
    folder = tmp_path / "run"
    proc = cli_in_process("train", *TINY, "--set", "run.steps=2", "--set", "model.vocab_size=1000", "--data", data,
                          "--run-dir", folder)
    assert proc.returncode == 0, proc.stderr
    line = one_line(cli_in_process("export", folder, tmp_path / "out"))
    assert "model.vocab_size=1000" in line and "256" in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run", "tokens"]


@pytest.mark.parametrize("command, sig", [("export", signal.SIGTERM), ("convert", signal.SIGINT),
                                          ("export", signal.SIGKILL)])
def test_a_signal_while_writing_leaves_no_partial_folder(run, source, tmp_path, command, sig):
    """SIGINT or SIGTERM while ``export`` or ``convert`` writes: its temporary folder is removed
    and the command exits 130 or 143 (was: 143 and a hidden partial folder beside the output);
    a temporary folder a SIGKILL left is removed by the next write to the same destination, which
    takes the lock file the killed one left in it, as a run does."""
    dst = tmp_path / "out"
    env = {**os.environ, "ATTNRES_PAUSE_AT": "written"}
    proc = subprocess.Popen([sys.executable, "-m", "attnres", *map(str, _write(command, run, source, dst))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        deadline, seen = time.time() + 120, ""
        while "paused at written" not in seen and time.time() < deadline and proc.poll() is None:
            seen += proc.stderr.readline()
        assert "paused at written" in seen, seen
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out.partial-")]  # half written
        proc.send_signal(sig)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if sig == signal.SIGKILL:  # the killed write's folder, and the destination holding only the lock it took
        assert len(list(tmp_path.iterdir())) == 2 and [p.name for p in dst.iterdir()] == [".lock"]
        done = cli_in_process(*_write(command, run, source, dst))
        assert done.returncode == 0, done.stderr
        assert [p.name for p in tmp_path.iterdir()] == ["out"]
    else:
        assert proc.returncode == 128 + sig, proc.stderr.read()
        assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", ["export", "convert"])
def test_written_folders_follow_the_umask(run, source, tmp_path, command):
    """An exported or converted folder gets the modes the user's umask gives (755 and 644 under
    022), as a run folder does (was: 700 and 600, unreadable by a serving account)."""
    previous = os.umask(0o022)
    try:
        proc = cli_in_process(*_write(command, run, source, tmp_path / "out"))
    finally:
        os.umask(previous)
    assert proc.returncode == 0, proc.stderr
    out = tmp_path / "out"
    assert oct(out.stat().st_mode & 0o777) == oct(0o755)
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {oct(0o644)}, modes


@pytest.mark.parametrize("command", ["export", "convert"])
def test_a_destination_under_a_file_is_refused_before_any_work(run, source, tmp_path, command):
    """``convert SRC notes.txt/model`` is refused first, naming the file in the way (was: after
    the weights loaded, naming nothing); the source's weights are not even read."""
    src = tmp_path / "src"
    shutil.copytree(source, src)
    (src / "model.safetensors").write_bytes(b"not read")
    (tmp_path / "notes.txt").write_text("mine\n")
    line = one_line(cli_in_process(*_write(command, run, src, tmp_path / "notes.txt" / "model")))
    assert "notes.txt" in line and "is a file, not a folder" in line, line
    assert (tmp_path / "notes.txt").read_text() == "mine\n"
