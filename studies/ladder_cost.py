"""A pilot that sizes the ladders (docs/RESULTS.md, "Ladders") before they run: at each point,
one training step of every design timed against PreNorm's, interleaved (``experiments.step_times``,
the timing ``compare --budgets`` does itself), then each run's minutes estimated as its steps
times its step, times the share of a run that evaluation and analysis add (``--overhead``,
measured from a finished study run: wall time over steps times step time).

    python studies/ladder_cost.py                  # the adopted plan, on a quiet machine
    python studies/ladder_cost.py --plan planned   # the set as first planned
    python studies/ladder_cost.py --ladder depth

The estimates hold only on a quiet machine: run it with nothing else training.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from attnres.experiments.compare import plan_comparison
from attnres.train.config import preset
from attnres.train.data import load_corpus
from attnres.experiments.step_times import time_steps
from attnres.experiments.sweep import point_config

FAIR = ["prenorm", "block:norm_eps=1e-12", "mhar:norm_eps=1e-12", "full:norm_eps=1e-12"]
WIDTHS = [{"model.dim": d, "model.n_heads": h} for d, h in (("48", "2"), ("96", "4"), ("192", "8"))]
#: plan -> ladder -> (points, designs, seeds, budgets: the baseline's multiples beside the designs' run).
#: "planned" is the set as first written down; "adopted" the cut that runs (docs/RESULTS.md):
#: depth's budgets 1 2 3 in the sweep over 4 and 32 layers, 16 layers its own comparison, 8 layers
#: the compute ladder's seeds 0-2.
PLANS = {
    "planned": {
        "depth": ([{"model.n_layers": n} for n in ("4", "8", "16", "32")], FAIR, 3, (1,)),
        "depth-budgets": ([{"model.n_layers": n} for n in ("4", "32")], FAIR, 3, (1, 1.5, 2, 3)),
        "width": (WIDTHS, ["prenorm", "block:norm_eps=1e-12", "mhar:norm_eps=1e-12"], 3, (1,)),
        "compute": ([{}], FAIR, 6, (1, 1.5, 2, 3)),
    },
    "adopted": {
        "depth": ([{"model.n_layers": n} for n in ("4", "32")], FAIR, 3, (1, 2, 3)),
        "depth16": ([{"model.n_layers": "16"}], FAIR, 3, (1,)),
        "width": (WIDTHS, ["prenorm", "block:norm_eps=1e-12", "mhar:norm_eps=1e-12"], 3, (1,)),
        "compute": ([{}], FAIR, 6, (1, 1.5, 2, 3)),
    },
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plan", choices=sorted(PLANS), default="adopted")
    parser.add_argument("--ladder", nargs="*", help="some of the plan's ladders (default: all)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--overhead", type=float, default=1.15,
                        help="a run's wall time over its steps' time (evaluation, checkpoints, analysis)")
    args = parser.parse_args()
    ladders = PLANS[args.plan]
    unknown = sorted(set(args.ladder or ()) - set(ladders))
    if unknown:
        parser.error(f"--ladder {unknown}: the {args.plan} plan has {sorted(ladders)}")
    base = preset("study")
    corpus = load_corpus(base.data, base.model.vocab_size)
    grand = 0.0
    for name in args.ladder or ladders:
        points, designs, seeds, budgets = ladders[name]
        total = 0.0
        for point in points:
            cfg = point_config(base, point)
            plan = plan_comparison(cfg, designs, [0], {}, None)
            configs = {label: plan.run_config(label, 0) for label in designs}
            with tempfile.TemporaryDirectory() as scratch:
                times = time_steps(configs, "prenorm", corpus, Path(scratch) / "t", rounds=args.rounds)
            steps = cfg.run.steps
            minutes = {label: sorted(t["seconds"])[len(t["seconds"]) // 2] * steps * args.overhead / 60
                       for label, t in times.items()}
            extra = sum(b for b in budgets if b != 1) * minutes["prenorm"]
            point_total = seeds * (sum(minutes.values()) + extra)
            total += point_total
            where = ", ".join(f"{k}={v}" for k, v in point.items()) or "study size"
            each = ", ".join(f"{label} {m:.1f}" for label, m in minutes.items())
            print(f"{name} [{where}]: minutes a run: {each}; budget runs {extra:.1f}; "
                  f"x{seeds} seeds = {point_total:.0f} min", flush=True)
        grand += total
        print(f"{name}: {total:.0f} min ({total / 60:.1f} h)", flush=True)
    print(f"all: {grand:.0f} min ({grand / 60:.1f} h)")


if __name__ == "__main__":
    main()
