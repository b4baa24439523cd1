"""The trainer: learning, exact resume, crash-safe checkpoints, clear failures."""

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from attnres.train.checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from attnres.train.config import apply_override, tiny
from attnres.train.data import load_corpus
from attnres.train.trainer import TrainingDiverged, lr_at, train

from .conftest import cli_in_process, log_rows

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")  # not "module": the tests that use it need not share a worker
def corpus():
    cfg = tiny()
    return load_corpus(cfg.data, 256)


def quiet(cfg, **run):
    return replace(cfg, run=replace(cfg.run, progress=False, tensorboard=False, **run))


def losses(run_dir):
    rows = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if r["split"] == "train"}


def test_loss_falls_on_a_tiny_model(tmp_path, corpus):
    cfg = quiet(apply_override(tiny(), "model.residual=block"), steps=40, eval_every=40, log_every=1)
    result = train(cfg, tmp_path, corpus=corpus)
    curve = losses(tmp_path)
    assert curve[1] > 5.0  # about ln 256 at the start
    assert curve[40] < curve[1] - 1.5
    assert result.summary["final_val_loss"] < 4.0
    assert len(result.summary["layer_grad_norms"]) == 2


def test_resume_continues_bit_for_bit_and_the_log_is_exact(tmp_path, corpus):
    cfg = quiet(apply_override(tiny(), "model.residual=mhc"), steps=6, log_every=1, eval_every=2, ckpt_every=3)
    train(cfg, tmp_path / "straight", corpus=corpus)
    # the same run, crashed after step 5 with its last checkpoint at step 3 (and a row cut short
    # by the crash): resuming drops the rows after step 3 and writes them again
    crashed = tmp_path / "crashed"
    train(cfg, crashed, corpus=corpus)
    ckpts = crashed / "checkpoints"
    shutil.rmtree(ckpts / "step-0000006")
    (ckpts / "latest").write_text("step-0000003")
    log = crashed / "metrics.jsonl"
    log.write_text("".join(line + "\n" for line in log.read_text().splitlines() if json.loads(line)["step"] <= 5)
                   + '{"split": "train", "st')
    train(cfg, crashed, corpus=corpus, resume=True)
    a, b = losses(tmp_path / "straight"), losses(crashed)
    assert sorted(a) == sorted(b) == [1, 2, 3, 4, 5, 6]
    assert [a[s] for s in a] == [b[s] for s in a]  # bit for bit
    assert log_rows(crashed) == log_rows(tmp_path / "straight")  # each row once, losses equal


def test_a_resume_on_another_thread_count_says_so_and_continues(tmp_path, corpus):
    """A job resuming on the arithmetic of the job that wrote the checkpoint says nothing; on
    another thread count (another `machine` id, recorded in the checkpoint: a job killed before
    its summary was written is known too) it warns, naming the run and the change, and the run
    continues."""
    stopped, whole = quiet(tiny(), steps=2, log_every=1), quiet(tiny(), steps=4, log_every=1)
    threads = torch.get_num_threads()
    for name in ("same", "other"):
        train(stopped, tmp_path / name, corpus=corpus)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        train(whole, tmp_path / "same", corpus=corpus, resume=True)
    assert not [w for w in seen if "other arithmetic" in str(w.message)]
    (tmp_path / "other" / "summary.json").unlink()
    said = (rf"other resumes on other arithmetic than the job that wrote its checkpoint \(threads {threads} -> "
            rf"{threads + 1}\): from here its losses round otherwise")
    try:
        torch.set_num_threads(threads + 1)
        with pytest.warns(RuntimeWarning, match=said):
            train(whole, tmp_path / "other", corpus=corpus, resume=True)
    finally:
        torch.set_num_threads(threads)
    assert sorted(losses(tmp_path / "other")) == [1, 2, 3, 4]
    assert torch.load(tmp_path / "other" / "checkpoints" / "step-0000004" / "state.pt",
                      weights_only=True)["machine"]["threads"] == threads + 1


