"""The regime's compute ladder (docs/RESULTS.md, "The compute ladder in the regime"), from the
comparisons that ran its seeds side by side, one per core:

    python studies/regime_ladder.py runs/regime-ladder/compare-<ts> runs/regime-ladder/compare-<ts'>

Each folder is one ``attnres compare --preset regime --budgets 1 1.5 2 3 --seeds ...`` over its
own seeds; the comparisons must agree in everything else (designs, baseline, budgets, shared
config, the tokens read). Their seeds are pooled: each design's final loss at budget 1, its gap
to the baseline paired by seed (95% Student-t, ``analysis.stats.paired_difference``), its
compute-equivalent multiplier over the pooled baseline curves (``analysis.budget``), and in
wall-clock terms with the step-time ratio each comparison measured (their mean, each given),
or with ``--step-ratios CSV`` the ratios of a quiet-machine benchmark instead
(``benchmarks/demo_step.py --preset regime --paired``'s ``_paired.csv``: its median ratio for
each design, read by the label's part before ``:``).
The baseline's fall per e-fold of budget, ``(L(1) - L(b)) / ln(b)`` per seed for each larger
budget ``b``, sets the multiplier's scale beside the papers'.

Where one seed of a design ends behind the baseline at budget 1, that seed has no multiplier
(``"<1"``) and neither has the design. Each design's multiplier is therefore also read off the
mean curves (``mean_curve_multiplier``): the budget at which the baseline's mean loss falls by
the design's mean gap, and its interval the gap's 95% interval read through the same curve.
"""

from __future__ import annotations

import argparse
import csv
import math
import statistics
from pathlib import Path

from attnres.analysis.budget import check_budgets, compute_equivalent, equivalent_budget
from attnres.analysis.comparison import budget_curves, load_comparison
from attnres.analysis.stats import mean_and_sd, paired_difference

#: what every pooled comparison must share, from its ``compare.json`` (seeds aside)
SHARED = ("designs", "baseline", "budgets", "config", "kind_norm_eps")


def folder_numbers(folder: Path) -> dict:
    """One comparison's numbers: its settings (``SHARED``), per design its final loss by seed,
    the baseline's runs at the larger budgets by seed, each design's step-time ratio to the
    baseline (or None) and the digest of the tokens it read."""
    c = load_comparison(folder)
    record = c.record
    config = dict(record.config or {})
    config["run"] = {k: v for k, v in config.get("run", {}).items() if k not in ("seed", "name", "out_dir")}
    times = record.step_times or {}
    return {"folder": str(folder), "designs": list(record.designs), "baseline": c.baseline,
            "budgets": c.results.get("budgets"), "config": config, "kind_norm_eps": record.kind_norm_eps,
            "data_sha256": c.results.get("data_sha256"),
            "losses": {name: dict(e["val_loss"]) for name, e in c.results["designs"].items()},
            "budget_runs": c.results.get("budget_runs") or {},
            "time_ratio": {name: (times.get(name) or {}).get("ratio") for name in record.designs}}


def pool(points: list[dict]) -> dict:
    """The comparisons ``points`` (``folder_numbers``) as one: their losses and budget runs
    merged by seed. ``ValueError`` when they differ in a ``SHARED`` setting or the tokens they
    read, or when a seed is in two of them."""
    first = points[0]
    for other in points[1:]:
        for key in (*SHARED, "data_sha256"):
            if other[key] != first[key]:
                raise ValueError(f"{other['folder']} and {first['folder']} differ in {key}: only comparisons that "
                                 f"differ in their seeds alone pool")
    seen: dict[str, str] = {}
    for p in points:
        for seed in p["losses"][p["baseline"]]:
            if seed in seen:
                raise ValueError(f"seed {seed} is in both {seen[seed]} and {p['folder']}: each seed is pooled once")
            seen[seed] = p["folder"]
    losses = {name: {s: v for p in points for s, v in p["losses"][name].items()} for name in first["designs"]}
    budget_runs = {label: {**run, "val_loss": {s: v for p in points for s, v in p["budget_runs"][label]["val_loss"].items()}}
                   for label, run in first["budget_runs"].items()}
    ratios = {name: [p["time_ratio"][name] for p in points if p["time_ratio"][name] is not None]
              for name in first["designs"]}
    return {**{k: first[k] for k in (*SHARED, "data_sha256")}, "losses": losses, "budget_runs": budget_runs,
            "time_ratios": ratios}


