"""Interruption is the user's decision: SIGINT or SIGTERM saves the checkpoint and stops `train`
or the whole of `compare` with exit status 128 + the signal's number; an incomplete comparison
says so (compare.json, the report) and `attnres compare --resume` continues it."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from attnres.train.checkpoint import latest_checkpoint

from .conftest import cli_in_process

# under pytest-xdist (make test) the tests of the stopped comparison run in one worker, which
# trains it once
SHARED = pytest.mark.xdist_group("stopped-comparison")
QUIET = ["--set", "run.progress=false", "--set", "run.tensorboard=false", "--set", "run.log_every=1"]


def train_rows(path: Path) -> int:
    if not path.exists():
        return 0
    return sum(1 for line in path.read_text().splitlines() if line.endswith("}") and '"split": "train"' in line)


def signal_after_first_step(proc: subprocess.Popen, metrics, sig: int) -> tuple[str, str]:
    """Send ``sig`` to ``proc`` once ``metrics()`` (a path, or None before it exists) logs a
    step; returns what the process printed."""
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None and train_rows(metrics() or Path("/nonexistent")) < 1:
        time.sleep(0.02)
    assert proc.poll() is None, proc.communicate()
    proc.send_signal(sig)
    return proc.communicate(timeout=120)


TRAIN = [sys.executable, "-m", "attnres", "train", "--preset", "tiny", "--set", "run.steps=100000", *QUIET]


def stopped_at(run_dir: Path) -> int:
    """The step of the run's checkpoint, which its summary (interrupted) must agree with."""
    step = int(latest_checkpoint(run_dir / "checkpoints").name.split("-")[1])
    summary = json.loads((run_dir / "summary.json").read_text())
    assert step >= 1 and summary["interrupted"] and summary["steps"] == step
    return step


