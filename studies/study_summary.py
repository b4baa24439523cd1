"""The numbers docs/RESULTS.md reads from a comparison folder (``attnres compare --preset study``).

    python studies/study_summary.py runs/compare-<timestamp> [runs/compare-<other> ...]
    python studies/study_summary.py runs/compare-<timestamp> --variant norm_eps=1e-12

``--variant OPTIONS`` reads the designs written with those options in one comparison (labels
``prenorm:norm_eps=1e-12``, ``block:norm_eps=1e-12``, ...) as the baselines and pairs above.

For each folder:

  final     every design's final validation loss against each baseline (PreNorm, Block), paired
            over seeds with the 95% Student-t interval (``analysis.report.comparison_results``)
  curve     the same paired difference at every evaluation along training (hypothesis 3)
  routing   per AttnRes design, the entropy of the token-averaged depth weights at each routing
            site, averaged over seeds and sites (nats; ``ln(number of sources)`` is uniform), and
            the RMS of the trained pseudo-queries (hypothesis 4)

With two folders trained on the same seeds (the study and a variant of it, e.g. ``--set
model.norm_eps=1e-12``), ``across`` pairs each design with itself over the seeds: the change the
variant makes, and the change in each design's gap to Block (hypothesis 2).
"""

from __future__ import annotations

import argparse
import math
import statistics
from pathlib import Path

from safetensors.torch import load_file

from attnres.analysis.report import by_design, comparison_results, load_runs, val_curve
from attnres.analysis.stats import paired_difference
from attnres.train.checkpoint import latest_checkpoint


def fmt(entry: dict) -> str:
    low, high = entry["ci95"] or (math.nan, math.nan)
    return f"{entry['diff_mean']:+.4f} [{low:+.4f}, {high:+.4f}] {entry['verdict']}"


def routing_summary(runs: list[dict]) -> tuple[float, float, float]:
    """Mean entropy of the token-averaged depth weights over sites, heads and seeds; the same
    for uniform weights over the sources each site reads (a window's are those of nonzero
    weight); and the RMS of the pseudo-queries, mean over seeds. Weights that are not a
    distribution (DenseFormer's free scalars) have no entropy: NaN."""
    entropies, uniform, query_rms = [], [], []
    for run in runs:
        for weights in run["analysis"]["depth_weights"].values():  # [N_sources][heads]
            for head in zip(*weights):
                if min(head) < 0 or abs(sum(head) - 1) > 1e-3:
                    continue
                entropies.append(-sum(w * math.log(w) for w in head if w > 0))
                uniform.append(math.log(sum(w > 0 for w in head)))
        ckpt = latest_checkpoint(Path(run["path"]) / "checkpoints")
        queries = load_file(str(ckpt / "model.safetensors")).get("stream.pseudo_queries")
        if queries is not None:  # learned mixing and DenseFormer have none
            query_rms.append(float(queries.square().mean().sqrt()))
    def mean(values):
        return statistics.fmean(values) if values else float("nan")

    return mean(entropies), mean(uniform), mean(query_rms)


def with_variant(name: str, variant: str) -> str:
    """The label of design ``name`` written with options ``variant`` (none: ``name`` itself)."""
    return f"{name}:{variant}" if variant else name


def summarize(folder: Path, variant: str = "") -> dict[str, list[dict]]:
    _, runs = load_runs(folder)
    for run in runs:
        run["path"] = folder / run["dir"]
    designs = by_design(runs)
    if variant and not any(name.endswith(f":{variant}") for name in designs):
        raise SystemExit(f"--variant {variant}: no design of {folder} is written with it; "
                         f"its designs are {list(designs)}")
    print(f"# {folder}: {len(next(iter(designs.values())))} seeds")

    def label(name: str) -> str:
        return with_variant(name, variant)

    for baseline in [label(b) for b in ("prenorm", "block") if label(b) in designs]:
        results = comparison_results(designs, baseline)["designs"]
        print(f"final, against {baseline}:")
        for name, entry in results.items():
            if name != baseline:
                print(f"  {name:8s} {fmt(entry)}")
    print("curve (paired difference at each evaluation):")
    for name, baseline in (("block", "prenorm"), ("full", "block"), ("mhar", "block"), ("full", "prenorm")):
        name, baseline = label(name), label(baseline)
        if name not in designs or baseline not in designs:
            continue
        base = {str(r["seed"]): val_curve(r) for r in designs[baseline]}
        own = {str(r["seed"]): val_curve(r) for r in designs[name]}
        points = []
        for tokens in sorted(next(iter(own.values()))):
            entry = paired_difference({s: c[tokens] for s, c in base.items()}, {s: c[tokens] for s, c in own.items()})
            points.append(f"{tokens // 1000}k: {fmt(entry)}")
        print(f"  {name} - {baseline}: " + "; ".join(points))
    print("routing (entropy of token-averaged depth weights, nats; uniform; pseudo-query RMS):")
    for name, group in designs.items():
        if group[0]["analysis"] and group[0]["analysis"]["depth_weights"]:
            entropy, uniform, rms = routing_summary(group)
            print(f"  {name:8s} {entropy:.3f} (uniform {uniform:.3f}); query RMS {rms:.4f}")
    return designs


def across(first: dict, second: dict, block: str = "block") -> None:
    """Each design of ``second`` against itself in ``first``, paired over seeds; and each
    design's gap to Block (the design labelled ``block``) in ``second`` against that in ``first``."""
    print("# across: second folder minus first, per design (paired over seeds)")
    losses = [{n: {str(r["seed"]): r["summary"]["final_val_loss"] for r in rs} for n, rs in d.items()}
              for d in (first, second)]
    for name in losses[1]:
        if name in losses[0]:
            print(f"  {name:8s} {fmt(paired_difference(losses[0][name], losses[1][name]))}")
    if block in losses[0] and block in losses[1]:
        for name in losses[1]:
            if name != block and name in losses[0]:
                gaps = [{s: d[name][s] - d[block][s] for s in d[name]} for d in losses]
                print(f"  gap {name} - {block}: {fmt(paired_difference(gaps[0], gaps[1]))}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("folders", type=Path, nargs="+", help="comparison folders")
    parser.add_argument("--variant", default="", metavar="OPTIONS",
                        help="read the designs written with these options, e.g. norm_eps=1e-12")
    args = parser.parse_args()
    summaries = [summarize(folder, args.variant) for folder in args.folders]
    if len(summaries) == 2:
        across(*summaries, block=with_variant("block", args.variant))


if __name__ == "__main__":
    main()