def benchmark_ratios(path: Path, designs: list[str], baseline: str) -> dict[str, list[float]]:
    """Each design's step-time ratio to the baseline's from a paired benchmark at the regime's
    size (``benchmarks/demo_step.py --preset regime --paired``'s CSV: columns ``design``,
    ``ratio`` and ``settings``), matched by the label's part before ``:`` (``block:lr=5e-3``
    reads the row ``block``) and divided by the baseline's row, so that the baseline is 1. A file
    of another size, without those columns, with a ratio that is not a positive number, or
    without a design's row is refused, naming the file and what it holds."""
    with path.open(newline="") as f:
        reader = csv.DictReader(f)
        columns, rows = set(reader.fieldnames or ()), list(reader)
    if not {"design", "ratio", "settings"} <= columns:
        raise ValueError(f"{path} has columns {sorted(columns)}; a paired benchmark's CSV has design, ratio and "
                         "settings")
    timed = {}
    for row in rows:
        if "preset=regime" not in (row["settings"] or "").split(","):
            raise ValueError(f"{path} times {row['design']} with settings {row['settings']!r}, not at the regime's "
                             "size (preset=regime)")
        try:
            ratio = float(row["ratio"])
        except (TypeError, ValueError):  # an empty or short row: no number
            ratio = float("nan")
        if not ratio > 0:
            raise ValueError(f"{path} gives {row['design']} the ratio {row['ratio']!r}; expected a positive number")
        timed[row["design"]] = ratio
    row_of = {name: name.split(":")[0] for name in (*designs, baseline)}
    missing = [name for name in designs if row_of[name] not in timed]
    if missing:
        raise ValueError(f"{path} times no step of {missing}; it holds {sorted(timed)}")
    return {name: [timed[row_of[name]] / timed[row_of[baseline]]] for name in designs}


def mean_curve_multiplier(budgets: list[float], means: list[float], gap: float) -> float | None:
    """The budget at which the baseline's mean curve ``means`` (its mean loss at each of
    ``budgets``, made monotone and linear in ``log b`` between budgets, as
    ``analysis.budget.equivalent_budget``) lies ``gap`` nats from its budget-1 mean (a design
    ``gap`` below the baseline: ``gap < 0``). Behind the baseline (``gap > 0``) the curve is
    extended below 1 with its slope from budget 1 to the next, ``m = exp(-gap / s)``, ``s`` the
    fall per unit of ``log b`` there; None where the target lies beyond the largest budget, or
    where the curve does not fall from budget 1 to the next."""
    budgets = check_budgets(budgets)
    target = means[0] + gap
    if gap <= 0:
        return equivalent_budget(budgets, means, target)[0]
    slope = (means[0] - min(means[:2])) / math.log(budgets[1])
    return math.exp(-gap / slope) if slope > 0 else None


def ladder(pooled: dict) -> dict:
    """Per design: its losses' mean and sd, its gap to the baseline and its multiplier (in
    wall-clock terms with the mean of the step-time ratios); the baseline's fall per e-fold of
    budget, per larger budget, its mean and sd over seeds."""
    baseline, budgets = pooled["baseline"], pooled["budgets"]
    base = pooled["losses"][baseline]
    curves = budget_curves(base, pooled["budget_runs"])
    means = [statistics.fmean(curve[k] for curve in curves.values()) for k in range(len(budgets))]
    designs = {}
    for name, by_seed in pooled["losses"].items():
        mean, sd = mean_and_sd(list(by_seed.values()))
        entry = {"seeds": len(by_seed), "mean": mean, "sd": sd}
        if name != baseline:
            ratios = pooled["time_ratios"][name]
            ratio = sum(ratios) / len(ratios) if ratios else None
            gap = paired_difference(base, by_seed)
            budget = mean_curve_multiplier(budgets, means, gap["diff_mean"])
            # a larger gap is a smaller budget: the interval's upper end gives the lower multiplier
            ci = None if gap["ci95"] is None else [mean_curve_multiplier(budgets, means, g) for g in gap["ci95"][::-1]]
            in_time = ratio is not None and budget is not None
            mean_curve = {"budget": budget, "ci95": ci, "time": budget / ratio if in_time else None,
                          "time_ci95": [m / ratio for m in ci] if in_time and ci and None not in ci else None}
            entry |= {"gap": gap, "time_ratios": ratios, "mean_curve": mean_curve,
                      "multiplier": compute_equivalent(budgets, curves, {s: v for s, v in by_seed.items() if s in curves},
                                                       ratio)}
        designs[name] = entry
    falls = {}
    for k, b in enumerate(budgets[1:], start=1):
        per_seed = [(curve[0] - curve[k]) / math.log(b) for curve in curves.values()]
        falls[b] = mean_and_sd(per_seed)
    return {"baseline": baseline, "designs": designs, "fall_per_efold": falls, "seeds": sorted(curves, key=int),
            "baseline_means": dict(zip(budgets, means))}


