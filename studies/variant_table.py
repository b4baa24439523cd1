"""Variants beside their designs, from a comparison (``attnres compare --designs full
full:norm_eps=1e-12 ...``): per label, the mean final validation loss over seeds, its paired
difference to a baseline design, and for a variant (``design:field=value...``) its paired
difference to its own design when the comparison ran it. Differences are paired over the seeds
both hold, with 95% Student-t intervals and verdicts (``analysis.stats.paired_difference``).

    python studies/variant_table.py runs/compare-<timestamp>        # a comparison's folder
    python studies/variant_table.py docs/study/eps6/results.json     # or its results.json
    python studies/variant_table.py FOLDER --baseline block
"""

from __future__ import annotations

import argparse
from pathlib import Path

from attnres.analysis.report import load_comparison
from attnres.analysis.stats import mean_and_sd, paired_difference
from attnres.files import read_json


def final_losses(source: Path) -> dict[str, dict[str, float]]:
    """label -> {seed: final validation loss}, from a comparison's folder (the seeds every
    design finished) or its ``results.json``."""
    if source.is_dir():
        results = load_comparison(source).results
    else:
        results = read_json(source)
    return {label: entry["val_loss"] for label, entry in results["designs"].items()}


def interval(base: dict[str, float] | None, design: dict[str, float]) -> str:
    """``design - base`` paired over their seeds, with its interval and verdict."""
    if base is None:
        return ""
    paired = paired_difference(base, design)
    if paired["ci95"] is None:
        return f"{paired['diff_mean']:+.4f} (one seed: no interval)"
    low, high = paired["ci95"]
    return f"{paired['diff_mean']:+.4f} [{low:+.4f}, {high:+.4f}] {paired['verdict']}"


def table(losses: dict[str, dict[str, float]], baseline: str = "prenorm") -> str:
    if baseline not in losses:
        raise SystemExit(f"baseline {baseline!r} is not among the designs {sorted(losses)}")
    lines = [f"| design | seeds | mean ± sd | - {baseline}, 95% | - its design, 95% |", "|---|---|---|---|---|"]
    for label, by_seed in losses.items():
        mean, sd = mean_and_sd(list(by_seed.values()))
        own = label.partition(":")[0]
        lines.append(" | ".join([
            f"| `{label}`", str(len(by_seed)), f"{mean:.4f}" + ("" if sd is None else f" ± {sd:.4f}"),
            interval(losses[baseline] if label != baseline else None, by_seed),
            interval(losses[own] if own != label and own in losses else None, by_seed),
        ]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a comparison's folder or its results.json")
    parser.add_argument("--baseline", default="prenorm")
    args = parser.parse_args()
    print(table(final_losses(args.source), args.baseline))
