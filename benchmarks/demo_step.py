"""The training step at the size ``attnres compare`` runs at (the demo and study presets), every
design against PreNorm, through the trainer.

dim 96, 8 layers (16 sublayers), 4 heads, vocab 256, batch 16 x 128, fp32; each design as
``attnres compare`` builds it (``names.DESIGNS``). A round trains every design for ``--steps``
steps in one process, one after another as a comparison does (``train()`` on one corpus, no
evaluation until the end); a design's time is the trainer's ``step_time_s`` (the mean over the
run's steps, the first included), and its ratio is taken per round against PreNorm's; ``later``
is the time per step from the first logged step (the 10th) to the last.

    python benchmarks/demo_step.py
    python benchmarks/demo_step.py --designs prenorm mhc --rounds 5 --steps 30
    python benchmarks/demo_step.py --designs prenorm block full --compiled --steps 160 --csv demo_step_compiled
    python benchmarks/demo_step.py --designs prenorm hc mhc gr --revisions 2374d2b --rounds 7

``--revisions REV ...`` also trains every design on the package as it was at each git revision
(rows ``design@REV``, against ``prenorm@REV`` of the same round), each right after the current
code's run of that design, and writes the current code against each revision
(``<csv>_against.csv``: the median and min..max of the per-round ratios now / then).

``--compiled`` adds each design trained with ``run.compile=true`` (rows ``design+compile``, against
the eager PreNorm of the round): compilation happens in the first steps and counts, as it does in
a comparison (the on-disk inductor cache is warm after the first round, as on any second run).

``--paired`` pairs the designs step by step instead of run by run: every design's run is started
once (the trainer's ``start``: its model, optimizer and batches), trained ``--steps`` steps
untimed, then ``--rounds`` rounds (at least 6) of one step each (the trainer's ``train_step``,
its ``seconds``), every design in turn, all on the same batch in a round, in the listed order on
even rounds and the reverse order on odd ones (so that no variant always runs first, or right
after the same one). The runs' schedules are twice as long as what is timed, so that no timed
step records the per-layer gradient norms of a run's last 10% of steps. A design's ratio is
taken per round against PreNorm's step of the same round (``<csv>_paired.csv``), with a 95%
interval for the median of those ratios (distribution-free: order statistics,
``median_interval``; scipy, from the ``report`` extra). A round lasts a few seconds, so a slow
stretch of the machine (runs of PreNorm alone range over +-20% across the rounds of a
run-by-run comparison) falls on every design of the round alike; the interval covers the rounds
of one run, not the machine's state over a day (see docs/BENCHMARKS.md, D7).

    python benchmarks/demo_step.py --paired --rounds 100 --steps 10
    python benchmarks/demo_step.py --paired --rounds 100 --steps 10 --revisions 2f34bf8

``--preset regime`` times the regime's size instead (dim 48, 2 heads, the same batch; docs/RESULTS.md,
"The papers' regime"), whose compute ladder needs each design's step against PreNorm's.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import math
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    against_revisions,
    import_revision,
    machine,
    own_baseline,
    print_table,
    ratio_to_own_baseline,
    span,
    split_variant,
    with_revisions,
    write_csv,
)

import attnres  # noqa: E402
from attnres.names import DESIGNS  # noqa: E402


class Package:
    """What a run needs from the package at one revision (None: the current code)."""

    def __init__(self, rev: str | None, steps: int, assignments: list[str], preset: str = "demo"):
        root = attnres if rev is None else import_revision(rev)

        def module(name: str):
            """The revision's module ``name``: under ``train/``, or ``experiments/`` where the
            comparisons have lived since they moved out of it."""
            for place in ("train", "experiments"):
                full = f"{root.__name__}.{place}.{name}"
                try:
                    return importlib.import_module(full)
                except ModuleNotFoundError as err:
                    if err.name != full:
                        raise
            raise ModuleNotFoundError(f"no module {name!r} under train/ or experiments/", name=name)

        config, compare = module("config"), module("compare")
        self.trainer = module("trainer")
        try:  # the placement of one process, as the revision's trainer takes it
            run_plan = module("parallel_plan").run_plan
            self.start_processes = lambda cfg: self.trainer.start_processes(cfg, run_plan(cfg, 1))
        except ModuleNotFoundError:  # a revision from before the parallel plan
            self.start_processes = self.trainer.start_processes
        try:  # where the revision makes a design's config
            designs = module("designs")
        except ModuleNotFoundError:
            designs = compare
        self.train, self.design_config = self.trainer.train, designs.design_config
        base = getattr(config, preset)()
        base.run = dataclasses.replace(base.run, steps=steps, eval_every=steps, log_every=min(10, steps),
                                       tensorboard=False, progress=False)
        self.base = config.apply_overrides(base, assignments)
        self.corpus = module("data").load_corpus(self.base.data, self.base.model.vocab_size)


def steady_step_time(metrics: Path) -> float:
    """Seconds per step between the run's first and last logged training steps (the first steps,
    and a compilation, left out), from the cumulative tokens per second the trainer logs."""
    logged = [row for row in map(json.loads, metrics.read_text().splitlines()) if row.get("split") == "train"]
    first, last = logged[0], logged[-1]
    if first["step"] == last["step"]:
        return float("nan")
    elapsed = last["tokens"] / last["tokens_per_s"] - first["tokens"] / first["tokens_per_s"]
    return elapsed / (last["step"] - first["step"])


def paired_times(packages: dict, variants: list[str], rounds: int, warmup: int, tmp: Path
                 ) -> dict[str, list[float]]:
    """Seconds of each variant's training steps, one step of every variant per round (after
    ``warmup`` untimed steps each), through the trainer's ``start`` and ``train_step``."""
    runs = {}
    for variant in variants:
        design, rev = split_variant(variant)
        package = packages[rev]
        trainer = package.trainer
        cfg = dataclasses.replace(package.base, model=package.design_config(package.base.model, design))
        cfg, corpus = trainer.load_data(cfg, tmp / variant, package.corpus)
        runs[variant] = (trainer, trainer.start(cfg, tmp / variant, corpus, package.start_processes(cfg)))
    for step in range(warmup):
        for trainer, run in runs.values():
            trainer.train_step(run, step, False)
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    for r in range(rounds):
        order = list(runs.items())
        for variant, (trainer, run) in order if r % 2 == 0 else reversed(order):
            times[variant].append(trainer.train_step(run, warmup + r, False).seconds)
        if r % 10 == 9:
            print(f"round {r + 1}: " + ", ".join(f"{v} {ts[-1] * 1e3:.0f}" for v, ts in times.items()) + " ms",
                  flush=True)
    return times


