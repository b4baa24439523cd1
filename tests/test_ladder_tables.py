"""``studies/ladder_tables.py``'s depth figures on made-up losses: a design's change of gap
between two depths, paired by seed, against the interval written out by hand."""

import math
import statistics

from scipy import stats

from .conftest import load_study


def load():
    return load_study("ladder_tables")


def point(base: list[float], block: list[float]) -> dict:
    return {"baseline": "prenorm", "designs": {
        "prenorm": {"val_loss": {str(s): v for s, v in enumerate(base)}},
        "block": {"val_loss": {str(s): v for s, v in enumerate(block)}}}}


def test_a_change_of_gap_is_paired_by_seed():
    ladder = load()
    shallow = point([1.50, 1.52, 1.48], [1.51, 1.50, 1.49])    # gaps +0.01, -0.02, +0.01
    deep = point([1.80, 1.60, 1.70], [1.50, 1.45, 1.46])  # gaps -0.30, -0.15, -0.24
    gaps = ladder.seed_gaps(deep, "block")
    assert gaps.keys() == {"0", "1", "2"}
    assert [round(gaps[s], 10) for s in "012"] == [-0.30, -0.15, -0.24]
    change = ladder.paired_difference(ladder.seed_gaps(shallow, "block"), gaps)
    diffs = [-0.31, -0.13, -0.25]  # each seed's deep gap minus its shallow gap, by hand
    half = stats.t.ppf(0.975, 2) * statistics.stdev(diffs) / math.sqrt(3)
    mean = statistics.fmean(diffs)
    assert math.isclose(change["diff_mean"], mean, abs_tol=1e-12)
    assert all(math.isclose(a, b, abs_tol=1e-9) for a, b in zip(change["ci95"], [mean - half, mean + half]))
    assert ladder.fmt_interval(change) == f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]"


def test_a_seed_only_one_point_ran_is_left_out_and_one_seed_has_no_interval():
    ladder = load()
    partial = point([1.5, 1.6], [1.4])
    assert ladder.seed_gaps(partial, "block") == {"0": 1.4 - 1.5}
    one = ladder.paired_difference({"0": 0.0}, {"0": -0.1})
    assert ladder.fmt_interval(one) == "-0.1000 (one seed)"
    assert ladder.fmt_mean({"0": 1.0, "1": 3.0}) == f"2.00 ± {math.sqrt(2):.2f}"
    assert ladder.fmt_mean({"0": 0.12345}, 4) == "0.1235" and ladder.fmt_mean({}) == ""
