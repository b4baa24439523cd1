"""``studies/regime_ladder.py``: comparisons that ran a ladder's seeds side by side pool into one
table, on made-up losses against figures worked out by hand, and on two real comparisons."""

import math
import statistics
from pathlib import Path

import pytest
from scipy import stats

from .conftest import cli_in_process, load_study


def load():
    return load_study("regime_ladder")


def point(folder: str, base: dict, at2: dict, block: dict, ratio: float | None) -> dict:
    """A comparison's numbers as ``folder_numbers`` gives them: PreNorm at budgets 1 and 2, Block at 1."""
    return {"folder": folder, "designs": ["prenorm", "block"], "baseline": "prenorm", "budgets": [1.0, 2.0],
            "config": {"model": {"dim": 48}}, "kind_norm_eps": {"block": 1e-12}, "data_sha256": "abc",
            "losses": {"prenorm": base, "block": block},
            "budget_runs": {"prenorm@2": {"budget": 2.0, "val_loss": at2}},
            "time_ratio": {"prenorm": None, "block": ratio}}


def test_two_comparisons_pool_into_one_ladder():
    ladder = load()
    a = point("a", {"4": 1.20, "5": 1.30}, {"4": 1.00, "5": 1.10}, {"4": 1.10, "5": 1.20}, 1.2)
    b = point("b", {"6": 1.25}, {"6": 1.05}, {"6": 1.05}, 1.3)
    numbers = ladder.ladder(ladder.pool([a, b]))
    assert numbers["seeds"] == ["4", "5", "6"]
    block = numbers["designs"]["block"]
    gaps = [-0.10, -0.10, -0.20]  # each seed's Block minus PreNorm, by hand
    mean, half = statistics.fmean(gaps), stats.t.ppf(0.975, 2) * statistics.stdev(gaps) / math.sqrt(3)
    assert math.isclose(block["gap"]["diff_mean"], mean, abs_tol=1e-12)
    assert all(math.isclose(x, y, abs_tol=1e-9) for x, y in zip(block["gap"]["ci95"], (mean - half, mean + half)))
    # seed 6's Block ends at PreNorm's budget-2 loss: a multiplier of exactly 2 there
    assert math.isclose(block["multiplier"]["per_seed"]["6"], 2.0, rel_tol=1e-9)
    assert block["time_ratios"] == [1.2, 1.3]
    assert math.isclose(block["multiplier"]["time"], block["multiplier"]["budget"] / 1.25, rel_tol=1e-12)
    fall, sd = numbers["fall_per_efold"][2.0]  # PreNorm falls 0.20 nats from budget 1 to 2 at every seed
    assert math.isclose(fall, 0.2 / math.log(2), rel_tol=1e-9) and sd == pytest.approx(0, abs=1e-12)
    # the mean curves: PreNorm 1.25 at budget 1, 1.05 at 2; Block's mean gap -0.4/3 is two thirds of the fall
    assert numbers["baseline_means"] == pytest.approx({1.0: 1.25, 2.0: 1.05}, abs=1e-12)
    curve = block["mean_curve"]
    assert math.isclose(curve["budget"], 2 ** (2 / 3), rel_tol=1e-9)
    # the gap's interval [-0.276, +0.010]: behind at its upper end (below 1), beyond budget 2 at its lower
    assert curve["ci95"][0] < 1 < curve["budget"] and curve["ci95"][1] is None
    assert math.isclose(curve["time"], curve["budget"] / 1.25, rel_tol=1e-12)
    assert "| block | 3 |" in ladder.markdown(numbers)


