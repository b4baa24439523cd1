"""Where ``attnres export`` and ``attnres convert`` write: never into a run, live or finished,
nor over files of the user's; ``--overwrite`` replaces a model folder and nothing else, and the
destination is held with a run folder's lock while it is written."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import cli_in_process
from tests.test_reliability_files import TINY, _write, files_of, one_line, run, source  # noqa: F401  (fixtures)


def wait_for(predicate, proc, seconds: float = 120) -> None:
    deadline = time.time() + seconds
    while not predicate() and time.time() < deadline and proc.poll() is None:
        time.sleep(0.05)
    assert predicate(), proc.stderr.read() if proc.poll() is not None else "timed out"


def test_export_and_convert_never_write_into_a_live_run(run, source, tmp_path):
    """A run still training holds its folder's lock: ``export RUN DIR --overwrite`` and ``convert
    SRC DIR --overwrite`` into it are refused naming the process (was: exit 0, the live run's
    metrics.jsonl and checkpoints removed, the trainer dying or writing beside the export); the
    trainer goes on and stops as ever, its log and checkpoint whole."""
    live = tmp_path / "live"
    proc = subprocess.Popen([sys.executable, "-m", "attnres", "train", *TINY, "--set", "run.steps=100000",
                             "--set", "run.ckpt_every=2", "--run-dir", str(live)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: (live / "checkpoints" / "latest").is_file(), proc)
        for command in ("export", "convert"):
            for extra in ([], ["--overwrite"]):
                line = one_line(cli_in_process(*_write(command, run, source, live, *extra)))
                assert f"destination {live} is in use by process {proc.pid} on " in line, line
        assert not (live / "model.safetensors").exists() and (live / "metrics.jsonl").is_file()
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, proc.stderr.read()
    summary = json.loads((live / "summary.json").read_text())
    assert summary["interrupted"] and (live / "checkpoints" / f"step-{summary['steps']:07d}").is_dir()
    steps = [json.loads(line)["step"] for line in (live / "metrics.jsonl").read_text().splitlines()]
    assert steps[0] == 2 and max(steps) <= summary["steps"]  # the log from its first row on, never removed


@pytest.mark.parametrize("overwrite", [False, True], ids=["plain", "overwrite"])
@pytest.mark.parametrize("command", ["export", "convert"])
def test_a_finished_run_is_never_an_exports_or_a_conversions_target(run, source, tmp_path, command, overwrite):
    """A finished run's folder as the destination: refused with or without ``--overwrite``,
    naming it a run and how it is continued (was: ``convert --overwrite`` deleted its
    checkpoints, exit 0); every file as it was, no lock file added."""
    target = tmp_path / "finished"
    shutil.copytree(run, target)
    before = files_of(target)
    line = one_line(cli_in_process(*_write(command, run, source, target, *(["--overwrite"] if overwrite else []))))
    assert f"destination {target} holds a training run (config.json, summary.json, metrics.jsonl, checkpoints" in line
    assert "with or without --overwrite" in line and "attnres train --resume" in line, line
    assert files_of(target) == before


@pytest.mark.parametrize("command", ["export", "convert"])
def test_overwrite_replaces_a_model_folder_and_nothing_else(run, source, tmp_path, command):
    """``--overwrite`` replaces a model folder the command wrote; a folder holding a file of the
    user's beside one (``notes.txt``), or a ``config.json`` that is not a model's, is refused with
    it too, naming them (was: replaced whole); without ``--overwrite`` a model folder is refused."""
    dst = tmp_path / "model"
    assert cli_in_process(*_write(command, run, source, dst)).returncode == 0
    line = one_line(cli_in_process(*_write(command, run, source, dst)))
    assert "exists and is not empty (a model folder); pass --overwrite" in line, line
    done = cli_in_process(*_write(command, run, source, dst, "--overwrite"))
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]  # no lock file or temporary left
    assert not (dst / ".lock").exists()
    (dst / "notes.txt").write_text("mine\n")
    before = files_of(dst)
    line = one_line(cli_in_process(*_write(command, run, source, dst, "--overwrite")))
    assert "holds files export and convert do not write (notes.txt)" in line, line
    assert files_of(dst) == before
    own = tmp_path / "project"
    own.mkdir()
    (own / "config.json").write_text(json.dumps({"name": "my project"}))
    line = one_line(cli_in_process(*_write(command, run, source, own, "--overwrite")))
    assert "holds a config.json that is not a model's" in line, line
    assert json.loads((own / "config.json").read_text()) == {"name": "my project"}


@pytest.mark.slow
@pytest.mark.parametrize("command", ["export", "convert"])
def test_the_destination_is_locked_while_it_is_written(run, source, tmp_path, command):
    """While ``export`` or ``convert`` writes (stopped at a known point), ``train --run-dir`` on
    its destination and a second write to it are refused naming the writer (was: both went on,
    one's files over the other's); once it ends the folder is its model, without a lock file."""
    dst = tmp_path / "out"
    env = {**os.environ, "ATTNRES_PAUSE_AT": "written"}
    proc = subprocess.Popen([sys.executable, "-m", "attnres", *map(str, _write(command, run, source, dst))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        seen, deadline = "", time.time() + 120
        while "paused at written" not in seen and time.time() < deadline and proc.poll() is None:
            seen += proc.stderr.readline()
        assert "paused at written" in seen, seen
        line = one_line(cli_in_process("train", *TINY, "--set", "run.steps=2", "--run-dir", dst))
        assert f"is in use by process {proc.pid}" in line, line
        line = one_line(cli_in_process(*_write(command, run, source, dst, "--overwrite")))
        assert f"destination {dst} is in use by process {proc.pid}" in line, line
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130 and list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())
    done = cli_in_process(*_write(command, run, source, dst))
    assert done.returncode == 0, done.stderr
    assert (dst / "config.json").is_file() and not (dst / ".lock").exists()
