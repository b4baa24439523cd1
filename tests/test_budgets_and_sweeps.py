"""``attnres compare --budgets``: the baseline at several budgets and each design's
compute-equivalent multiplier; ``attnres sweep``: one comparison per point of a ladder."""

import json
import os
import signal
from pathlib import Path

import pytest

from .conftest import cli_in_process, log_rows

TINY = ["--preset", "tiny", "--set", "run.progress=false", "--set", "run.tensorboard=false"]


@pytest.mark.xdist_group("budget_comparison")
def test_compare_with_budgets_places_each_design_on_the_baselines_curve(tmp_path):
    out = cli_in_process("compare", *TINY, "--designs", "prenorm", "block", "prenorm:norm_eps_scale=absolute",
                         "--budgets", "1", "2", "--seeds", "0", "1", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    root = next(tmp_path.glob("compare-*"))
    results = json.loads((root / "results.json").read_text())
    assert results["budgets"] == [1.0, 2.0]
    runs = results["budget_runs"]
    assert list(runs) == ["prenorm@x2"] and runs["prenorm@x2"]["budget"] == 2.0
    assert sorted(runs["prenorm@x2"]["val_loss"]) == ["0", "1"]
    summary = json.loads((root / "prenorm@x2-seed0" / "summary.json").read_text())
    assert summary["steps"] == 16 and summary["tokens"] == 2 * 8 * 4 * 32  # twice the steps, same batch
    # the budget run stays out of the paired table; every design gets its multiplier (or a side)
    assert set(results["designs"]) == {"prenorm", "block", "prenorm:norm_eps_scale=absolute"}
    assert results["designs"]["prenorm"]["compute_equivalent"]["budget"] == 1.0
    assert results["designs"]["prenorm:norm_eps_scale=absolute"]["compute_equivalent"]["budget"] == 1.0
    block = results["designs"]["block"]["compute_equivalent"]
    assert (block["budget"] is None) == ("beyond" in block)
    assert block["step_time_ratio"] > 0
    assert block["time"] is None if block["budget"] is None else block["time"] == block["budget"] / block["step_time_ratio"]
    index = json.loads((root / "compare.json").read_text())
    assert index["budgets"] == [1.0, 2.0] and index["step_times"]["prenorm"]["ratio"] == 1.0
    assert len(index["step_times"]["block"]["seconds"]) == index["step_times"]["block"]["rounds"]
    report = (root / "report.md").read_text()
    assert "## Compute-equivalent multiplier" in report and (root / "budget.png").is_file()


@pytest.mark.parametrize("args,message", [
    (["--budgets", "1.5", "2"], "the list must start at 1"),
    (["--budgets", "1", "3", "2"], "ascend strictly"),
])
def test_bad_budgets_are_refused_before_any_work(tmp_path, args, message):
    out = cli_in_process("compare", *TINY, "--designs", "prenorm", "block", *args, "--out", str(tmp_path))
    assert out.returncode == 2 and message in out.stderr and not any(tmp_path.iterdir())


def test_a_sweep_runs_a_comparison_per_point_and_summarizes_them(tmp_path, monkeypatch):
    from attnres.experiments import sweep

    planned = []

    def counted(base, *args, **kwargs):
        planned.append(base.model.n_layers)
        return plan_comparison(base, *args, **kwargs)

    plan_comparison = sweep.plan_comparison
    monkeypatch.setattr(sweep, "plan_comparison", counted)
    out = cli_in_process("sweep", "--over", "model.n_layers=2,3", *TINY, "--designs", "prenorm", "block",
                         "--seeds", "0", "1", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    root = next(tmp_path.glob("sweep-*"))
    index = json.loads((root / "sweep.json").read_text())
    assert index["complete"] and [p["values"] for p in index["points"]] == [{"model.n_layers": "2"},
                                                                          {"model.n_layers": "3"}]
    for point, layers in zip(index["summary"], (2, 3)):
        config = json.loads((root / point["dir"] / "block-seed0" / "config.json").read_text())
        assert config["model"]["n_layers"] == layers
        block = point["designs"]["block"]
        results = json.loads((root / point["dir"] / "results.json").read_text())["designs"]["block"]
        assert block["gap"] == results["diff_mean"] and block["ci95"] == results["ci95"]
    assert (root / "sweep.png").is_file()
    assert planned == [2, 3]  # each point planned once: the plan checked up front is the one it runs


@pytest.mark.parametrize("over,message", [
    (["--over", "model.n_layers=2,3", "--over", "model.dim=32"], "zipped by position"),
    (["--over", "model.block_size=2,4"], "the residual design, its options and its epsilon are the designs' own"),
    (["--over", "model.norm_eps=1e-6,1e-12"], "the residual design, its options and its epsilon are the designs' own"),
    (["--over", "model.n_layers"], "give SECTION.FIELD=V1,V2"),
    ([], "needs at least one --over"),
    (["--over", "model.n_layers=2,x"], "model.n_layers"),
])
def test_a_sweep_refuses_bad_points_before_any_work(tmp_path, over, message):
    out = cli_in_process("sweep", *over, *TINY, "--designs", "prenorm", "block", "--out", str(tmp_path))
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not any(tmp_path.iterdir())


def losses(root: Path) -> dict:
    """Every run's logged rows in sweep ``root`` (point/run -> rows), less the throughput, which
    follows the machine's load."""
    return {str(path.parent.relative_to(root)): log_rows(path.parent)
            for path in sorted(root.glob("point-*/*/metrics.jsonl"))}


def test_a_signal_between_two_points_stops_the_sweep_before_the_next(tmp_path):
    """SIGINT (sent to this process) after the first point finished, as the sweep looks at the
    second: no second point is started, exit 130 with the command that continues it, and
    --resume runs the second point alone."""
    from attnres.experiments import sweep

    real = sweep._point_state

    def state(point_dir):
        if point_dir.name == "point-1":
            os.kill(os.getpid(), signal.SIGINT)
        return real(point_dir)

    args = ["sweep", "--over", "model.n_layers=2,3", *TINY, "--designs", "prenorm", "--out", tmp_path]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(sweep, "_point_state", state)
        out = cli_in_process(*args)
    root = next(tmp_path.glob("sweep-*"))
    assert out.returncode == 130 and f"continue it with: attnres sweep --resume {root}" in out.stderr, out.stderr
    assert not json.loads((root / "sweep.json").read_text())["complete"] and not (root / "point-1").exists()
    out = cli_in_process("sweep", "--resume", root)
    assert out.returncode == 0, out.stderr
    assert "sweep point model.n_layers=2" not in out.stdout and "sweep point model.n_layers=3" in out.stdout
    assert json.loads((root / "sweep.json").read_text())["complete"]


@pytest.mark.slow
def test_a_sweep_stopped_by_a_signal_resumes_where_it_stopped(tmp_path):
    """Ctrl-C (SIGINT, sent to this process) at step 3 of the second point's Block run, seed 0:
    the sweep stops there with that run's checkpoint; --resume leaves the finished first point
    untouched, continues the stopped run from its checkpoint, and ends with every run's log equal,
    to the last bit, to a sweep that never stopped."""
    from attnres.train import trainer

    real = trainer.train_step

    def step(run, index, logging):
        result = real(run, index, logging)
        if run.cfg.model.n_layers == 3 and run.cfg.model.residual == "block" and run.cfg.run.seed == 0 \
                and index + 1 == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return result

    args = ["sweep", "--over", "model.n_layers=2,3", *TINY, "--designs", "prenorm", "block", "--seeds", "0", "1"]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer, "train_step", step)
        out = cli_in_process(*args, "--out", tmp_path / "stopped")
    assert out.returncode == 130, out.stderr
    root = next((tmp_path / "stopped").glob("sweep-*"))
    assert not json.loads((root / "sweep.json").read_text())["complete"]
    point = json.loads((root / "point-1" / "compare.json").read_text())
    assert not point["complete"] and point["stopped_by"] == "SIGINT"
    assert [(r["design"], r["seed"], r["steps_done"]) for r in point["runs"]] == [("prenorm", 0, 8), ("block", 0, 3)]
    assert sorted(p.name for p in (root / "point-1" / "block-seed0" / "checkpoints").glob("step-*")) == ["step-0000003"]
    first = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (root / "point-0").rglob("*") if p.is_file()}
    out = cli_in_process("sweep", "--resume", root)
    assert out.returncode == 0, out.stderr
    assert json.loads((root / "sweep.json").read_text())["complete"]
    assert {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (root / "point-0").rglob("*") if p.is_file()} == first
    out = cli_in_process(*args, "--out", tmp_path / "whole")
    assert out.returncode == 0, out.stderr
    stopped, whole = losses(root), losses(next((tmp_path / "whole").glob("sweep-*")))
    assert len(stopped) == 8 and stopped == whole


