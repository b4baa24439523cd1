"""Paired comparison of a design's final validation loss against a baseline, over seeds.

For a given seed every design of a comparison starts from the same initial seed and sees the same
batches, so the per-seed difference ``d_s = loss_s(design) - loss_s(baseline)`` removes what the
seed does to both. Over the ``n`` seeds that both ran, the mean difference has the Student-t
interval ``mean(d) +- t_{0.975, n-1} * sd(d) / sqrt(n)`` (``scipy.stats.ttest_rel``). Lower loss is
better: the interval wholly below 0 says "better", wholly above 0 "worse", otherwise
"unresolved". One seed gives a difference but no interval.
"""

from __future__ import annotations

import statistics

def paired_difference(baseline: dict[str, float], design: dict[str, float], confidence: float = 0.95) -> dict:
    """``{"seeds", "diff_mean", "ci95", "verdict"}`` for ``design`` against ``baseline``, each a
    map seed -> final validation loss; paired over the seeds both hold. ``ci95`` is
    ``[low, high]``, or ``None`` with fewer than two pairs (then the verdict is "unresolved")."""
    seeds = [s for s in design if s in baseline]
    if not seeds:
        raise ValueError(f"no seed in common: baseline has {sorted(baseline)}, the design {sorted(design)}")
    diffs = [design[s] - baseline[s] for s in seeds]
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return {"seeds": seeds, "diff_mean": mean, "ci95": None, "verdict": "unresolved"}
    if all(d == diffs[0] for d in diffs):  # no spread: scipy's interval is undefined (nan)
        low = high = mean
    else:
        from scipy import stats

        test = stats.ttest_rel([design[s] for s in seeds], [baseline[s] for s in seeds])
        interval = test.confidence_interval(confidence)
        low, high = float(interval.low), float(interval.high)
    verdict = "better" if high < 0 else "worse" if low > 0 else "unresolved"
    return {"seeds": seeds, "diff_mean": mean, "ci95": [low, high], "verdict": verdict}


def mean_and_sd(values: list[float]) -> tuple[float, float | None]:
    """Mean and sample standard deviation (None for one value)."""
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def mcnemar(control: list[bool], treated: list[bool]) -> dict:
    """The exact McNemar test of two models' per-item correctness on the same items (each a list
    of bools, item by item): ``n01`` items right for the control only, ``n10`` for the treated
    model only, ``p = binomtest(min(n01, n10), n01 + n10, 0.5)`` two-sided (1 without discordant
    items). Returns ``{"items", "n01", "n10", "acc_control", "acc_treated", "acc_diff", "p"}``."""
    if len(control) != len(treated) or not control:
        raise ValueError(f"McNemar needs the same items, at least one: {len(control)} and {len(treated)} answers")
    n01 = sum(1 for c, t in zip(control, treated) if c and not t)
    n10 = sum(1 for c, t in zip(control, treated) if t and not c)
    if n01 + n10 == 0:
        p = 1.0
    else:
        from scipy import stats

        p = float(stats.binomtest(min(n01, n10), n01 + n10, 0.5).pvalue)
    n = len(control)
    acc_control, acc_treated = sum(map(bool, control)) / n, sum(map(bool, treated)) / n
    return {"items": n, "n01": n01, "n10": n10, "acc_control": acc_control, "acc_treated": acc_treated,
            "acc_diff": acc_treated - acc_control, "p": p}