def test_the_mean_curve_gives_a_multiplier_where_a_seed_is_behind():
    ladder = load()
    # by hand: PreNorm's mean falls 0.2 nats from budget 1 to 2, 0.2 / ln 2 per e-fold
    assert math.isclose(ladder.mean_curve_multiplier([1, 2], [1.2, 1.0], -0.1), math.sqrt(2), rel_tol=1e-12)
    assert ladder.mean_curve_multiplier([1, 2], [1.2, 1.0], 0.0) == 1.0
    # behind PreNorm by half its fall: the slope extended below 1, exp(-0.1 / (0.2 / ln 2)) = 1 / sqrt(2)
    assert math.isclose(ladder.mean_curve_multiplier([1, 2], [1.2, 1.0], 0.1), 1 / math.sqrt(2), rel_tol=1e-12)
    assert ladder.mean_curve_multiplier([1, 2], [1.2, 1.0], -0.3) is None  # beyond the largest budget
    assert ladder.mean_curve_multiplier([1, 2], [1.2, 1.3], 0.1) is None  # a curve that does not fall
    # one seed behind: the per-seed multiplier has no value, the mean curves' has
    a = point("a", {"4": 1.20, "5": 1.30}, {"4": 1.00, "5": 1.10}, {"4": 1.25, "5": 1.10}, 1.2)
    block = ladder.ladder(ladder.pool([a]))["designs"]["block"]
    assert block["multiplier"]["budget"] is None and block["multiplier"]["beyond"] == "<1"
    assert math.isclose(block["mean_curve"]["budget"], 2 ** 0.375, rel_tol=1e-9)  # gap -0.075, 3/8 of the fall
    assert "beyond (<1) | 1.30 [" in ladder.markdown(ladder.ladder(ladder.pool([a])))


def test_comparisons_that_differ_in_more_than_their_seeds_do_not_pool():
    ladder = load()
    a = point("a", {"4": 1.2}, {"4": 1.0}, {"4": 1.1}, 1.2)
    with pytest.raises(ValueError, match="seed 4 is in both a and b"):
        ladder.pool([a, point("b", {"4": 1.2}, {"4": 1.0}, {"4": 1.1}, 1.2)])
    other = point("b", {"5": 1.2}, {"5": 1.0}, {"5": 1.1}, 1.2) | {"data_sha256": "def"}
    with pytest.raises(ValueError, match="b and a differ in data_sha256"):
        ladder.pool([a, other])


def test_the_ladder_reads_real_comparisons(tmp_path):
    ladder = load()
    folders = []
    for seed in ("0", "1"):
        out = cli_in_process("compare", "--preset", "tiny", "--designs", "prenorm", "block", "--budgets", "1", "2",
                             "--set", "run.steps=2", "--set", "run.eval_batches=1", "--set", "run.progress=false",
                             "--seeds", seed, "--out", tmp_path / seed)
        assert out.returncode == 0, out.stderr
        folders.append(Path(out.stdout.strip().splitlines()[-1]).parent)
    points = [ladder.folder_numbers(f) for f in folders]
    assert [sorted(p["losses"]["block"]) for p in points] == [["0"], ["1"]]
    assert all(p["time_ratio"]["block"] > 0 for p in points)  # each comparison timed its steps
    numbers = ladder.ladder(ladder.pool(points))
    assert numbers["seeds"] == ["0", "1"] and numbers["designs"]["block"]["gap"]["ci95"] is not None


