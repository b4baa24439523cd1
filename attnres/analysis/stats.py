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