def median_interval(values: list[float], level: float = 0.95) -> tuple[float, float]:
    """A distribution-free interval for the median of ``values`` (independent draws): the order
    statistics whose ranks the binomial distribution Bin(n, 1/2) puts ``level`` between (at
    n = 100, the 40th and the 61st). NaNs where n is too small for ``level`` (n < 6 at 95%)."""
    from scipy.stats import binom

    ordered, n = sorted(values), len(values)
    low = int(binom.ppf((1 - level) / 2, n, 0.5))  # rank, from 1
    if low < 1:
        return math.nan, math.nan
    return ordered[low - 1], ordered[n - low]


def paired(args) -> None:
    packages = {rev: Package(rev, 2 * (args.steps + args.rounds), args.assignments, args.preset) for rev in [None, *args.revisions]}
    variants = with_revisions(args.designs, args.revisions)
    print(f"{machine()}; {args.steps} steps untimed, then {args.rounds} rounds of one step per design")
    with tempfile.TemporaryDirectory() as tmp:
        times = paired_times(packages, variants, args.rounds, args.steps, Path(tmp))
    summary = ratio_to_own_baseline(times, "prenorm")
    rows = []
    for d in variants:
        own = [t / b for t, b in zip(times[d], times[own_baseline(d, "prenorm")])]
        q1, _, q3 = statistics.quantiles(own, n=4)
        rows.append(dict(design=d, median_ms=summary[d]["median_s"] * 1e3, ratio=summary[d]["ratio"],
                         ratio_ci95=span(*median_interval(own)), ratio_q1=q1, ratio_q3=q3, ratio_min=summary[d]["ratio_min"],
                         ratio_max=summary[d]["ratio_max"], rounds=args.rounds, warmup_steps=args.steps,
                         settings=settings(args)))
    print_table(rows, ["design", "median_ms", "ratio", "ratio_ci95", "ratio_q1", "ratio_q3", "ratio_min", "ratio_max"])
    print(f"wrote {write_csv(f'{args.csv}_paired', rows)}")
    if args.revisions:
        compared = against_revisions({"step_seconds": times})
        for row in compared:
            now, then = times[row["variant"]], times[f"{row['variant']}@{row['revision']}"]
            row["ci95"] = span(*median_interval([a / b for a, b in zip(now, then)]))
        print_table(compared, list(compared[0]))
        print(f"wrote {write_csv(f'{args.csv}_paired_against', compared)}")


