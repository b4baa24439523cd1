"""Each residual kind's default epsilon (``model_config.KIND_NORM_EPS``) as a comparison, a sweep
and their resumption apply it: a design given none takes its kind's, ``--set model.norm_eps``
gives every design one, a label's own wins, and a comparison or sweep saved with other defaults
(or before the kinds had their own) continues at the epsilons it began with; and the committed
runs on fresh seeds confirm each default."""

import json
from pathlib import Path

import pytest

from attnres.experiments.compare import plan_comparison
from attnres.experiments.designs import split_residual_overrides
from attnres.experiments.sweep import Sweep, check_sweep, load_sweep, write_sweep_index
from attnres.model_config import KIND_NORM_EPS, NORM_EPS
from attnres.train.config import apply_overrides, preset, to_dict

from .conftest import cli_in_process

QUIET = ["--set", "run.progress=false", "--set", "run.tensorboard=false"]
DESIGNS = ["prenorm", "block", "mhar", "full", "hc", "full:norm_eps=1e-6"]


def epsilons(plan, designs=DESIGNS):
    return [plan.configs[label].norm_eps for label in designs]


def test_each_design_runs_at_its_kinds_epsilon_unless_given():
    """A design given no ``norm_eps`` runs at its kind's default (Block, MHAR, Full 1e-12; the
    others 1e-6); ``--set model.norm_eps`` gives every design one, and a label's own wins; one
    that every label replaces is refused, as a residual option no design takes is."""
    base = preset("tiny")
    assert epsilons(plan_comparison(base, DESIGNS, [0], {}, None)) == [1e-6, 1e-12, 1e-12, 1e-12, 1e-6, 1e-6]
    shared, overrides = split_residual_overrides(["model.norm_eps=1e-5", "run.steps=3"])
    assert (shared, overrides) == (["run.steps=3"], {"norm_eps": 1e-5})
    assert epsilons(plan_comparison(base, DESIGNS, [0], overrides, None)) == [1e-5] * 5 + [1e-6]
    relative = plan_comparison(base, ["block:norm_eps_scale=init"], [0], {}, None).configs["block:norm_eps_scale=init"]
    assert (relative.norm_eps, relative.stream_eps) == (1e-6, pytest.approx(4e-10))  # the relative setting measured
    with pytest.raises(ValueError, match=r"model.norm_eps=1e-05 applies to none of the designs .* each sets its own"):
        plan_comparison(base, ["full:norm_eps=1e-6", "block:norm_eps=1e-6"], [0], overrides, None)


def hand_written_comparison(tmp_path, kind_norm_eps):
    """A comparison of Block and HC at the tiny preset, planned but not started (``compare.json``
    written as ``compare`` writes it, no run yet), its shared config at ``norm_eps=1e-5`` and its
    ``kind_norm_eps`` as given (None: a file from before the kinds had their own defaults)."""
    base = apply_overrides(preset("tiny"), ["run.steps=1", "run.eval_every=1", "run.progress=false",
                                            "run.tensorboard=false", "model.norm_eps=1e-5"])
    root = tmp_path / "compare-old"
    root.mkdir()
    record = {"complete": False, "designs": ["block", "hc", "full:norm_eps=1e-6"], "seeds": [0], "baseline": "block",
              "command": None, "steps": 1, "config": to_dict(base), "overrides": {}, "budgets": None, "runs": []}
    if kind_norm_eps is not None:
        record["kind_norm_eps"] = kind_norm_eps
    (root / "compare.json").write_text(json.dumps(record))
    return root


def run_epsilons(root):
    """Each design's epsilon, as its run's ``config.json`` holds it."""
    runs = json.loads((root / "compare.json").read_text())["runs"]
    return {run["design"]: json.loads((root / run["dir"] / "config.json").read_text())["model"]["norm_eps"]
            for run in runs}


@pytest.mark.parametrize("saved, ran", [
    (None, {"block": 1e-5, "hc": 1e-5, "full:norm_eps=1e-6": 1e-6}),  # as before: the shared config's
    ({"block": 1e-9, "hc": 1e-7, "full": 1e-12}, {"block": 1e-9, "hc": 1e-7, "full:norm_eps=1e-6": 1e-6}),
])
def test_a_resumed_comparison_runs_at_the_epsilons_it_was_planned_with(tmp_path, saved, ran):
    """``compare --resume`` of a comparison planned before each kind had its own default runs
    every design that sets none at its shared config's epsilon, as it would have then, and says
    so in its report; one planned with other defaults than this version's runs at those."""
    root = hand_written_comparison(tmp_path, saved)
    proc = cli_in_process("compare", "--resume", root)
    assert proc.returncode == 0, proc.stderr
    assert run_epsilons(root) == ran
    report = (root / "report.md").read_text()
    assert ("planned when every design took the shared epsilon" in report) == (saved is None)


def test_a_sweep_saved_before_the_kinds_had_their_own_epsilon_plans_each_point_as_it_did(tmp_path):
    """A sweep over ``model.norm_eps`` (refused now: the epsilon is each design's own) saved
    before the kinds had their own defaults plans each point's designs at that point's value, and
    one over another field at its shared config's; a new sweep records its kinds' defaults."""
    base = preset("tiny")
    cases = (({"model.norm_eps": ["1e-6", "1e-9"]}, [1e-6, 1e-9]), ({"run.steps": ["2", "3"]}, [1e-6, 1e-6]))
    for over, point_eps in cases:
        index = Sweep(base, over, ["block", "hc"], [0], {}, None, None, None).index()
        del index["kind_norm_eps"]  # as a sweep.json from before the kinds' own defaults
        root = tmp_path / f"sweep-{len(list(tmp_path.iterdir()))}"
        root.mkdir()
        write_sweep_index(root, index)
        plans = check_sweep(load_sweep(root)[0])
        assert [epsilons(plan, ["block", "hc"]) for plan in plans] == [[eps, eps] for eps in point_eps]
    new = Sweep(base, {"run.steps": ["2"]}, ["block"], [0], {}, None, None, None).index()
    assert new["kind_norm_eps"]["block"] == 1e-12 and new["kind_norm_eps"]["hc"] == 1e-6


def test_the_committed_fresh_seed_runs_confirm_each_kinds_default():
    """docs/RESULTS.md's rule, read from the committed comparison on seeds 6-9: Block, MHAR and
    Full, whose default (``KIND_NORM_EPS``) is not the shared ``1e-6``, each end with a lower mean
    final loss at their default than at ``1e-6``, and the means are the table's."""
    folder = Path(__file__).parents[1] / "docs" / "study" / "eps-confirm" / "compare-20261207-130714"
    results = json.loads((folder / "results.json").read_text())
    assert results["seeds"] == [6, 7, 8, 9] and results["data_sha256"] == "566d3834c5f89340"
    means = {label: entry["val_loss_mean"] for label, entry in results["designs"].items()}
    assert KIND_NORM_EPS == {"block": 1e-12, "full": 1e-12} and NORM_EPS == 1e-6  # MHAR is Block with heads
    for design in ("block", "mhar", "full"):
        assert means[design] < means[f"{design}:norm_eps=1e-6"], design
    assert {label: round(mean, 4) for label, mean in means.items()} == {
        "block": 1.4647, "mhar": 1.4556, "full": 1.4674,
        "block:norm_eps=1e-6": 1.4908, "mhar:norm_eps=1e-6": 1.4778, "full:norm_eps=1e-6": 1.5151}
