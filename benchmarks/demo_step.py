"""The training step at the size ``attnres compare`` runs at (the demo and study presets), every
design against PreNorm, through the trainer.

dim 96, 8 layers (16 sublayers), 4 heads, vocab 256, batch 16 x 128, fp32; each design as
``attnres compare`` builds it (``compare.DESIGNS``). A round trains every design for ``--steps``
steps in one process, one after another as a comparison does (``train()`` on one corpus, no
evaluation until the end); a design's time is the trainer's ``step_time_s`` (the mean over the
run's steps, the first included), and its ratio is taken per round against PreNorm's.

    python benchmarks/demo_step.py
    python benchmarks/demo_step.py --designs prenorm mhc --rounds 5 --steps 30
    python benchmarks/demo_step.py --set run.compile=true --csv demo_step_compiled
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import allocator, machine, print_table, ratio_summary, write_csv  # noqa: E402

from attnres.train.compare import DESIGNS, design_config  # noqa: E402
from attnres.train.config import apply_overrides, demo  # noqa: E402
from attnres.train.data import load_corpus  # noqa: E402
from attnres.train.trainer import train  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--designs", nargs="+", default=["prenorm", "block", "mhar", "full", "delta", "hc", "mhc", "gr"],
                    choices=sorted(DESIGNS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--set", dest="assignments", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="a config override applied to every design (as attnres train --set)")
    ap.add_argument("--csv", default="demo_step")
    args = ap.parse_args()
    if "prenorm" not in args.designs:
        args.designs.insert(0, "prenorm")

    base = demo()
    base.run = dataclasses.replace(base.run, steps=args.steps, eval_every=args.steps, log_every=args.steps,
                                   tensorboard=False, progress=False)
    base = apply_overrides(base, args.assignments)
    corpus = load_corpus(base.data, base.model.vocab_size)
    print(f"{machine()}; {allocator()}; {args.rounds} rounds of {args.steps} steps")

    times: dict[str, list[float]] = {d: [] for d in args.designs}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for design in args.designs:
                cfg = dataclasses.replace(base, model=design_config(base.model, design))
                summary = train(cfg, Path(tmp) / f"{design}-{r}", corpus=corpus).summary
                times[design].append(summary["step_time_s"])
                print(f"round {r} {design}: {summary['step_time_s'] * 1e3:.1f} ms per step", flush=True)

    summary = ratio_summary(times, "prenorm")
    rows = [dict(design=d, median_ms=summary[d]["median_s"] * 1e3, ratio=summary[d]["ratio"],
                 ratio_min=summary[d]["ratio_min"], ratio_max=summary[d]["ratio_max"],
                 rounds=args.rounds, steps=args.steps, settings=" ".join(args.assignments))
            for d in args.designs]
    print_table(rows, ["design", "median_ms", "ratio", "ratio_min", "ratio_max"])
    print(f"wrote {write_csv(args.csv, rows)}")


if __name__ == "__main__":
    main()
