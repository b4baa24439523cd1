"""The compute-equivalent multiplier: by what factor the baseline's training budget must grow to
reach a design's final loss (docs/METHOD.md, "Compute-equivalent multiplier").

The baseline trains at budgets ``b_1 = 1 < b_2 < ... < b_k`` (multiples of ``run.steps``) and ends
at losses ``L(b_j)``. Per seed, the design's final loss ``L_d`` at budget 1 is placed on that
curve:

- the curve is made monotone from its first point on: ``L'(b_j) = min(L(b_1), ..., L(b_j))`` (a
  longer run is taken to be at least as good as a shorter one; noise that breaks the order is
  resolved toward the better loss), anchored at the baseline's own loss at budget 1;
- between two budgets it is linear in ``log b``; the multiplier ``m`` is the first budget where
  ``L'(m) = L_d``: ``log m = log b_{j-1} + (L'(b_{j-1}) - L_d) / (L'(b_{j-1}) - L'(b_j)) *
  (log b_j - log b_{j-1})``;
- outside the measured range it has no value: ``"<1"`` where the design ends worse than the
  baseline at budget 1, ``">b_k"`` where it ends better than the baseline at its largest budget.

Over seeds the multipliers are averaged on the log scale (the geometric mean) with a 95%
Student-t interval, ``exp(mean(log m) +- t_{0.975, n-1} sd(log m) / sqrt(n))``. The baseline
itself, or a design with identical settings (identical losses), gets exactly 1.

In wall-clock terms each budget is scaled by its design's step time: the baseline needs ``m``
times its own step time ``T_b`` per step of budget, the design ``T_d``, so the time multiplier
is ``m * T_b / T_d`` (below 1: the design's gain does not pay for its slower step).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


#: the largest multiple of the designs' budget the baseline trains at: a design worth more than
#: this is reported beyond the range, and a larger multiple would train the baseline for days
#: where the comparison takes hours
MAX_BUDGET = 100.0


def check_budgets(budgets: Sequence[float]) -> list[float]:
    """The budget multiples, as floats: at least one, the first 1, strictly ascending, finite.
    (A comparison also bounds them by ``MAX_BUDGET``: ``experiments.compare.plan_comparison``.)"""
    values = list(budgets)
    if not values or any(isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) for b in values):
        raise ValueError(f"--budgets {values}: give finite numbers, the first 1, ascending (e.g. 1 1.5 2 3)")
    if values[0] != 1 or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"--budgets {values}: the list must start at 1 (the designs' own budget) and ascend "
                         f"strictly (e.g. 1 1.5 2 3)")
    return [float(b) for b in values]


def budget_label(budget: float) -> str:
    """``1.5`` -> ``"1.5"``, ``2.0`` -> ``"2"``: a budget as it appears in labels and in ``beyond``."""
    return f"{budget:g}"


def budget_run_label(baseline: str, budget: float) -> str:
    """The label of the baseline's run at ``budget`` times the steps: ``prenorm@x1.5`` (``@`` is
    a character no design's label holds)."""
    return f"{baseline}@x{budget_label(budget)}"


def budget_run_labels(baseline: str | None, budgets: Sequence[float] | None) -> dict[str, float]:
    """A comparison's runs of ``baseline`` at the larger of its ``budgets`` (``compare.json``'s):
    label -> budget; empty without budgets."""
    return {budget_run_label(baseline, b): b for b in budgets or () if b != 1}


def equivalent_budget(budgets: Sequence[float], losses: Sequence[float], target: float) -> tuple[float | None, str | None]:
    """One seed: ``(m, None)``, the budget at which the baseline's monotone curve ``losses`` over
    ``budgets`` (``check_budgets``) reaches ``target``, or ``(None, "<1")`` / ``(None, ">b_k")``
    where ``target`` lies outside the measured range (see the module's docstring)."""
    budgets = check_budgets(budgets)
    if len(losses) != len(budgets):
        raise ValueError(f"{len(losses)} baseline losses for {len(budgets)} budgets")
    curve = []
    for loss in losses:
        curve.append(loss if not curve else min(curve[-1], loss))
    if target > curve[0]:
        return None, f"<{budget_label(budgets[0])}"
    if target == curve[0]:
        return budgets[0], None
    for j in range(1, len(curve)):
        if curve[j] <= target:
            lo, hi = curve[j - 1], curve[j]
            fraction = (lo - target) / (lo - hi)
            log_m = math.log(budgets[j - 1]) + fraction * (math.log(budgets[j]) - math.log(budgets[j - 1]))
            return (budgets[j] if curve[j] == target else math.exp(log_m)), None
    return None, f">{budget_label(budgets[-1])}"


def log_mean_interval(values: Sequence[float], confidence: float = 0.95) -> tuple[float, list[float] | None]:
    """The geometric mean of ``values`` (all positive) and its Student-t interval on the log
    scale (``None`` for one value; the mean itself at both ends when the logs do not spread)."""
    logs = [math.log(v) for v in values]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return math.exp(mean), None
    sd = statistics.stdev(logs)
    if sd == 0:
        return math.exp(mean), [math.exp(mean), math.exp(mean)]
    from scipy import stats

    half = stats.t.ppf(0.5 + confidence / 2, len(logs) - 1) * sd / math.sqrt(len(logs))
    return math.exp(mean), [math.exp(mean - half), math.exp(mean + half)]


def compute_equivalent(budgets: Sequence[float], baseline: dict, design: dict[int, float],
                       time_ratio: float | None = None) -> dict:
    """A design's compute-equivalent multiplier over the seeds it shares with the baseline.

    ``baseline``: seed -> the baseline's final losses at each of ``budgets``; ``design``: seed ->
    the design's final loss at budget 1; ``time_ratio``: the design's step time over the
    baseline's (``T_d / T_b``), or None. Returns ``{"budget", "ci95", "time", "time_ci95",
    "per_seed"}``: ``budget`` the geometric mean of the seeds' multipliers, ``time`` the same in
    wall-clock terms (``budget / time_ratio``); where a seed's loss lies outside the baseline's
    range, ``budget`` and ``time`` are None and ``beyond`` says which side (``">b_k"`` if any
    seed ends better than the baseline's largest budget, else ``"<1"``)."""
    seeds = sorted(s for s in design if s in baseline)
    if not seeds:
        raise ValueError(f"no seed in common: the baseline's budgets ran seeds {sorted(baseline)}, the design "
                         f"{sorted(design)}")
    per_seed = {s: equivalent_budget(budgets, baseline[s], design[s]) for s in seeds}
    result = {"per_seed": {str(s): m if m is not None else side for s, (m, side) in per_seed.items()}}
    sides = {side for _, side in per_seed.values() if side is not None}
    if sides:
        above = [side for side in sides if side.startswith(">")]
        return {"budget": None, "ci95": None, "time": None, "time_ci95": None,
                "beyond": above[0] if above else sides.pop(), **result}
    budget, ci = log_mean_interval([m for m, _ in per_seed.values()])
    time = time_ci = None
    if time_ratio is not None:
        time = budget / time_ratio
        time_ci = None if ci is None else [ci[0] / time_ratio, ci[1] / time_ratio]
    return {"budget": budget, "ci95": ci, "time": time, "time_ci95": time_ci, **result}
