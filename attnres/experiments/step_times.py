"""Each design's training step timed against the baseline's, for a comparison's multipliers in
wall-clock terms (``analysis/budget.py``).

The training runs' own step times move with whatever else the machine does while they run, hours
apart; so before training, ``time_steps`` starts every design once through the trainer (on the
comparison's data, seed 0, in a scratch folder it then removes) and times one optimizer step of
each design per round, interleaved, the order reversed every other round, after one untimed step
each. A design's ratio is the median over the rounds of its step's time over the baseline's in
the same round, with the rounds' spread. The steps are part of no run. The figures hold only on
a quiet machine: another process sharing the cores moves them by tens of percent.
"""

from __future__ import annotations

import shutil
import statistics
from pathlib import Path

from ..analysis.comparison import label_path
from ..train.config import TrainConfig
from ..train.parallel_plan import run_plan
from ..train import trainer

#: timed rounds (one step of every design each): few, as the timing only scales the multipliers
STEP_TIME_ROUNDS = 5


def time_steps(configs: dict[str, TrainConfig], baseline: str, corpus, scratch: Path,
               rounds: int = STEP_TIME_ROUNDS) -> dict[str, dict]:
    """``label -> {"seconds": [...], "ratio": median, "ratio_range": [min, max], "rounds": n}``:
    each design's step time per round and its ratio to ``baseline``'s (which is 1), for the runs
    ``configs`` (label -> the run's config) on ``corpus``, started in ``scratch`` (removed after)."""
    runs = {}
    try:
        for label, cfg in configs.items():
            folder = scratch / label_path(label)
            cfg, data = trainer.load_data(cfg, folder, corpus)
            runs[label] = trainer.start(cfg, folder, data, trainer.start_processes(cfg, run_plan(cfg, 1)))
        labels = list(runs)
        for label in labels:  # one untimed step each: first-call allocations and caches
            trainer.train_step(runs[label], 0, False)
        seconds: dict[str, list[float]] = {label: [] for label in labels}
        for r in range(rounds):
            for label in labels if r % 2 == 0 else reversed(labels):
                seconds[label].append(trainer.train_step(runs[label], 1 + r, False).seconds)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    out = {}
    for label, times in seconds.items():
        ratios = [t / b for t, b in zip(times, seconds[baseline])]
        out[label] = {"seconds": times, "ratio": statistics.median(ratios), "ratio_range": [min(ratios), max(ratios)],
                      "rounds": rounds}
    return out
