"""A run folder is the user's data: every command validates before it acts, one job writes a
folder at a time, and every file read is checked (one line naming the file, never a traceback)."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from .conftest import cli_in_process

TEXT = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(1500))  # ~50 KB


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_text(TEXT)
    return path


def common(data, *extra, steps=2):
    return ["--preset", "tiny", "--data", str(data), "--set", "run.progress=false", "--set", "run.tensorboard=false",
            "--set", f"run.steps={steps}", "--set", "run.eval_batches=1", *extra]


def files(folder: Path) -> dict:
    """Every file under ``folder`` (links as their target's text) and its bytes."""
    return {p.relative_to(folder).as_posix(): (os.readlink(p) if p.is_symlink() else p.read_bytes())
            for p in sorted(folder.rglob("*")) if p.is_file() or p.is_symlink()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory, data):
    """A finished two-step run (do not change it: copy it)."""
    run = tmp_path_factory.mktemp("finished") / "run"
    proc = cli_in_process("train", *common(data), "--run-dir", run)
    assert proc.returncode == 0, proc.stderr
    return run


def copy_run(finished, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(finished, run, symlinks=True)
    return run


def one_line_error(proc, code=2):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == code and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


# -- 1. validate, then act -------------------------------------------------------------------

@pytest.mark.parametrize("bad,message", [
    (["--data", "/nonexistent/typo.txt"], "data path /nonexistent/typo.txt does not exist"),
    (["--set", "run.seq_len=60000", "--set", "model.max_seq_len=60000"],
     r"shorter than one sequence of run.seq_len=60000"),
    (["--set", "model.dim=65536", "--set", "model.n_heads=64", "--set", "model.n_layers=64"],
     r"needs about .* GiB per process .* is available \(MemAvailable"),
    (["--set", "run.device=meta"], r"run.device='meta' is not a device training runs on"),
])
def test_overwrite_with_bad_input_leaves_the_old_run(finished, tmp_path, data, bad, message):
    """``--overwrite`` with a data path that does not exist, data too short for the sequence, a
    model too large for the memory, a device training cannot use: refused in one line, the old
    run's files byte for byte as they were."""
    run = copy_run(finished, tmp_path)
    before = files(run)
    args = common(data)
    if bad[0] == "--data":
        args = [a for a in args if a != str(data) and a != "--data"]
    proc = cli_in_process("train", *args, *bad, "--run-dir", run, "--overwrite")
    assert re.search(message, one_line_error(proc)), proc.stderr
    assert files(run) == before


def test_a_refused_run_leaves_no_files_and_overwrite_keeps_the_lock(tmp_path, data, finished):
    """A value refused late (after the lock and the data: a sequence longer than the data)
    leaves no folder behind, or the existing folder as it was; the corrected command then runs.
    ``--overwrite`` removes the run's files, never the lock file."""
    fresh, empty = tmp_path / "fresh", tmp_path / "empty"
    empty.mkdir()
    for run in (fresh, empty):
        proc = cli_in_process("train", *common(data, "--set", "run.seq_len=60000", "--set", "model.max_seq_len=60000"),
                              "--run-dir", run)
        one_line_error(proc)
    assert not fresh.exists() and list(empty.iterdir()) == []
    assert cli_in_process("train", *common(data), "--run-dir", fresh).returncode == 0
    run = copy_run(finished, tmp_path)
    (run / ".lock").write_text("")
    proc = cli_in_process("train", *common(data, "--set", "optim.lr=0.01"), "--run-dir", run, "--overwrite")
    assert proc.returncode == 0, proc.stderr
    assert (run / ".lock").read_text().split()[0] == str(os.getpid())  # written by this (in-process) job


def test_settings_are_checked_as_one_whole(tmp_path):
    """The order of ``--set`` of different fields never matters (a field given twice takes its
    last value, as before); a derived default (``ffn_dim``, ``n_kv_heads``, ``norm_eps``) follows the field it
    derives from."""
    from attnres.train.config import apply_overrides, tiny

    pairs = (["model.block_size=2", "model.residual=block"], ["model.moe_top_k=1", "model.moe_experts=2"])
    for pair in pairs:
        assert apply_overrides(tiny(), pair) == apply_overrides(tiny(), pair[::-1])
    assert apply_overrides(tiny(), ["optim.lr=0.1", "model.dim=64", "optim.lr=0.2"]).optim.lr == 0.2  # the last
    cfg = apply_overrides(tiny(), ["model.dim=64", "model.n_heads=4"])
    assert (cfg.model.ffn_dim, cfg.model.n_kv_heads) == (192, 4)  # as ModelConfig(dim=64, n_heads=4) derives them
    # the epsilon's default is the residual kind's: it follows model.residual unless given too
    assert apply_overrides(tiny(), ["model.residual=block"]).model.norm_eps == 1e-12
    assert apply_overrides(tiny(), ["model.norm_eps=1e-6", "model.residual=full"]).model.norm_eps == 1e-6
    full = apply_overrides(tiny(), ["model.residual=full"])
    assert apply_overrides(full, ["model.residual=hc"]).model.norm_eps == 1e-6
    proc = cli_in_process("train", "--preset", "tiny", "--run-dir", tmp_path / "r", "--set", "model.block_size=2",
                          "--set", "model.residual=block", "--set", "run.steps=1", "--set", "run.progress=false")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((tmp_path / "r" / "config.json").read_text())["model"]["norm_eps"] == 1e-12  # Block's own


def test_a_model_setting_is_applied_or_refused(tmp_path, data):
    """``--set model.vocab_size`` was accepted and replaced by the tokenizer's: refused naming
    why (it applies to token files only)."""
    proc = cli_in_process("train", *common(data, "--set", "model.vocab_size=512"), "--run-dir", tmp_path / "r")
    assert "model.vocab_size is set only for a folder of token files" in one_line_error(proc)
    assert not (tmp_path / "r").exists()


def test_resume_on_other_data_is_refused_naming_both(finished, tmp_path, data):
    """``--resume --data other.txt`` would train on the run's saved data: refused, naming both;
    the run's own data (written another way) is accepted."""
    run = copy_run(finished, tmp_path)
    other = tmp_path / "other.txt"
    other.write_text(TEXT[::-1])
    before = files(run)
    proc = cli_in_process("train", "--run-dir", run, "--resume", "--data", other, "--set", "run.steps=3")
    line = one_line_error(proc)
    assert f"data.source: the run's '{data}', given '{other}'" in line, line
    assert files(run) == before
    relative = os.path.relpath(data, Path.cwd())
    proc = cli_in_process("train", "--run-dir", run, "--resume", "--data", relative, "--set", "run.steps=3")
    assert proc.returncode == 0, proc.stderr


def test_a_run_name_is_taken_literally(tmp_path):
    """``run.name`` names the folder as written (no strftime codes expanded); a name that is not
    one folder name is refused."""
    from attnres.commands import run_folder_name as _run_name
    from attnres.train.config import apply_override, tiny
    from attnres.train.run_model import OwnModel

    assert _run_name(apply_override(tiny(), "run.name=loss%d"), OwnModel()).startswith("loss%d-")
    for name in ("../up", "a/b", ".."):
        with pytest.raises(ValueError, match="must be one folder name"):
            _run_name(apply_override(tiny(), f"run.name={name}"), OwnModel())


# -- 2. one writer per run folder ------------------------------------------------------------

def test_a_second_writer_is_refused_while_the_first_runs(tmp_path, data):
    """Two jobs started together into one empty folder: one runs, the other is refused at once
    naming the first (whichever starts first); while it runs, --resume and --overwrite are
    refused too; once it is killed (SIGKILL) the lock is free, no stale lock."""
    run = tmp_path / "run"
    args = [sys.executable, "-m", "attnres", "train", *common(data, steps=100000), "--run-dir", str(run)]
    procs = [subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        deadline = time.time() + 120
        while all(p.poll() is None for p in procs) and time.time() < deadline:
            time.sleep(0.05)
        refused = next(p for p in procs if p.poll() is not None)
        winner = next(p for p in procs if p is not refused)
        err = refused.stderr.read()
        assert refused.returncode == 2 and f"is in use by process {winner.pid} on " in err, err
        assert winner.poll() is None
        for extra in (["--resume"], ["--overwrite"], []):
            given = common(data)[2:] if extra == ["--resume"] else common(data)  # a resume takes no --preset
            line = one_line_error(cli_in_process("train", *given, "--run-dir", run, *extra))
            assert f"in use by process {winner.pid}" in line, line
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()
    proc = cli_in_process("train", *common(data), "--run-dir", run, "--overwrite")
    assert proc.returncode == 0, proc.stderr


# -- 4. every file read is checked -----------------------------------------------------------

def _garbage(path):
    path.write_bytes(b"\x80\x04garbage that is not a zip nor a pickle")


def _truncate(path):
    path.write_bytes(path.read_bytes()[: len(path.read_bytes()) // 2])


def _state_without(key):
    def edit(path):
        state = torch.load(path, weights_only=True)
        del state[key]
        torch.save(state, path)
    return edit


def _other_design(path):
    from safetensors.torch import save_file

    from attnres import ModelConfig, Transformer

    model = Transformer(ModelConfig(vocab_size=256, dim=32, n_layers=2, n_heads=2, max_seq_len=64, residual="full"))
    save_file({k: v.contiguous().clone() for k, v in model.state_dict().items()}, str(path))


def _json(value):
    return lambda path: path.write_text(json.dumps(value))


def _config_edit(edit):
    def change(path):
        config = json.loads(path.read_text())
        edit(config)
        path.write_text(json.dumps(config))
    return change


def _link_outside(path):
    run = next(p for p in path.parents if p.name == "run")
    outside = run.parent / f"outside-{path.name}"
    if path.is_dir():
        shutil.move(path, outside)
    else:
        outside.write_bytes(path.read_bytes())
        path.unlink()
    path.symlink_to(outside)


CKPT = "checkpoints/step-0000002"
CORRUPTIONS = {  # name: (file, corruption, command, what the line says)
    "state-garbage": (f"{CKPT}/state.pt", _garbage, "resume", r"state.pt is corrupt or not an attnres checkpoint"),
    "state-no-optimizer": (f"{CKPT}/state.pt", _state_without("optimizer"), "resume", r"state.pt lacks 'optimizer'"),
    "state-no-step": (f"{CKPT}/state.pt", _state_without("step"), "generate", r"state.pt lacks 'step'"),
    "weights-other-design": (f"{CKPT}/model.safetensors", _other_design, "generate",
                             r"model.safetensors holds the weights of another model"),
    "weights-truncated": (f"{CKPT}/model.safetensors", _truncate, "resume", r"model.safetensors is corrupt"),
    "config-a-list": ("config.json", _json([1, 2]), "generate", r"config.json: not a valid attnres training config"),
    "config-truncated": ("config.json", _truncate, "resume", r"config.json is not valid JSON"),
    "config-no-dim": ("config.json", _config_edit(lambda c: c["model"].pop("dim")), "generate",
                      r"config.json: not a valid attnres training config.*dim"),
    "config-steps-text": ("config.json", _config_edit(lambda c: c["run"].update(steps="many")), "resume",
                          r"config.json: not a valid attnres training config: run.steps='many' is not of type"),
    "latest-garbage": ("checkpoints/latest", lambda p: p.write_text("step-9"), "generate",
                       r"checkpoints/latest names 'step-9', not a checkpoint folder"),
    "latest-outside": ("checkpoints/latest", lambda p: p.write_text("../../outside"), "resume",
                       r"checkpoints/latest names '../../outside'"),
    "metrics-link-outside": ("metrics.jsonl", _link_outside, "resume",
                             r"metrics.jsonl -> .* leads out of the run folder"),
    "checkpoint-link-outside": (CKPT, _link_outside, "generate", r"step-0000002 -> .* leads out of the run folder"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_every_file_of_a_run_is_checked_in_one_line(finished, tmp_path, case):
    """A run's file missing a key, truncated, of another type or design, or a link or pointer
    leading out of the folder: ``generate`` or ``train --resume`` says so in one line naming the
    file (no traceback, no ``weights_only=False`` advice), and changes no file."""
    name, corrupt, command, message = CORRUPTIONS[case]
    run = copy_run(finished, tmp_path)
    corrupt(run / name)
    before, outside = files(run), files(tmp_path)
    if command == "generate":
        proc = cli_in_process("generate", run, "--max-new-tokens", "1")
    else:
        proc = cli_in_process("train", "--run-dir", run, "--resume", "--set", "run.steps=3",
                              "--set", "run.progress=false")
    line = one_line_error(proc, code=1 if ("state" in case or "weights" in case or "latest" in case) else 2)
    assert re.search(message, line) and "weights_only" not in line, line
    assert files(run) == before and files(tmp_path) == outside


@pytest.mark.parametrize("file,content,message", [
    ("summary.json", {"parameters": 1, "peak_memory_mib": 2.0}, r"summary.json lacks the field 'final_val_loss'"),
    ("summary.json", [1], r"summary.json holds list, not an object"),
    ("metrics.jsonl", {"split": "val", "step": 2, "tokens": 8}, r"metrics.jsonl, line 1, lacks the field 'val_loss'"),
    ("metrics.jsonl", {"split": "train", "tokens": 8}, r"metrics.jsonl, line 1, lacks the field 'step'"),
])
def test_what_the_report_reads_is_checked(tmp_path, file, content, message):
    """A summary or a metrics row missing a field the report reads: one line naming the file."""
    from attnres.analysis.report import SUMMARY_FIELDS, metric_fields
    from attnres.files import read_json, read_jsonl

    path = tmp_path / file
    path.write_text(json.dumps(content) + "\n")
    with pytest.raises(ValueError, match=message):
        read_json(path, SUMMARY_FIELDS) if file == "summary.json" else read_jsonl(path, metric_fields)


def test_convert_checks_the_source_config(tmp_path):
    """A source config.json missing a size (read as the architecture's default: a 7B model), of
    another type, or not JSON: one line naming the file, before any weight loads."""
    pytest.importorskip("transformers")
    from attnres.cli import main

    src = tmp_path / "src"
    src.mkdir()
    good = dict(model_type="llama", hidden_size=64, num_hidden_layers=2, num_attention_heads=4, vocab_size=300)
    for content, message in [({k: v for k, v in good.items() if k != "hidden_size"}, "lacks hidden_size"),
                             ({**good, "num_hidden_layers": "2"}, "num_hidden_layers='2' must be a positive integer"),
                             ([good], "holds list, not a model config"),
                             ({**good, "model_type": "gpt2"}, "model_type='gpt2'")]:
        (src / "config.json").write_text(json.dumps(content))
        err = _capture(main, ["convert", str(src), str(tmp_path / "dst"), "--heads", "4", "--block-layers", "1"])
        assert err.startswith("attnres convert: error: ") and message in err and str(src) in err, err
        assert not (tmp_path / "dst").exists()


def _capture(fn, argv) -> str:
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        assert fn(argv) == 2
    lines = err.getvalue().strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in err.getvalue(), err.getvalue()
    return lines[0]


# -- 5. no traceback for bad input -----------------------------------------------------------

def test_an_eval_tokenizer_larger_than_the_vocabulary_is_refused(tmp_path):
    pytest.importorskip("lm_eval")
    from attnres.hf.evaluate import lm_eval_model
    from attnres.hf.tokenizer import byte_tokenizer

    byte_tokenizer().save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 100}))
    with pytest.raises(ValueError, match=r"has 2\d\d tokens, more than the model's vocabulary \(vocab_size=100"):
        lm_eval_model(tmp_path)


def test_ctrl_c_during_the_triton_import_is_a_clean_exit(tmp_path, monkeypatch):
    """KeyboardInterrupt while the optional Triton import runs: one line and exit 130."""
    import builtins

    from attnres.ops import registry

    real_import = builtins.__import__

    def interrupted(name, *args, **kwargs):
        if name == "triton":
            raise KeyboardInterrupt
        return real_import(name, *args, **kwargs)

    registry._triton_setup.cache_clear()
    monkeypatch.setattr(builtins, "__import__", interrupted)
    try:
        proc = cli_in_process("train", "--preset", "tiny", "--run-dir", tmp_path / "r", "--set", "model.residual=full",
                              "--set", "model.backend=triton", "--set", "run.steps=1", "--set", "run.progress=false")
    finally:
        monkeypatch.undo()
        registry._triton_setup.cache_clear()
    assert proc.returncode == 130 and proc.stderr.strip() == "attnres train: interrupted", proc.stderr
