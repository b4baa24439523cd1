"""The ladders' tables and figures (docs/RESULTS.md, "Ladders"), from their folders:

    python studies/ladder_tables.py --compute runs/ladder-compute/compare-<ts> \\
        --depth runs/ladder-depth/sweep-<ts> --depth16 runs/ladder-depth16/compare-<ts> \\
        --width runs/ladder-width/sweep-<ts> --out docs/study/ladders

Depth gathers its points from three places (the plan in RESULTS.md): 4 and 32 layers from the
depth sweep (with PreNorm's budgets 1, 2 and 3), 16 layers from its own comparison, and 8 layers
from the compute ladder's seeds 0-2 (the same config, so the same runs). Every difference is
paired over the seeds both runs hold, 95% Student-t (``analysis.stats.paired_difference``); a
multiplier is ``analysis.budget.compute_equivalent`` over the seeds of its point; a change of
gap between the shallowest and deepest points is paired by seed too, and each design's
hidden-state RMS at the output's read (its last ``read_rms``) is given per depth: PreNorm's
dilution. Markdown goes to stdout; the figures and ``ladders.json`` to ``--out``: ``depth.png``
and ``width.png``, each design's gap to the baseline per point, and ``width_routing.png``,
single-head Block minus MHAR and Block's width probe per width. Any of the folders may be left
out; its tables and figures are then left out too, and so is its part of ``ladders.json``, which
is written anew each time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from attnres.analysis.budget import compute_equivalent
from attnres.analysis.comparison import budget_curves, load_comparison
from attnres.analysis.figures import pyplot, save_figure
from attnres.analysis.stats import mean_and_sd, paired_difference
from attnres.files import read_json

DEPTH_SEEDS = ("0", "1", "2")


def point_numbers(folder: Path, seeds=None) -> dict:
    """One comparison's numbers: per design its final losses by seed (restricted to ``seeds``
    when given), its paired gap to the baseline, its multiplier where the baseline trained at
    larger budgets, and the width probe of each run that has one."""
    c = load_comparison(folder)
    keep = (lambda s: s in seeds) if seeds else (lambda s: True)
    losses = {name: {s: v for s, v in e["val_loss"].items() if keep(s)} for name, e in c.results["designs"].items()}
    base = losses[c.baseline]
    curves = budget_curves(base, c.results["budget_runs"]) if c.results.get("budgets") else None
    designs = {}
    for name, by_seed in losses.items():
        if not by_seed:
            raise ValueError(f"{folder}: design {name!r} has no finished run among seeds {sorted(seeds or [])}")
        mean, sd = mean_and_sd(list(by_seed.values()))
        entry = {"val_loss": by_seed, "mean": mean, "sd": sd}
        if name != c.baseline:  # a pair that read other tokens is not compared (the report's rule)
            compared = c.results["designs"][name].get("diff_mean") is not None
            entry["gap"] = paired_difference(base, by_seed) if compared else None
        if curves:
            times = (c.record.step_times or {}).get(name, {})
            entry["compute_equivalent"] = compute_equivalent(c.results["budgets"], curves,
                                                             {s: v for s, v in by_seed.items() if s in curves},
                                                             times.get("ratio"))
        # the width probe of single-head runs; the hidden state's RMS where the output reads it
        # (the last ``read_rms``), where PreNorm's sum has grown over every sublayer
        for key, field, pick in (("width_probe", "width_probe", lambda v: v["probe"]),
                                 ("output_rms", "read_rms", lambda v: v[-1])):
            by_seed = {str(r["seed"]): pick(r["analysis"][field]) for r in c.designs[name]
                       if keep(str(r["seed"])) and r["analysis"] and r["analysis"].get(field)}
            if by_seed:
                entry[key] = by_seed
        designs[name] = entry
    return {"baseline": c.baseline, "budgets": c.results.get("budgets"), "designs": designs,
            "model": c.record.config["model"]}


def sweep_points(folder: Path) -> list[tuple[dict, Path]]:
    index = read_json(folder / "sweep.json")
    return [(p["values"], folder / p["dir"]) for p in index["points"]]


def fmt_interval(diff: dict) -> str:
    """A paired difference (``paired_difference``) as its mean and 95% interval."""
    if diff["ci95"] is None:
        return f"{diff['diff_mean']:+.4f} (one seed)"
    low, high = diff["ci95"]
    return f"{diff['diff_mean']:+.4f} [{low:+.4f}, {high:+.4f}]"


def fmt_gap(gap: dict | None) -> str:
    if gap is None:
        return "not compared: other tokens"
    return fmt_interval(gap) + ("" if gap["ci95"] is None else f" {gap['verdict']}")


def fmt_multiplier(ce: dict | None) -> str:
    """The multiplier with its interval, then the same in wall-clock terms."""
    if ce is None:
        return ""
    if ce["budget"] is None:
        return f"beyond ({ce['beyond']})"
    ci = "" if ce["ci95"] is None else f" [{ce['ci95'][0]:.2f}, {ce['ci95'][1]:.2f}]"
    if ce["time"] is None:
        return f"{ce['budget']:.2f}{ci}"
    tci = "" if ce["time_ci95"] is None else f" [{ce['time_ci95'][0]:.2f}, {ce['time_ci95'][1]:.2f}]"
    return f"{ce['budget']:.2f}{ci}; time {ce['time']:.2f}{tci}"


def fmt_mean(by_seed: dict[str, float] | None, digits: int = 2) -> str:
    """Mean ± sd over seeds."""
    if not by_seed:
        return ""
    mean, sd = mean_and_sd(list(by_seed.values()))
    return f"{mean:.{digits}f}" + ("" if sd is None else f" ± {sd:.{digits}f}")


def seeds_text(points: dict[str, dict]) -> str:
    seeds = sorted({s for p in points.values() for e in p["designs"].values() for s in e["val_loss"]}, key=int)
    return "seed " + seeds[0] if len(seeds) == 1 else "seeds " + ", ".join(seeds)


def gap_table(points: dict[str, dict], column: str) -> list[str]:
    """Rows per point: the baseline's loss, each design's gap and multiplier."""
    first = next(iter(points.values()))
    names = [n for n in first["designs"] if n != first["baseline"]]
    lines = [f"| {column} | {first['baseline']} loss | " + " | ".join(f"{n} gap" for n in names) + " |",
             "|---" * (2 + len(names)) + "|"]
    for where, p in points.items():
        base = p["designs"][p["baseline"]]
        sd = "" if base["sd"] is None else f" ± {base['sd']:.4f}"
        lines.append(f"| {where} | {base['mean']:.4f}{sd} | "
                     + " | ".join(fmt_gap(p["designs"][n]["gap"]) for n in names) + " |")
    with_budgets = {w: p for w, p in points.items() if p["budgets"]}
    if with_budgets:
        lines += ["", f"| {column} | budgets | " + " | ".join(f"{n} multiplier" for n in names) + " |",
                  "|---" * (2 + len(names)) + "|"]
        for where, p in with_budgets.items():
            lines.append(f"| {where} | {' '.join(f'{b:g}' for b in p['budgets'])} | "
                         + " | ".join(fmt_multiplier(p["designs"][n].get("compute_equivalent")) for n in names) + " |")
    return lines


def error_bars(gaps: list[dict]) -> tuple[list[float], list[list[float]]]:
    """Paired differences (``paired_difference``) as matplotlib's means and ``yerr``: each
    interval's distance below and above its mean, 0 where a difference has no interval."""
    mids = [g["diff_mean"] for g in gaps]
    return mids, [[m - g["ci95"][0] if g["ci95"] else 0 for m, g in zip(mids, gaps)],
                  [g["ci95"][1] - m if g["ci95"] else 0 for m, g in zip(mids, gaps)]]


