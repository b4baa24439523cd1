"""Decode per token through the model's own ``generate``, the way a user calls it: for each design
at the demo preset's size (dim 96, 8 layers), a 32-token prompt, ``(t(1 + N) - t(1)) / N`` with
``t(k)`` one ``generate(prompt, max_new_tokens=k)`` call (greedy), so that the prompt's prefill and
the first token cancel; batch 1 and 8; ``--rounds`` rounds, the designs in turn (reversed on odd
rounds); a figure is the median of the per-round ratios to PreNorm with their min..max.
``benchmarks/inference.py`` times the same decode step by step on a larger model (dim 512), with
each step's forward alone: the two agree where the Python around a step is small beside it.

    python benchmarks/generate_decode.py
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, write_csv  # noqa: E402

from attnres.model import Transformer  # noqa: E402
from attnres.train.config import demo  # noqa: E402
from attnres.experiments.designs import design_config  # noqa: E402


@torch.no_grad()
def per_token(model: Transformer, prompt: torch.Tensor, tokens: int) -> float:
    """Seconds per generated token past the first, ``(t(1 + tokens) - t(1)) / tokens``."""
    start = time.perf_counter()
    model.generate(prompt, max_new_tokens=1)
    one = time.perf_counter() - start
    start = time.perf_counter()
    model.generate(prompt, max_new_tokens=1 + tokens)
    return (time.perf_counter() - start - one) / tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--designs", nargs="+", default=["prenorm", "block", "mhar", "full", "delta"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--csv", default="generate_decode")
    args = ap.parse_args()
    print(machine())
    cfg = demo()
    models = {}
    for design in args.designs:
        torch.manual_seed(0)
        models[design] = Transformer(design_config(cfg.model, design)).eval()
    times = {(b, d): [] for b in args.batch for d in args.designs}
    for r in range(args.rounds):
        for b in args.batch:
            prompt = torch.randint(0, cfg.model.vocab_size, (b, 32), generator=torch.Generator().manual_seed(r))
            for design in args.designs if r % 2 == 0 else reversed(args.designs):
                times[(b, design)].append(per_token(models[design], prompt, args.tokens))
    rows = []
    for b in args.batch:
        base = times[(b, args.designs[0])]
        for design in args.designs:
            ratios = [t / p for t, p in zip(times[(b, design)], base)]
            rows.append(dict(batch=b, design=design, ms_per_token=round(1e3 * statistics.median(times[(b, design)]), 3),
                             ratio=round(statistics.median(ratios), 3), ratio_min=round(min(ratios), 3),
                             ratio_max=round(max(ratios), 3)))
    print_table(rows, ["batch", "design", "ms_per_token", "ratio", "ratio_min", "ratio_max"])
    print(f"wrote {write_csv(args.csv, rows)}")


if __name__ == "__main__":
    main()
