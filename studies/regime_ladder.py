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
"""

from __future__ import annotations

import argparse
import csv
import math
from pathlib import Path

from attnres.analysis.budget import compute_equivalent
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


def ladder(pooled: dict) -> dict:
    """Per design: its losses' mean and sd, its gap to the baseline and its multiplier (in
    wall-clock terms with the mean of the step-time ratios); the baseline's fall per e-fold of
    budget, per larger budget, its mean and sd over seeds."""
    baseline, budgets = pooled["baseline"], pooled["budgets"]
    base = pooled["losses"][baseline]
    curves = budget_curves(base, pooled["budget_runs"])
    designs = {}
    for name, by_seed in pooled["losses"].items():
        mean, sd = mean_and_sd(list(by_seed.values()))
        entry = {"seeds": len(by_seed), "mean": mean, "sd": sd}
        if name != baseline:
            ratios = pooled["time_ratios"][name]
            ratio = sum(ratios) / len(ratios) if ratios else None
            entry |= {"gap": paired_difference(base, by_seed), "time_ratios": ratios,
                      "multiplier": compute_equivalent(budgets, curves, {s: v for s, v in by_seed.items() if s in curves},
                                                       ratio)}
        designs[name] = entry
    falls = {}
    for k, b in enumerate(budgets[1:], start=1):
        per_seed = [(curve[0] - curve[k]) / math.log(b) for curve in curves.values()]
        falls[b] = mean_and_sd(per_seed)
    return {"baseline": baseline, "designs": designs, "fall_per_efold": falls, "seeds": sorted(curves, key=int)}


def markdown(numbers: dict) -> str:
    lines = ["| design | seeds | loss, mean ± sd | minus the baseline, 95% | multiplier [95%] | in wall-clock terms |",
             "|---|---|---|---|---|---|"]
    for name, e in numbers["designs"].items():
        sd = "" if e["sd"] is None else f" ± {e['sd']:.4f}"
        row = [name, str(e["seeds"]), f"{e['mean']:.4f}{sd}"]
        if "gap" in e:
            g, m = e["gap"], e["multiplier"]
            ci = "one seed" if g["ci95"] is None else f"[{g['ci95'][0]:+.4f}, {g['ci95'][1]:+.4f}] {g['verdict']}"
            row.append(f"{g['diff_mean']:+.4f} {ci}")
            if m["budget"] is None:
                row += [f"beyond ({m['beyond']})", ""]
            else:
                mci = "" if m["ci95"] is None else f" [{m['ci95'][0]:.2f}, {m['ci95'][1]:.2f}]"
                row.append(f"{m['budget']:.2f}{mci}")
                ratios = ", ".join(f"{r:.3f}" for r in e["time_ratios"])
                row.append("" if m["time"] is None else f"{m['time']:.2f} (step ratios {ratios})")
        else:
            row += ["(the baseline)", "", ""]
        lines.append("| " + " | ".join(row) + " |")
    falls = "; ".join(f"1 to {b:g}: {mean:.3f}" + ("" if sd is None else f" ± {sd:.3f}")
                      for b, (mean, sd) in numbers["fall_per_efold"].items())
    lines.append("")
    lines.append(f"The baseline's fall per e-fold of budget, nats (mean ± sd over seeds {', '.join(numbers['seeds'])}): "
                 f"{falls}.")
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