def _budget(value: float | None, ci: list | None) -> str:
    """A multiplier and its interval as the table gives them (``beyond`` for an end without a value)."""
    if value is None:
        return "beyond"
    ends = "" if ci is None else " [" + ", ".join("beyond" if x is None else f"{x:.2f}" for x in ci) + "]"
    return f"{value:.2f}{ends}"


def markdown(numbers: dict) -> str:
    lines = ["| design | seeds | loss, mean ± sd | minus the baseline, 95% | multiplier, per seed [95%] | "
             "multiplier, mean curves [the gap's 95%] | in wall-clock terms, per seed; mean curves |",
             "|---|---|---|---|---|---|---|"]
    for name, e in numbers["designs"].items():
        sd = "" if e["sd"] is None else f" ± {e['sd']:.4f}"
        row = [name, str(e["seeds"]), f"{e['mean']:.4f}{sd}"]
        if "gap" in e:
            g, m, c = e["gap"], e["multiplier"], e["mean_curve"]
            ci = "one seed" if g["ci95"] is None else f"[{g['ci95'][0]:+.4f}, {g['ci95'][1]:+.4f}] {g['verdict']}"
            row.append(f"{g['diff_mean']:+.4f} {ci}")
            row.append(f"beyond ({m['beyond']})" if m["budget"] is None else _budget(m["budget"], m["ci95"]))
            row.append(_budget(c["budget"], c["ci95"]))
            ratios = ", ".join(f"{r:.3f}" for r in e["time_ratios"])
            per_seed = "-" if m["time"] is None else f"{m['time']:.2f}"
            from_means = "-" if c["time"] is None else _budget(c["time"], c["time_ci95"])
            row.append("" if not ratios else f"{per_seed}; {from_means} (step ratios {ratios})")
        else:
            row += ["(the baseline)", "", "", ""]
        lines.append("| " + " | ".join(row) + " |")
    falls = "; ".join(f"1 to {b:g}: {mean:.3f}" + ("" if sd is None else f" ± {sd:.3f}")
                      for b, (mean, sd) in numbers["fall_per_efold"].items())
    curve = ", ".join(f"{b:g}: {loss:.4f}" for b, loss in numbers["baseline_means"].items())
    lines.append("")
    lines.append(f"The baseline's fall per e-fold of budget, nats (mean ± sd over seeds {', '.join(numbers['seeds'])}): "
                 f"{falls}. Its mean loss at each budget: {curve}.")
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", nargs="+", type=Path, help="the ladder's comparison folders, seeds disjoint")
    parser.add_argument("--step-ratios", type=Path, metavar="CSV",
                        help="a paired step benchmark's CSV whose ratios replace the comparisons' own timing")
    args = parser.parse_args(argv)
    pooled = pool([folder_numbers(f) for f in args.folders])
    if args.step_ratios is not None:
        try:
            pooled["time_ratios"] = benchmark_ratios(args.step_ratios, list(pooled["losses"]), pooled["baseline"])
        except (OSError, ValueError) as error:
            parser.error(f"--step-ratios: {error}")
    print(markdown(ladder(pooled)))


if __name__ == "__main__":
    main()