def test_lr_schedules():
    from attnres.train.config import OptimConfig

    cos = OptimConfig(lr=1.0, warmup_steps=10, schedule="cosine", min_lr_ratio=0.1)
    assert lr_at(0, 100, cos) == pytest.approx(0.1)
    assert lr_at(9, 100, cos) == pytest.approx(1.0)
    assert lr_at(55, 100, cos) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 45 / 90)))
    assert lr_at(100, 100, cos) == pytest.approx(0.1)
    wsd = OptimConfig(lr=1.0, warmup_steps=10, schedule="wsd", min_lr_ratio=0.0, decay_fraction=0.2)
    assert lr_at(50, 100, wsd) == 1.0 and lr_at(79, 100, wsd) == 1.0
    assert lr_at(89, 100, wsd) == pytest.approx(0.5)
    assert lr_at(99, 100, wsd) == pytest.approx(0.0)


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, corpus):
    cfg = quiet(tiny(), steps=4, ckpt_every=2)
    train(cfg, tmp_path, corpus=corpus)  # a good run leaves step-4
    bad = quiet(apply_override(tiny(), "optim.lr=1e20"), steps=8)  # continued, the first large steps blow it up
    with pytest.raises(TrainingDiverged, match=r"loss is (nan|inf) at step [5-7]; stopping.*step-0000004\) is kept"):
        train(bad, tmp_path, corpus=corpus, resume=True)
    assert latest_checkpoint(tmp_path / "checkpoints").name == "step-0000004"


CRASH_CHILD = r"""
import os, signal, sys, torch
from attnres.train import checkpoint as ck
root = sys.argv[1]
state = {"w": torch.arange(6.0)}
ck.save_checkpoint(root, 1, state, {"step": 1})
real_save = torch.save
def dying_save(obj, path, *a, **k):
    with open(path, "wb") as f:
        f.write(b"partial")
        f.flush()
    os.kill(os.getpid(), signal.SIGKILL)  # the machine dies mid-write
torch.save = dying_save
ck.save_checkpoint(root, 2, {"w": torch.zeros(6)}, {"step": 2})
"""


def test_atomic_save_survives_a_crash_mid_write(tmp_path):
    proc = subprocess.run([sys.executable, "-c", CRASH_CHILD, str(tmp_path)], capture_output=True)
    assert proc.returncode == -signal.SIGKILL
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step-0000001"
    weights, state = load_checkpoint(latest)
    assert torch.equal(weights["w"], torch.arange(6.0)) and state["step"] == 1
    # the next save succeeds over the debris
    save_checkpoint(tmp_path, 2, {"w": torch.ones(6)}, {"step": 2})
    assert latest_checkpoint(tmp_path).name == "step-0000002"


def test_full_disk_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"w": torch.ones(3)}, {"step": 1})
    import attnres.train.checkpoint as ck

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(ck.torch, "save", no_space)
    with pytest.raises(CheckpointError, match="No space left on device.*step-0000001 is kept"):
        save_checkpoint(tmp_path, 2, {"w": torch.zeros(3)}, {"step": 2})
    assert latest_checkpoint(tmp_path).name == "step-0000001"
    assert not list(tmp_path.glob(".step-*"))  # no debris


def test_corrupt_and_mismatched_checkpoints_are_clear_errors(tmp_path, corpus):
    cfg = quiet(tiny(), steps=2)
    train(cfg, tmp_path, corpus=corpus)
    path = latest_checkpoint(tmp_path / "checkpoints")
    other = apply_override(cfg, "model.dim=48").model
    with pytest.raises(CheckpointError, match=r"another model \(fields differ: \['dim', 'ffn_dim'\]\)"):
        load_checkpoint(path, other)
    (path / "model.safetensors").write_bytes(b"\x00garbage")
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint(path, cfg.model)
    (path / "state.pt").unlink()
    with pytest.raises(CheckpointError, match="incomplete"):
        load_checkpoint(path, cfg.model)


def test_checkpoint_holds_no_code(tmp_path, corpus):
    cfg = quiet(apply_override(tiny(), "model.tie_embeddings=true"), steps=2)
    train(cfg, tmp_path, corpus=corpus)
    path = latest_checkpoint(tmp_path / "checkpoints")
    from safetensors.torch import load_file

    weights = load_file(str(path / "model.safetensors"))
    assert "tok_embeddings.weight" in weights and "lm_head.weight" in weights
    torch.load(path / "state.pt", weights_only=True)  # plain data only


def run_cli(*args, env=None, cwd=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "attnres", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, cwd=cwd, timeout=timeout)