@pytest.mark.parametrize("args,message", [
    (["--budgets", "1"], "at least one larger multiple"),
    (["--budgets", "1", "1.3"], "must be a whole number of steps"),  # tiny's 8 steps x 1.3
])
def test_budgets_that_measure_nothing_or_no_whole_step_are_refused(tmp_path, args, message):
    out = cli_in_process("compare", *TINY, "--designs", "prenorm", "block", *args, "--out", str(tmp_path))
    assert out.returncode == 2 and message in out.stderr, out.stderr


@pytest.mark.parametrize("over", ["run.seed=1,2", "run.name=a,b", "optim.decay_fraction=0.1,0.2"])
def test_a_sweep_over_what_the_comparison_sets_or_what_does_nothing_is_refused(tmp_path, over):
    out = cli_in_process("sweep", "--over", over, *TINY, "--designs", "prenorm", "block", "--out", str(tmp_path))
    assert out.returncode == 2, out.stderr
    assert not any(tmp_path.iterdir())


def test_a_comparison_inside_its_data_folder_stays_out_of_the_corpus(tmp_path):
    from attnres.train.config import DataConfig
    from attnres.train.data import load_corpus

    data = tmp_path / "data"
    data.mkdir()
    (data / "a.txt").write_text("def f(x):\n    return x + 1\n" * 400)
    (data / "b.txt").write_text("class A:\n    pass\n" * 400)
    config = DataConfig(source=str(data))
    before = load_corpus(config, 256)
    runs = data / "runs" / "compare-1"
    runs.mkdir(parents=True)
    (runs / "compare.json").write_text("{}")
    (runs / "report.md").write_text("# a report\n" * 300)
    after = load_corpus(config, 256)
    assert len(after.train) == len(before.train) and len(after.val) == len(before.val)