def test_a_quiet_benchmarks_ratios_replace_the_comparisons_timing(tmp_path):
    """``--step-ratios``: each design's ratio from the benchmark's row of its label's part before
    ``:``, over the baseline's; the multiplier in wall-clock terms is the compute multiplier over
    it. A file of another size, a ratio that is no number or a design it does not time is refused."""
    ladder = load()
    table = tmp_path / "regime_step_paired.csv"
    table.write_text("design,median_ms,ratio,settings\nprenorm,117.0,1.0,preset=regime\nblock,146.0,1.25,preset=regime\n")
    ratios = ladder.benchmark_ratios(table, ["prenorm:lr=8e-3", "block:lr=5e-3"], "prenorm:lr=8e-3")
    assert ratios == {"prenorm:lr=8e-3": [1.0], "block:lr=5e-3": [1.25]}
    assert ladder.benchmark_ratios(table, ["prenorm", "block"], "block") == {"prenorm": [0.8], "block": [1.0]}
    pooled = ladder.pool([point("a", {"4": 1.20, "5": 1.30}, {"4": 1.00, "5": 1.10}, {"4": 1.10, "5": 1.20}, 1.9)])
    pooled["time_ratios"] = ladder.benchmark_ratios(table, list(pooled["losses"]), pooled["baseline"])
    block = ladder.ladder(pooled)["designs"]["block"]
    assert block["time_ratios"] == [1.25]
    assert math.isclose(block["multiplier"]["time"], block["multiplier"]["budget"] / 1.25, rel_tol=1e-12)
    with pytest.raises(ValueError, match=r"times no step of \['mhar:lr=3e-3'\]; it holds \['block', 'prenorm'\]"):
        ladder.benchmark_ratios(table, ["block:lr=5e-3", "mhar:lr=3e-3"], "block:lr=5e-3")
    demo = tmp_path / "demo_step_paired.csv"
    demo.write_text("design,ratio,settings\nprenorm,1.0,\nblock,1.12,\n")
    with pytest.raises(ValueError, match=r"times prenorm with settings '', not at the regime's size \(preset=regime\)"):
        ladder.benchmark_ratios(demo, ["prenorm", "block"], "prenorm")
    empty = tmp_path / "empty.csv"
    empty.write_text("design,ratio,settings\nprenorm,1.0,preset=regime\nblock,,preset=regime\n")
    with pytest.raises(ValueError, match=r"gives block the ratio ''; expected a positive number"):
        ladder.benchmark_ratios(empty, ["prenorm", "block"], "prenorm")
    other = tmp_path / "other.csv"
    other.write_text("name,value\nblock,1.2\n")
    with pytest.raises(ValueError, match=r"has columns \['name', 'value'\]; a paired benchmark's CSV has design"):
        ladder.benchmark_ratios(other, ["block"], "block")


def test_the_script_refuses_a_step_ratios_file_it_cannot_read(tmp_path, capsys):
    ladder = load()
    folder = Path(__file__).parents[1] / "docs" / "study" / "regime-ladder" / "compare-20261207-055101"
    with pytest.raises(SystemExit) as stopped:
        ladder.main([str(folder), "--step-ratios", str(tmp_path / "absent.csv")])
    assert stopped.value.code == 2
    assert "--step-ratios: [Errno 2] No such file or directory" in capsys.readouterr().err


def test_the_committed_ladder_gives_the_table_results_reports():
    ladder = load()
    study = Path(__file__).parents[1] / "docs" / "study" / "regime-ladder"
    folders = [study / name for name in ("compare-20261207-055101", "compare-20261207-144358", "compare-20261207-223734")]
    numbers = ladder.ladder(ladder.pool([ladder.folder_numbers(f) for f in folders]))
    assert numbers["seeds"] == [str(s) for s in range(4, 16)]
    # docs/RESULTS.md, "The compute ladder in the regime": each gap with its interval, and the
    # multiplier read off the mean curves with the gap's interval
    reported = {"block:lr=5e-3": ((-0.0057, -0.0149, +0.0035), (1.06, 0.96, 1.17)),
                "mhar:lr=3e-3": ((-0.0155, -0.0235, -0.0074), (1.18, 1.08, 1.29)),
                "full:lr=2e-3": ((-0.0056, -0.0153, +0.0041), (1.06, 0.96, 1.18))}
    for name, (gap, multiplier) in reported.items():
        e = numbers["designs"][name]
        assert e["gap"]["diff_mean"] == pytest.approx(gap[0], abs=5e-5)
        assert e["gap"]["ci95"] == pytest.approx(list(gap[1:]), abs=5e-5)
        assert e["multiplier"]["budget"] is None  # a seed behind PreNorm: no per-seed multiplier
        assert [e["mean_curve"]["budget"], *e["mean_curve"]["ci95"]] == pytest.approx(list(multiplier), abs=5e-3)
    falls = {b: round(mean, 3) for b, (mean, _) in numbers["fall_per_efold"].items()}
    assert falls == {1.5: 0.093, 2.0: 0.092, 3.0: 0.075}