@pytest.mark.parametrize(
    "args,message",
    [
        (["--set", "model.nope=1"], "unknown field; model has"),
        (["--set", "optim.lr=fast"], "expected a value of type float"),
        (["--set", "model.block_size=2"], "does not apply"),
        (["--set", "model.residual=block", "--set", "model.block_size=99"], r"block_size=99 must be an integer in \[1, 4\]"),
        (["--data", "/nonexistent/corpus"], "data path /nonexistent/corpus does not exist"),
        (["--preset", "huge"], "unknown preset 'huge'"),
        (["--set", "optim.grad_clip=-1"], r"optim.grad_clip=-1.0 must be in \(0, inf\)"),
        (["--set", "run.eval_every=0"], r"run.eval_every=0 must be an integer in \[1, inf\)"),
        (["--set", "optim.lr=nan"], r"optim.lr=nan must be in \(0, inf\)"),
        (["--set", "run.device=gpu"], "run.device='gpu' must be 'auto' or a torch device"),
        (["--set", "model.residual=block", "--set", "model.heads=3"], "heads=3 must be a positive integer dividing dim=32"),
        (["--set", "model.residual=block", "--set", "model.block_sizes=1,2"],
         r"block_sizes=\(1, 2\) must be positive integers summing to 4 \(the number of sublayers\)"),
        (["--set", "model.block_sizes=1,x"], r"--set model.block_sizes='1,x': expected a comma list of int, e.g. 4,4,6,2"),
    ],
)
def test_cli_errors_are_clear(tmp_path, args, message):
    preset = [] if "--preset" in args else ["--preset", "tiny"]
    proc = cli_in_process("train", *preset, "--run-dir", str(tmp_path), *args)
    assert proc.returncode == 2
    assert re.search(message, proc.stderr), proc.stderr
    assert "Traceback" not in proc.stderr


def test_resuming_a_finished_run_says_how_to_continue(tmp_path, corpus):
    cfg = quiet(tiny(), steps=2)
    train(cfg, tmp_path, corpus=corpus)
    with pytest.raises(ValueError, match=r"already finished its 2 steps; resume with --set run.steps=N"):
        train(cfg, tmp_path, corpus=corpus, resume=True)
    longer = quiet(tiny(), steps=4, log_every=1)
    result = train(longer, tmp_path, corpus=corpus, resume=True)
    assert result.summary["steps"] == 4


def test_train_refuses_a_folder_that_holds_a_run(tmp_path):
    """A second ``train`` into a run's folder neither overwrites its config and checkpoints nor
    appends to its log: refused before any work, unless --resume or --overwrite."""
    common = ["--preset", "tiny", "--run-dir", str(tmp_path), "--set", "run.progress=false",
              "--set", "run.tensorboard=false", "--set", "run.steps=4"]
    assert cli_in_process("train", *common).returncode == 0
    before = {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()}
    proc = cli_in_process("train", *common, "--set", "optim.lr=0.01")
    assert proc.returncode == 2 and "already holds a run" in proc.stderr and "--overwrite" in proc.stderr, proc.stderr
    assert {p: p.read_bytes() for p in tmp_path.rglob("*") if p.is_file()} == before
    proc = cli_in_process("train", *common, "--resume", "--overwrite")
    assert proc.returncode == 2 and "give one" in proc.stderr
    proc = cli_in_process("train", *common, "--set", "optim.lr=0.01", "--overwrite")
    assert proc.returncode == 0, proc.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if r["split"] == "train"] == [2, 4]  # one run's rows, not two
    assert json.loads((tmp_path / "config.json").read_text())["optim"]["lr"] == 0.01


def test_reliability_doc_lists_every_field_and_its_range():
    from attnres.train.validate import FIELDS

    doc = (Path(__file__).resolve().parent.parent / "docs" / "RELIABILITY.md").read_text()
    rows = dict(re.findall(r"^\| `([a-z_]+\.[a-z_0-9]+)` \| (.+?) \|$", doc, flags=re.M))
    assert rows == {key: str(accepted) for key, accepted in FIELDS.items()}


def case_count(test_id: str) -> int:
    """How many cases pytest runs for ``file.py::test_name``: the product of its parametrizations."""
    import importlib

    file, name = test_id.split("::")
    function = getattr(importlib.import_module(f"tests.{file.removesuffix('.py')}"), name)
    count = 1
    for mark in getattr(function, "pytestmark", []):
        if mark.name == "parametrize":
            count *= len(mark.args[1])
    return count


def test_reliability_doc_counts_the_cases():
    doc = (Path(__file__).resolve().parent.parent / "docs" / "RELIABILITY.md").read_text()
    rows = re.findall(r"^\| .+ \| (`test_[^|]+) \| ([0-9 +]+) \|$", doc, flags=re.M)
    assert len(rows) >= 20
    for tests, count in rows:
        ids = re.findall(r"`(test_\w+\.py::\w+)`", tests)
        assert [int(n) for n in count.split(" + ")] == [case_count(i) for i in ids], tests


