"""Each design's training step against the baseline's, as ``attnres compare --budgets`` times
it before training (``experiments.step_times``: every run started through the trainer, one untimed
step each, then ``--rounds`` rounds of one step per design, the order reversed on odd rounds;
a figure is the median of the per-round ratios with their min..max), at the study's size or with
``--set`` overrides (e.g. ``model.n_layers=32``).

    python benchmarks/step_timing.py
    python benchmarks/step_timing.py --set model.n_layers=32 --rounds 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, write_csv  # noqa: E402

from attnres.experiments.compare import plan_comparison  # noqa: E402
from attnres.train.config import apply_overrides, preset  # noqa: E402
from attnres.train.data import load_corpus  # noqa: E402
from attnres.experiments.step_times import time_steps  # noqa: E402

FAIR = ["prenorm", "block:norm_eps=1e-12", "mhar:norm_eps=1e-12", "full:norm_eps=1e-12"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="study")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE")
    ap.add_argument("--designs", nargs="+", default=FAIR)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--csv", default="step_timing")
    args = ap.parse_args()
    print(machine())
    base = apply_overrides(preset(args.preset), args.set)
    plan = plan_comparison(base, args.designs, [0], {}, None)
    corpus = load_corpus(base.data, base.model.vocab_size)
    configs = {label: plan.run_config(label, 0) for label in args.designs}
    with tempfile.TemporaryDirectory() as scratch:
        times = time_steps(configs, plan.baseline, corpus, Path(scratch) / "steps", rounds=args.rounds)
    where = " ".join(args.set) or "the preset as it is"
    rows = [dict(preset=args.preset, settings=where, design=label, step_s=round(statistics.median(t["seconds"]), 4),
                 ratio=round(t["ratio"], 3), ratio_min=round(t["ratio_range"][0], 3),
                 ratio_max=round(t["ratio_range"][1], 3), rounds=t["rounds"]) for label, t in times.items()]
    print_table(rows, ["settings", "design", "step_s", "ratio", "ratio_min", "ratio_max"])
    print(f"wrote {write_csv(args.csv, rows)}")


if __name__ == "__main__":
    main()
