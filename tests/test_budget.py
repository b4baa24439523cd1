"""The compute-equivalent multiplier against values worked out by hand on a made-up curve."""

import math

import pytest

from attnres.analysis.budget import check_budgets, compute_equivalent, equivalent_budget

BUDGETS = [1, 1.5, 2, 3]
CURVE = [2.0, 1.9, 1.85, 1.8]  # the baseline's final loss at each budget


@pytest.mark.parametrize("target,expected", [
    (2.0, 1.0),                      # the baseline's own loss: exactly its own budget
    (1.95, math.sqrt(1.5)),          # halfway from 2.0 to 1.9 in log budget: exp(ln(1.5) / 2)
    (1.875, math.sqrt(1.5 * 2)),     # halfway between budgets 1.5 and 2: their geometric mean
    (1.85, 2.0),                     # on a measured point
    (1.8, 3.0),
])
def test_one_seed_interpolates_in_log_budget(target, expected):
    m, beyond = equivalent_budget(BUDGETS, CURVE, target)
    assert beyond is None and m == pytest.approx(expected, rel=1e-12)


def test_outside_the_measured_range_there_is_no_multiplier():
    assert equivalent_budget(BUDGETS, CURVE, 2.01) == (None, "<1")
    assert equivalent_budget(BUDGETS, CURVE, 1.79) == (None, ">3")


def test_a_curve_out_of_order_is_made_monotone_toward_the_better_loss():
    # 2.05 at budget 2 is read as 2.0 (budget 1 already reached it): 1.95 lies halfway from 2 to 3
    m, _ = equivalent_budget([1, 2, 3], [2.0, 2.05, 1.9], 1.95)
    assert m == pytest.approx(math.sqrt(2 * 3), rel=1e-12)


def test_seeds_average_on_the_log_scale_with_a_student_t_interval():
    baseline = {0: CURVE, 1: CURVE}
    design = {0: 1.95, 1: 1.875}  # multipliers sqrt(1.5) and sqrt(3)
    out = compute_equivalent(BUDGETS, baseline, design, time_ratio=1.2)
    logs = [0.5 * math.log(1.5), 0.5 * math.log(3)]
    mean = sum(logs) / 2
    sd = abs(logs[0] - logs[1]) / math.sqrt(2)
    half = 12.706204736174698 * sd / math.sqrt(2)  # t_{0.975, 1}
    assert out["budget"] == pytest.approx(4.5 ** 0.25, rel=1e-12)  # (sqrt(1.5) sqrt(3))^(1/2)
    assert out["ci95"] == pytest.approx([math.exp(mean - half), math.exp(mean + half)], rel=1e-9)
    assert out["time"] == pytest.approx(4.5 ** 0.25 / 1.2, rel=1e-12)
    assert out["time_ci95"] == pytest.approx([math.exp(mean - half) / 1.2, math.exp(mean + half) / 1.2], rel=1e-9)


def test_the_baseline_and_an_identical_variant_land_at_exactly_one():
    baseline = {0: [2.0, 1.9], 1: [2.1, 2.0], 2: [1.95, 1.9]}
    same = {s: losses[0] for s, losses in baseline.items()}
    out = compute_equivalent([1, 2], baseline, same, time_ratio=1.0)
    assert out["budget"] == 1.0 and out["ci95"] == [1.0, 1.0] and out["time"] == 1.0


def test_a_seed_beyond_the_range_makes_the_design_beyond():
    baseline = {0: CURVE, 1: CURVE}
    out = compute_equivalent(BUDGETS, baseline, {0: 1.95, 1: 1.7})
    assert out["budget"] is None and out["beyond"] == ">3" and out["per_seed"] == {"0": pytest.approx(math.sqrt(1.5)),
                                                                                   "1": ">3"}
    assert compute_equivalent(BUDGETS, baseline, {0: 2.2, 1: 2.3})["beyond"] == "<1"


@pytest.mark.parametrize("budgets", [[], [1.5, 2], [1, 1], [1, 3, 2], [1, float("nan")], [1, True]])
def test_budgets_must_start_at_one_and_ascend(budgets):
    with pytest.raises(ValueError, match=r"--budgets"):
        check_budgets(budgets)


def test_mcnemar_against_a_case_worked_by_hand():
    from attnres.analysis.stats import mcnemar

    # 10 discordant items, 2 right for the control only and 8 for the treated model only:
    # p = 2 P(X <= 2), X ~ Binomial(10, 1/2) = 2 (1 + 10 + 45) / 1024
    control = [True] * 2 + [False] * 8 + [True] * 5 + [False] * 5
    treated = [False] * 2 + [True] * 8 + [True] * 5 + [False] * 5
    out = mcnemar(control, treated)
    assert (out["items"], out["n01"], out["n10"]) == (20, 2, 8)
    assert out["p"] == pytest.approx(112 / 1024, rel=1e-12)
    assert out["acc_control"] == 7 / 20 and out["acc_treated"] == 13 / 20 and out["acc_diff"] == pytest.approx(0.3)
    assert mcnemar([True, False], [True, False])["p"] == 1.0  # no discordant item
    with pytest.raises(ValueError, match="the same items"):
        mcnemar([True], [True, False])


def test_the_width_probe_against_a_case_worked_by_hand():
    """D = 4, two slices, two sources of RMS 1 in every slice, query [1, 0, 0, 1]: the whole
    width scores the sources 2 and 0, slice 0 ([1, 0]) scores them 1 and 1, slice 1 ([0, 1])
    1 and -1. Shared weights (e^2, 1) / (e^2 + 1); slice 0's (1/2, 1/2), slice 1's the shared
    ones: KL(slice 0 || shared) = ln(1/2) - (ln p + ln q) / 2, KL(slice 1 || shared) = 0."""
    import torch

    from attnres.analysis.probes import mean_slice_kl

    sources = [torch.tensor([[1.0, 1.0, 1.0, 1.0]]), torch.tensor([[1.0, -1.0, 1.0, -1.0]])]
    query = torch.tensor([1.0, 0.0, 0.0, 1.0])
    p, q = math.exp(2) / (math.exp(2) + 1), 1 / (math.exp(2) + 1)
    kl0 = math.log(0.5) - (math.log(p) + math.log(q)) / 2
    assert mean_slice_kl(query, None, sources, 2, 1e-12) == pytest.approx(kl0 / 2, rel=1e-5)
    assert mean_slice_kl(query, None, sources, 1, 1e-12) == pytest.approx(0.0, abs=1e-7)  # one slice: the shared