def settings(args) -> str:
    """What a row was timed at beyond the demo: the preset where it is another, and the overrides."""
    return " ".join(([f"preset={args.preset}"] if args.preset != "demo" else []) + args.assignments)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--designs", nargs="+", default=["prenorm", "block", "mhar", "full", "delta", "hc", "mhc", "gr"],
                    choices=sorted(DESIGNS))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--preset", choices=["demo", "study", "regime"], default="demo",
                    help="the size to time: the demo's and study's (dim 96) or the regime's (dim 48)")
    ap.add_argument("--set", dest="assignments", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="a config override applied to every design (as attnres train --set)")
    ap.add_argument("--compiled", action="store_true", help="also train each design with run.compile=true")
    ap.add_argument("--revisions", nargs="*", default=[], metavar="REV",
                    help="also train every design on the package at these git revisions")
    ap.add_argument("--paired", action="store_true",
                    help="time single steps, every design in turn in each round (--steps: untimed steps first)")
    ap.add_argument("--csv", default="demo_step")
    args = ap.parse_args()
    if "prenorm" not in args.designs:
        args.designs.insert(0, "prenorm")
    if args.paired:
        if args.rounds < 6:
            ap.error(f"--paired needs --rounds 6 or more (a 95% interval for a median needs 6 draws), got {args.rounds}")
        if args.compiled:
            ap.error("--paired times eager steps; --compiled is a run-by-run comparison")
        return paired(args)
    packages = {rev: Package(rev, args.steps, args.assignments, args.preset) for rev in [None, *args.revisions]}
    print(f"{machine()}; {args.rounds} rounds of {args.steps} steps")

    variants = [(d, False) for d in with_revisions(args.designs, args.revisions)]
    variants += [(d, True) for d in args.designs if args.compiled]
    labels = [d + ("+compile" if compiled else "") for d, compiled in variants]
    times: dict[str, list[float]] = {label: [] for label in labels}
    later: dict[str, list[float]] = {label: [] for label in labels}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for label, (variant, compiled) in zip(labels, variants):
                design, rev = split_variant(variant)
                package = packages[rev]
                cfg = dataclasses.replace(package.base, model=package.design_config(package.base.model, design))
                if compiled:
                    torch._dynamo.reset()  # a fresh process's compile, not a cached graph of an earlier run
                    cfg = dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, compile=True))
                summary = package.train(cfg, Path(tmp) / f"{label}-{r}", corpus=package.corpus).summary
                times[label].append(summary["step_time_s"])
                later[label].append(steady_step_time(Path(tmp) / f"{label}-{r}" / "metrics.jsonl"))
                print(f"round {r} {label}: {summary['step_time_s'] * 1e3:.1f} ms per step, "
                      f"{later[label][-1] * 1e3:.1f} ms after the first log", flush=True)

    summary, steady = ratio_to_own_baseline(times, "prenorm"), ratio_to_own_baseline(later, "prenorm")
    rows = [dict(design=d, median_ms=summary[d]["median_s"] * 1e3, ratio=summary[d]["ratio"],
                 ratio_min=summary[d]["ratio_min"], ratio_max=summary[d]["ratio_max"],
                 later_ms=steady[d]["median_s"] * 1e3, later_ratio=steady[d]["ratio"],
                 rounds=args.rounds, steps=args.steps, settings=settings(args))
            for d in labels]
    print_table(rows, ["design", "median_ms", "ratio", "ratio_min", "ratio_max", "later_ms", "later_ratio"])
    print(f"wrote {write_csv(args.csv, rows)}")
    if args.revisions:
        compared = against_revisions({"step_time_s": times})
        print_table(compared, list(compared[0]))
        print(f"wrote {write_csv(f'{args.csv}_against', compared)}")


if __name__ == "__main__":
    main()
