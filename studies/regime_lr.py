"""The numbers docs/RESULTS.md reads from the regime's learning-rate sweeps ("Each design's
learning rate").

    python studies/regime_lr.py docs/study/regime-lr/sweep-<timestamp> [more sweeps over optim.lr]

Each folder is an ``attnres sweep --over optim.lr=...``; several are read as one grid (an
extension past an end of the first). A sweep over another field whose designs name their own
rates (``--over model.n_layers=4,32 --designs block:lr=5e-3 block:lr=8e-3 ...``, the depth check)
is read as one grid per design and point, named ``block (model.n_layers=32)``. Printed:

  grid      each design's final validation loss at each rate: the mean over the seeds, and each seed
  best      each design's best rate by the rule written before the run (the lowest mean over the
            seeds; "at an end" where that is the grid's lowest or highest rate, which the rule
            extends before choosing)
  gaps      each design's gap to PreNorm, paired over seeds, with both at their own best rates and
            with both at ``--common`` (3e-3, the rate every earlier table used): hypothesis 3
  seeds     the ladder's number of seeds: with ``s`` the largest sd over seeds of a design's paired
            difference to PreNorm at the best rates (at least ``--min-sd``), the smallest ``n`` with
            ``(t(0.975, n-1) + t(0.8, n-1)) s / sqrt(n) <= --gap``; where it exceeds ``--max-seeds``,
            the smallest gap that many seeds resolve
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
from pathlib import Path

from scipy import stats


def split_rate(label: str) -> tuple[str, float | None]:
    """``block:lr=5e-3`` -> (``block``, 0.005); a label without ``lr=`` -> (label, None)."""
    parts = label.split(":")
    rates = [part for part in parts if part.startswith("lr=")]
    if not rates:
        return label, None
    return ":".join(part for part in parts if part not in rates), float(rates[0][len("lr="):])


def read_grid(folders: list[Path]) -> dict[str, dict[float, dict[int, float]]]:
    """design -> rate -> seed -> final validation loss, over every point of every sweep. In a
    sweep over another field the rate is the label's and the design names the point."""
    grid: dict[str, dict[float, dict[int, float]]] = {}
    for folder in folders:
        index = json.loads((folder / "sweep.json").read_text())
        over_rate = list(index["over"]) == ["optim.lr"]
        for point in index["points"]:
            results_file = folder / point["dir"] / "results.json"
            if not results_file.is_file():
                continue
            for label, entry in json.loads(results_file.read_text())["designs"].items():
                if over_rate:
                    design, rate = label, float(point["values"]["optim.lr"])
                else:
                    design, rate = split_rate(label)
                    if rate is None:
                        raise SystemExit(f"{folder}: a sweep over {list(index['over'])} whose design "
                                         f"{label!r} names no rate (lr=...)")
                    where = ", ".join(f"{field}={value}" for field, value in point["values"].items())
                    design = f"{design} ({where})"
                losses = {int(seed): loss for seed, loss in entry["val_loss"].items()}
                grid.setdefault(design, {}).setdefault(rate, {}).update(losses)
    return grid


def best_rates(grid, seeds: list[int]) -> dict[str, tuple[float, bool]]:
    """design -> (its best rate, whether that is an end of its grid), over rates every seed reached."""
    best = {}
    for label, rates in grid.items():
        full = {rate: statistics.mean(losses[s] for s in seeds) for rate, losses in rates.items()
                if all(s in losses for s in seeds)}
        if not full:
            continue
        rate = min(full, key=full.get)
        best[label] = (rate, rate in (min(rates), max(rates)))
    return best


def paired(grid, label: str, rate: float, base: str, base_rate: float, seeds: list[int]) -> list[float]:
    return [grid[label][rate][s] - grid[base][base_rate][s] for s in seeds]


def seeds_needed(s: float, gap: float, most: int) -> tuple[int | None, float]:
    """The smallest n (2..most) with 80% power to resolve ``gap`` at sd ``s``, and the gap
    ``most`` seeds resolve."""
    def resolvable(n: int) -> float:
        return (stats.t.ppf(0.975, n - 1) + stats.t.ppf(0.8, n - 1)) * s / math.sqrt(n)

    n = next((n for n in range(2, most + 1) if resolvable(n) <= gap), None)
    return n, resolvable(most)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+", type=Path)
    parser.add_argument("--baseline", default="prenorm")
    parser.add_argument("--common", type=float, default=3e-3)
    parser.add_argument("--gap", type=float, default=0.02)
    parser.add_argument("--min-sd", type=float, default=0.03)
    parser.add_argument("--max-seeds", type=int, default=12)
    args = parser.parse_args()
    grid = read_grid(args.folders)
    seeds = sorted({s for rates in grid.values() for losses in rates.values() for s in losses})
    width = max(map(len, grid), default=0)
    print("grid (mean over seeds; each seed)")
    for label, rates in grid.items():
        for rate in sorted(rates):
            losses = rates[rate]
            each = ", ".join(f"{losses[s]:.4f}" for s in seeds if s in losses)
            print(f"  {label:{width}s} {rate:g}: {statistics.mean(losses.values()):.4f} ({each})")
    best = best_rates(grid, seeds)
    print("best")
    for label, (rate, edge) in best.items():
        print(f"  {label:{width}s} {rate:g}{'  (at an end of the grid)' if edge else ''}")
    if args.baseline not in best or len(seeds) < 2:
        return
    base_rate = best[args.baseline][0]
    print(f"gaps to {args.baseline} (mean over seeds {seeds}; own best rates / both at {args.common:g})")
    spread = []
    for label, (rate, _) in best.items():
        if label == args.baseline:
            continue
        own = paired(grid, label, rate, args.baseline, base_rate, seeds)
        spread.append(statistics.stdev(own))
        line = f"  {label:{width}s} {statistics.mean(own):+.4f} (sd {statistics.stdev(own):.4f})"
        if args.common in grid[label] and args.common in grid[args.baseline]:
            common = paired(grid, label, args.common, args.baseline, args.common, seeds)
            line += f" / {statistics.mean(common):+.4f}; change {statistics.mean(own) - statistics.mean(common):+.4f}"
        print(line)
    s = max(max(spread), args.min_sd)
    n, resolved = seeds_needed(s, args.gap, args.max_seeds)
    print(f"seeds: s = {s:.4f} (largest sd {max(spread):.4f}, at least {args.min_sd}); "
          + (f"n = {n} resolves {args.gap} nats with 80% power" if n is not None else
             f"more than {args.max_seeds} needed for {args.gap}; {args.max_seeds} resolve {resolved:.4f}"))


if __name__ == "__main__":
    main()