def draw_gaps(points: dict[str, dict], xlabel: str, path: Path) -> None:
    """Each design's gap to the baseline against the ladder's points, with its paired interval;
    beside it the baseline's own final loss."""
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    first = next(iter(points.values()))
    names = [n for n in first["designs"] if n != first["baseline"]]
    xs = list(range(len(points)))
    width = 0.5 / max(1, len(names))
    for k, name in enumerate(names):
        gaps = [p["designs"][name]["gap"] or {"diff_mean": float("nan"), "ci95": None} for p in points.values()]
        mids, err = error_bars(gaps)
        ax.errorbar([x + (k - (len(names) - 1) / 2) * width for x in xs], mids, yerr=err, marker="o", ms=4,
                    capsize=3, label=name, color=f"C{k + 1}")
    ax.axhline(0, color="C0", lw=1, label=first["baseline"])
    ax.set_xticks(xs, list(points))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(f"final loss - {first['baseline']} (nats/token)")
    ax.legend(fontsize=8)
    base = [p["designs"][p["baseline"]] for p in points.values()]
    bx.errorbar(xs, [b["mean"] for b in base], yerr=[b["sd"] or 0 for b in base], marker="o", capsize=3, color="C0")
    bx.set_xticks(xs, list(points))
    bx.set_xlabel(xlabel)
    bx.set_ylabel(f"{first['baseline']} final loss (mean ± sd over seeds)")
    save_figure(plt, fig, path)