def test_an_absurd_budget_is_refused_by_a_bound(tmp_path, monkeypatch):
    """``--budgets 1 1e12`` (was: accepted, the baseline set to train 8e12 steps, silently for
    ever): refused before any work (no step trained), naming the bound."""
    from attnres.train import trainer

    monkeypatch.setattr(trainer, "train_step", lambda *args: pytest.fail("a step was trained"))
    out = cli_in_process("compare", *TINY, "--designs", "prenorm", "block", "--budgets", "1", "1e12",
                         "--out", str(tmp_path))
    assert out.returncode == 2 and "1e+12 would train the baseline for 1e+12 times" in out.stderr, out.stderr
    assert "the multiples go up to 100" in out.stderr and not any(tmp_path.iterdir())


@pytest.mark.parametrize("args,message", [
    (["--over", "model.n_layers=2,3", "--set", "model.n_layers=4"],
     "--set model.n_layers and --over model.n_layers=2,3 both set model.n_layers"),
    (["--over", "data.source=stdlib,sdists-v1", "--data", "stdlib"], "--data and --over data.source=stdlib,sdists-v1"),
    (["--over", "model.n_layers=2,2"], "sweep points model.n_layers=2 and model.n_layers=2 are the same settings"),
    (["--over", "model.n_layers=2,02"], "sweep points model.n_layers=2 and model.n_layers=02 are the same settings"),
])
def test_a_sweep_point_given_twice_or_a_swept_field_also_set_is_refused(tmp_path, args, message):
    """A swept field also given with ``--set`` or ``--data`` (was: the value given silently
    replaced at every point), and a point given twice (was: the same comparison run twice):
    refused before any work."""
    out = cli_in_process("sweep", *args, *TINY, "--designs", "prenorm", "--out", str(tmp_path))
    assert out.returncode == 2 and message in out.stderr, out.stderr
    assert not any(tmp_path.iterdir())


def stop_budget_run(tmp_path, run_name: str, seeds: list[str]) -> Path:
    """A comparison of prenorm and block with ``--budgets 1 2`` over ``seeds``, stopped by
    SIGTERM at step 3 of the run in folder ``run_name``; its folder."""
    import os

    from attnres.train import trainer

    real = trainer.train_step

    def step(run, index, logging):
        result = real(run, index, logging)
        if run.run_dir.name == run_name and index + 1 == 3:
            os.kill(os.getpid(), signal.SIGTERM)
        return result

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(trainer, "train_step", step)
        out = cli_in_process("compare", *TINY, "--designs", "prenorm", "block", "--budgets", "1", "2",
                             "--seeds", *seeds, "--out", str(tmp_path))
    assert out.returncode == 143, out.stderr
    return next(tmp_path.glob("compare-*"))


def test_a_stopped_budget_comparison_reports_what_results_json_holds(tmp_path):
    """SIGTERM in the baseline's run at twice the budget, every design finished: the report says
    its table is whole and only the budget run is missing (was: "the runs of the other seeds are
    left out", of no other seed), and that no multiplier can be given yet, naming the run (was: an
    empty table and an empty figure); results.json agrees: seed 0 compared, no multiplier. Stopped
    in seed 1's budget run of two seeds: the multipliers are seed 0's, and the report says so."""
    root = stop_budget_run(tmp_path / "one", "prenorm@x2", ["0"])
    results = json.loads((root / "results.json").read_text())
    assert results["seeds"] == [0] and results["budget_runs"]["prenorm@x2"]["val_loss"] == {}
    assert not any("compute_equivalent" in e for e in results["designs"].values())
    report = (root / "report.md").read_text()
    assert "Every design finished every seed (0): the table below is whole" in report and "left out" not in report
    assert "No multiplier yet" in report and "(prenorm@x2, seed 0: stopped at step 3 of 16)" in report
    assert "| design | multiplier |" not in report and not (root / "budget.png").exists()
    root = stop_budget_run(tmp_path / "two", "prenorm@x2-seed1", ["0", "1"])
    results = json.loads((root / "results.json").read_text())
    assert results["seeds"] == [0, 1] and list(results["designs"]["block"]["compute_equivalent"]["per_seed"]) == ["0"]
    report = (root / "report.md").read_text()
    assert "The multipliers use seed 0, whose runs at every budget finished; the table above uses 0, 1." in report