def test_ctrl_c_saves_a_checkpoint_and_train_exits_130(tmp_path):
    """`train && next` must not go on after Ctrl-C: the checkpoint is saved, then exit 130."""
    proc = subprocess.Popen([*TRAIN, "--run-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    out, err = signal_after_first_step(proc, lambda: tmp_path / "metrics.jsonl", signal.SIGINT)
    assert proc.returncode == 130, err
    assert "interrupted, checkpoint saved" in out and "Traceback" not in err
    stopped_at(tmp_path)


def test_sigterm_to_one_rank_stops_every_rank_with_exit_143(tmp_path):
    """Two ranks as torchrun starts them (its environment), SIGTERM to rank 1 alone: both stop
    at the same step, the checkpoint is saved, and both exit 143, so the job ends non-zero."""
    import socket

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        port = free.getsockname()[1]
    ranks = [subprocess.Popen([*TRAIN, "--run-dir", str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True, env={**os.environ, "RANK": str(rank), "LOCAL_RANK": str(rank),
                                              "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                                              "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"})
             for rank in (0, 1)]
    _, err = signal_after_first_step(ranks[1], lambda: tmp_path / "metrics.jsonl", signal.SIGTERM)
    out, err0 = ranks[0].communicate(timeout=120)
    assert [rank.returncode for rank in ranks] == [143, 143], err0 + err
    assert f"interrupted, checkpoint saved: step {stopped_at(tmp_path)}," in out


def test_ctrl_c_before_the_first_evaluation_stops_the_whole_comparison(tmp_path):
    """Ctrl-C in the first design, before its first evaluation: its checkpoint is saved, the
    next design never starts, exit 130, and compare.json and the report say what is missing."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "attnres", "compare", "--preset", "tiny", "--out", str(tmp_path), "--designs",
         "prenorm", "block", "--set", "run.steps=100000", "--set", "run.eval_every=100000", *QUIET],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    out, err = signal_after_first_step(proc, lambda: next(tmp_path.glob("compare-*/prenorm/metrics.jsonl"), None),
                                       signal.SIGINT)
    assert proc.returncode == 130 and "Traceback" not in err, err
    root = next(tmp_path.glob("compare-*"))
    index = json.loads((root / "compare.json").read_text())
    assert index["complete"] is False and index["stopped_by"] == "SIGINT" and index["steps"] == 100000
    [run] = index["runs"]
    assert (run["design"], run["steps"]) == ("prenorm", 100000) and 1 <= run["steps_done"] < 100000
    assert int(latest_checkpoint(root / "prenorm" / "checkpoints").name.split("-")[1]) == run["steps_done"]
    assert not (root / "block").exists()  # the next design never started
    report = (root / "report.md").read_text()
    assert out.strip().splitlines()[-1] == str(root / "report.md")
    for line in ("**This comparison is incomplete**: stopped by SIGINT",
                 f"- prenorm, seed 0: stopped at step {run['steps_done']} of 100000", "- block, seed 0: not started",
                 "No seed was finished by every design", f"`attnres compare --resume {root}`"):
        assert line in report, report


def compare_args(out, *designs):
    return ["compare", "--preset", "tiny", "--out", out, "--designs", *designs, "--set", "run.steps=6",
            "--set", "run.eval_every=4", *QUIET]


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A comparison of prenorm and block stopped by SIGTERM (sent to this process) after step 3
    of block, the second design."""
    from attnres.train import trainer

    real = trainer.train_step

    def step(run, index, logging):
        result = real(run, index, logging)
        if run.cfg.model.residual == "block" and index + 1 == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    out = tmp_path_factory.mktemp("stopped")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer, "train_step", step)
        proc = cli_in_process(*compare_args(out, "prenorm", "block"))
    assert proc.returncode == 143, proc.stderr
    return next(out.glob("compare-*"))


@SHARED
def test_sigterm_stops_the_comparison_and_compare_json_says_where(stopped):
    index = json.loads((stopped / "compare.json").read_text())
    assert list(index)[0] == "complete" and index["complete"] is False and index["stopped_by"] == "SIGTERM"
    assert [(r["design"], r["steps"], r["steps_done"]) for r in index["runs"]] == [("prenorm", 6, 6), ("block", 6, 3)]
    assert json.loads((stopped / "block" / "summary.json").read_text())["final_val_loss"] is None
    report = (stopped / "report.md").read_text()
    assert "- block, seed 0: stopped at step 3 of 6" in report and "stopped by SIGTERM" in report
    assert "| prenorm |" not in report  # no numbers from an incomplete pair


@SHARED
def test_a_resumed_comparison_refuses_runs_of_other_data_unless_allowed(stopped, tmp_path):
    """prenorm's summary says it read other tokens (as under another Python's standard library):
    --resume is refused before any work, naming the run and both digests; --allow-mixed-data
    continues, and the report lists which run read which."""
    mixed = tmp_path / "mixed"
    shutil.copytree(stopped, mixed)
    summary = json.loads((mixed / "prenorm" / "summary.json").read_text())
    here = summary["data_sha256"]
    summary["data_sha256"] = "fedcba9876543210"
    (mixed / "prenorm" / "summary.json").write_text(json.dumps(summary))
    before = run_files(mixed)
    proc = cli_in_process("compare", "--resume", mixed)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert (f"holds runs that read other data than data.source='sdists-v1' reads here (corpus sdists-v1: "
            in proc.stderr and f"data_sha256 {here}): prenorm read fedcba9876543210." in proc.stderr
            and "give --allow-mixed-data to mix them" in proc.stderr), proc.stderr
    assert run_files(mixed) == before
    proc = cli_in_process("compare", "--resume", mixed, "--allow-mixed-data")
    assert proc.returncode == 0, proc.stderr
    assert json.loads((mixed / "compare.json").read_text())["complete"] is True
    assert "**The runs read 2 different corpora**" in (mixed / "report.md").read_text()


def run_files(root: Path) -> dict:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


@SHARED
def test_a_killed_comparison_is_reported_and_resumes_where_it_stopped(stopped, tmp_path):
    """SIGKILL after block's checkpoint at step 3: compare.json holds no record of block and
    block has no summary. The report says so; --resume keeps prenorm and continues block from
    its checkpoint, to the same log and losses as a comparison that never stopped."""
    killed = tmp_path / "killed"
    shutil.copytree(stopped, killed)
    index = json.loads((killed / "compare.json").read_text())
    index["runs"] = index["runs"][:1]
    del index["stopped_by"]
    (killed / "compare.json").write_text(json.dumps(index))
    (killed / "block" / "summary.json").unlink()
    proc = cli_in_process("report", killed)
    assert proc.returncode == 0, proc.stderr
    report = (killed / "report.md").read_text()
    assert ("- block, seed 0: killed while it trained (compare.json has no record of it); its last checkpoint is "
            "step 3") in report and "it did not run to its end" in report
    prenorm = run_files(killed / "prenorm")
    proc = cli_in_process("compare", "--resume", killed)
    assert proc.returncode == 0, proc.stderr
    assert run_files(killed / "prenorm") == prenorm  # the finished design is kept as it was
    index = json.loads((killed / "compare.json").read_text())
    assert index["complete"] is True and "stopped_by" not in index
    assert [(r["design"], r["steps_done"]) for r in index["runs"]] == [("prenorm", 6), ("block", 6)]
    assert "incomplete" not in (killed / "report.md").read_text()
    from attnres.train.config import from_dict
    from attnres.train.trainer import train

    straight = train(from_dict(json.loads((killed / "block" / "config.json").read_text())), tmp_path / "straight")

    def rows(run_dir):
        lines = (run_dir / "metrics.jsonl").read_text().splitlines()
        return [{k: v for k, v in json.loads(line).items() if k != "tokens_per_s"} for line in lines]

    assert rows(killed / "block") == rows(tmp_path / "straight")  # as block trains without a stop
    assert [r["step"] for r in rows(killed / "block") if r["split"] == "train"] == [1, 2, 3, 4, 5, 6]
    results = json.loads((killed / "results.json").read_text())
    assert results["designs"]["block"]["val_loss"] == {"0": straight.summary["final_val_loss"]}
    assert results["complete"] is True and results["seeds"] == [0]
    # killed after block's last checkpoint and summary, before its analysis and record: only
    # the analysis is made, from the checkpoint
    before = run_files(killed / "block")
    index["runs"], index["complete"] = index["runs"][:1], False
    (killed / "compare.json").write_text(json.dumps(index))
    (killed / "block" / "analysis.json").unlink()
    assert cli_in_process("compare", "--resume", killed).returncode == 0
    assert run_files(killed / "block") == before and json.loads((killed / "compare.json").read_text())["complete"]
    again = cli_in_process("compare", "--resume", killed)
    assert again.returncode == 2 and "is complete: nothing to resume" in again.stderr


@SHARED
def test_paired_statistics_use_only_complete_pairs(stopped, tmp_path):
    """Seeds 0-3: block stopped at step 3 of seed 2, and never started seed 3. The numbers are
    those of seeds 0 and 1 alone, and the report says so."""
    from attnres.analysis.report import write_report

    losses = {"prenorm": [3.0, 3.1, 2.9], "block": [2.95, 3.04]}
    runs = []
    for design, values in losses.items():
        for seed, loss in enumerate(values + ([None] if design == "block" else [3.3])):
            name = f"{design}-seed{seed}"
            shutil.copytree(stopped / "prenorm", tmp_path / name)  # a finished run, of 6 steps
            summary = json.loads((tmp_path / name / "summary.json").read_text())
            (tmp_path / name / "summary.json").write_text(json.dumps({**summary, "final_val_loss": loss}))
            runs.append({"design": design, "seed": seed, "dir": name, "steps": 6, "steps_done": 3 if loss is None else 6})
    index = {"complete": False, "designs": ["prenorm", "block"], "seeds": [0, 1, 2, 3], "runs": runs}
    (tmp_path / "compare.json").write_text(json.dumps(index))
    text = write_report(tmp_path).read_text()
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["seeds"] == [0, 1] and results["complete"] is False
    assert results["designs"]["block"]["val_loss"] == {"0": 2.95, "1": 3.04}
    assert results["designs"]["block"]["diff_mean"] == pytest.approx(((2.95 - 3.0) + (3.04 - 3.1)) / 2, abs=1e-12)
    assert results["designs"]["prenorm"]["val_loss"] == {"0": 3.0, "1": 3.1}
    assert results["missing"] == ["block, seed 2: stopped at step 3 of 6", "block, seed 3: not started"]
    assert "The numbers below use only complete pairs: the seeds that every design finished (0, 1 of 0, 1, 2, 3)" in text
    assert "over 2 seeds" in text and "| block | " in text


BROKEN = {
    "empty object": ("{}", "has no 'designs'"),
    "cut short": ('{"designs": ["prenorm"], "se', "is not valid JSON"),
    "a list": ("[]", r"holds list \[\], not an object"),
    "no runs": ('{"designs": ["prenorm"], "seeds": [0]}', "has no 'runs' list"),
    "a run without its folder": ('{"designs": ["prenorm"], "seeds": [0], "runs": [{"design": "prenorm", "seed": 0}]}',
                                 r"runs\[0\] has no \['dir'\]"),
    "a folder outside": ('{"designs": ["prenorm"], "seeds": [0], "runs": [{"design": "prenorm", "seed": 0, '
                         '"dir": "../x"}]}', r"runs\[0\] has dir '../x': not the name of a folder inside"),
    "seeds of strings": ('{"designs": ["prenorm"], "seeds": ["0"], "runs": []}', r"'seeds' is \['0'\], not a non-empty"),
}


@pytest.mark.parametrize("case,command", [  # a cut-short file was already named by `report`
    (case, command) for case in BROKEN for command in (["report"], ["compare", "--resume"])
    if (case, command) != ("cut short", ["report"])], ids=lambda v: " ".join(v) if isinstance(v, list) else v)
def test_a_broken_compare_json_is_one_line_naming_it(tmp_path, case, command):
    import re

    text, message = BROKEN[case]
    (tmp_path / "compare.json").write_text(text)
    proc = cli_in_process(*command, tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    named = re.escape(str(tmp_path / "compare.json"))
    assert re.fullmatch(rf"attnres {command[0]}: error: {named}[: ].*{message}.*\n", proc.stderr), proc.stderr
    assert [p.name for p in tmp_path.iterdir()] == ["compare.json"]


def test_resume_needs_what_an_older_comparison_did_not_save(tmp_path):
    (tmp_path / "compare.json").write_text('{"designs": ["prenorm"], "seeds": [0], "runs": []}')
    proc = cli_in_process("compare", "--resume", tmp_path)
    assert proc.returncode == 2 and "lacks ['config', 'steps', 'overrides']: it was written before" in proc.stderr


@pytest.mark.parametrize("args,named", [
    (["--set", "run.steps=9"], "--set"), (["--designs", "block"], "--designs"), (["--seeds", "1"], "--seeds"),
    (["--data", "x.txt"], "--data"), (["--preset=tiny"], "--preset"), (["--out", "elsewhere"], "--out"),
    (["--baseline", "block"], "--baseline"), (["--des", "block", "--bas", "block"], "--designs --baseline"),
])
def test_resume_refuses_other_settings_naming_them(tmp_path, args, named):
    proc = cli_in_process("compare", "--resume", tmp_path, *args)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr == ("attnres compare: error: --resume continues the comparison with the settings it was "
                           f"started with; leave out {named}\n")
    assert list(tmp_path.iterdir()) == []