def train_rows(path):
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.endswith("}") and '"split": "train"' in line)


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_ends_bit_identical(tmp_path):
    """A run killed with SIGKILL three times (at seeded random moments, mid-step or mid-save)
    and resumed each time ends with the same weights, bit for bit, and the same log rows as one
    that never stopped."""
    import random

    args = ["--preset", "tiny", "--set", "run.steps=80", "--set", "run.ckpt_every=5", "--set", "run.log_every=1",
            "--set", "run.eval_every=10", "--set", "run.progress=false", "--set", "run.tensorboard=false"]
    assert run_cli("train", *args, "--run-dir", str(tmp_path / "straight")).returncode == 0
    crashed, rng = tmp_path / "crashed", random.Random(0)
    for k, kill_at in enumerate((12, 37, 61)):
        proc = subprocess.Popen([sys.executable, "-m", "attnres", "train", *(args[2:] if k else args),  # no --preset
                                 "--run-dir", str(crashed),
                                 *(["--resume"] if k else [])], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.time() + 120
        while train_rows(crashed / "metrics.jsonl") < kill_at and proc.poll() is None and time.time() < deadline:
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.05))
        assert proc.poll() is None, f"the run ended before its kill at step {kill_at}"
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        assert latest_checkpoint(crashed / "checkpoints") is not None
    finished = run_cli("train", *args[2:], "--run-dir", str(crashed), "--resume")
    assert finished.returncode == 0, finished.stderr
    a, _ = load_checkpoint(latest_checkpoint(tmp_path / "straight" / "checkpoints"))
    b, _ = load_checkpoint(latest_checkpoint(crashed / "checkpoints"))
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    assert log_rows(crashed) == log_rows(tmp_path / "straight")


def test_a_corrupt_run_config_is_named(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    for args in (["train", "--resume", "--run-dir", str(tmp_path)], ["generate", str(tmp_path)]):
        proc = run_cli(*args)
        assert proc.returncode == 2 and f"{tmp_path / 'config.json'} is not valid JSON" in proc.stderr, proc.stderr


@pytest.mark.parametrize("design", ["prenorm", "block", "mhar", "full", "delta", "hc", "mhc", "gr", "block+moe"])
def test_every_design_trains_bit_for_bit_the_same_twice_and_across_a_resume(tmp_path, corpus, design):
    """The same config and seed on the same machine logs the same losses, bit for bit: twice
    straight, and once more resumed from its checkpoint at step 2. ``+moe``: with MoE MLPs, the
    balance bias (state that the checkpoint must carry) and a capacity that drops tokens."""
    from attnres.experiments.designs import design_config

    base = quiet(tiny(), steps=4, log_every=1, eval_every=2, ckpt_every=2)
    model = design_config(base.model, design.removesuffix("+moe"))
    if design.endswith("+moe"):
        model = replace(model, moe_experts=4, moe_balance="bias", moe_bias_rate=0.01, moe_capacity=1.0)
    cfg = replace(base, model=model)
    for name in ("first", "second"):
        train(cfg, tmp_path / name, corpus=corpus)
    train(cfg, tmp_path / "resumed", corpus=corpus)  # then back to its checkpoint at step 2, as after a crash
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "step-0000004")
    (tmp_path / "resumed" / "checkpoints" / "latest").write_text("step-0000002")
    train(cfg, tmp_path / "resumed", corpus=corpus, resume=True)
    first = log_rows(tmp_path / "first")
    assert len(first) == 6 and all(math.isfinite(r.get("loss", r.get("val_loss", math.nan))) for r in first)
    assert log_rows(tmp_path / "second") == first
    assert log_rows(tmp_path / "resumed") == first


def test_a_checkpoint_from_before_a_new_model_field_still_loads(tmp_path, corpus):
    """A field added to ModelConfig later (block_sizes) reads as its default in an older
    checkpoint; a field that differs still refuses."""
    cfg = quiet(tiny(), steps=2)
    train(cfg, tmp_path, corpus=corpus)
    ckpt = latest_checkpoint(tmp_path / "checkpoints")
    state = torch.load(ckpt / "state.pt", weights_only=True)
    del state["config"]["model"]["block_sizes"]
    torch.save(state, ckpt / "state.pt")
    weights, _ = load_checkpoint(ckpt, cfg.model)
    assert "tok_embeddings.weight" in weights
    with pytest.raises(CheckpointError, match=r"fields differ: \['dim'\]"):
        load_checkpoint(ckpt, replace(cfg.model, dim=64))