def seed_gaps(point: dict, name: str) -> dict[str, float]:
    """A design's final loss minus the baseline's, per seed both ran: what a ladder's change of
    gap between two points pairs (each seed reads the same batches at every point)."""
    base, design = point["designs"][point["baseline"]]["val_loss"], point["designs"][name]["val_loss"]
    return {s: design[s] - base[s] for s in design if s in base}


def single_and_multi_head(point: dict) -> tuple[dict, dict]:
    """A width point's single-head Block and its MHAR, by their labels' names."""
    found = {k: [e for n, e in point["designs"].items() if n.startswith(k)] for k in ("block", "mhar")}
    if any(len(v) != 1 for v in found.values()):
        raise ValueError(f"a width point compares one block and one mhar design; it holds {sorted(point['designs'])}")
    return found["block"][0], found["mhar"][0]


def draw_width_routing(width: dict[str, dict], path: Path) -> None:
    """The width hypothesis's two measures against width: single-head Block minus MHAR, paired
    over seeds with its 95% interval, and Block's width-disagreement probe, a line a seed and their mean."""
    plt = pyplot()
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(10, 4))
    xs = list(range(len(width)))
    gaps, probes = [], []
    for p in width.values():
        block, mhar = single_and_multi_head(p)
        gaps.append(paired_difference(mhar["val_loss"], block["val_loss"]))
        probes.append(block.get("width_probe", {}))
    mids, err = error_bars(gaps)
    ax.errorbar(xs, mids, yerr=err, marker="o", capsize=3, color="C1", label="Block (1 routing head) - MHAR")
    ax.axhline(0, color="C2", lw=1, label="MHAR (heads = n_kv_heads)")
    ax.set_ylabel("single-head Block - MHAR, final loss (nats/token)")
    ax.legend(fontsize=8)
    for k, seed in enumerate(sorted({s for p in probes for s in p}, key=int)):  # a thin line a seed: does each rise?
        bx.plot(xs, [p.get(seed, float("nan")) for p in probes], "o-", ms=4, lw=0.8, color="C1", alpha=0.5,
                label=None if k else "each seed")
    bx.plot(xs, [sum(p.values()) / len(p) if p else float("nan") for p in probes], "-", lw=2, color="C1",
            label="mean over seeds")
    bx.set_ylabel("Block's width-disagreement probe (4 slices)")
    bx.legend(fontsize=8)
    for axis in (ax, bx):
        axis.set_xticks(xs, list(width))
        axis.set_xlabel("width (model.dim; head width 24)")
    save_figure(plt, fig, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compute", type=Path)
    parser.add_argument("--depth", type=Path, help="the depth sweep (4 and 32 layers, with budgets)")
    parser.add_argument("--depth16", type=Path, help="the comparison at 16 layers")
    parser.add_argument("--width", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    out = {}
    if args.compute:
        out["compute"] = point_numbers(args.compute)
        print(f"### Compute (the study's size, {seeds_text({'': out['compute']})})\n")
        print("\n".join(gap_table({"the study's size": out["compute"]}, "point")) + "\n")
    folders = [folder for _, folder in sweep_points(args.depth)] if args.depth else []
    folders += [f for f in (args.depth16, args.compute) if f]
    depth = [point_numbers(f, DEPTH_SEEDS) for f in folders if (f / "compare.json").is_file()]
    layers = [p["model"]["n_layers"] for p in depth]
    if len(set(layers)) != len(layers):
        raise ValueError(f"the depth folders hold n_layers {sorted(layers)}: give each depth once")
    if depth:
        depth = {f"{p['model']['n_layers']} layers": p for p in sorted(depth, key=lambda p: p["model"]["n_layers"])}
        out["depth"] = depth
        print(f"### Depth ({seeds_text(depth)})\n")
        print("\n".join(gap_table(depth, "depth")) + "\n")
        shallow, deep = list(depth)[0], list(depth)[-1]
        if shallow != deep:
            print(f"Each gap at {deep} minus at {shallow}, paired by seed (negative: the gap widens with depth):\n")
            for name in depth[deep]["designs"]:
                if name != depth[deep]["baseline"]:
                    change = paired_difference(*(seed_gaps(depth[w], name) for w in (shallow, deep)))
                    verdict = {"better": "widens", "worse": "narrows"}.get(change["verdict"], change["verdict"])
                    print(f"- {name}: {fmt_gap({**change, 'verdict': verdict})}")
            print()
        names = list(depth[deep]["designs"])
        print("| depth | " + " | ".join(f"{n} output read's RMS" for n in names) + " |",
              "|---" * (1 + len(names)) + "|", sep="\n")
        for where, p in depth.items():
            print(f"| {where} | " + " | ".join(fmt_mean(p["designs"][n].get("output_rms")) for n in names) + " |")
        print()
        draw_gaps(depth, "depth (layers; 8 blocks each)", args.out / "depth.png")
    if args.width:
        width = {f"dim {values['model.dim']}": point_numbers(folder) for values, folder in sweep_points(args.width)
                 if (folder / "compare.json").is_file()}
        out["width"] = width
        print(f"### Width ({seeds_text(width)})\n")
        print("\n".join(gap_table(width, "width")) + "\n")
        print("| width | block - mhar | block's width probe (4 slices), per seed | mean ± sd |",
              "|---|---|---|---|", sep="\n")
        for where, p in width.items():
            block, mhar = single_and_multi_head(p)
            probes = block.get("width_probe", {})
            print(f"| {where} | {fmt_gap(paired_difference(mhar['val_loss'], block['val_loss']))} | "
                  + ", ".join(f"{probes[s]:+.4f}" for s in sorted(probes, key=int)) + f" | {fmt_mean(probes, 4)} |")
        narrow, wide = list(width)[0], list(width)[-1]
        ends = [single_and_multi_head(width[w])[0].get("width_probe", {}) for w in (narrow, wide)]
        if narrow != wide and set(ends[0]) & set(ends[1]):  # the same seed saw the same batches at every width
            rise = fmt_interval(paired_difference(*ends))
            print(f"\nBlock's probe at {wide} minus at {narrow}, paired by seed: {rise}")
        print()
        draw_gaps(width, "width (model.dim; head width 24)", args.out / "width.png")
        draw_width_routing(width, args.out / "width_routing.png")
    (args.out / "ladders.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
