"""The AttnRes paper's ablation table beside ours, from a comparison folder
(``attnres compare --preset ablations``): the table of docs/RESULTS.md.

    python studies/ablation_table.py runs/compare-<timestamp>       # a comparison's folder
    python studies/ablation_table.py docs/study/ablations/results.json  # or its results.json

Per row: the paper's loss and its difference to the paper's baseline (1.766, at 436M); ours,
the mean final validation loss over the seeds every design finished and the difference to
PreNorm paired over them with its 95% Student-t interval and verdict
(``variant_table.interval``); and, for a variant of Full or Block, the same
difference to its own design (``full`` or ``block``), which is what the paper's row changes.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from variant_table import final_losses, interval

#: the paper's Table 4 (docs/METHOD.md section 9): design here -> (the paper's row, its loss)
PAPER = {
    "prenorm": ("baseline (PreNorm)", 1.766),
    "full": ("Full AttnRes", 1.737),
    "full:query=input": ("input-dependent query", 1.731),
    "full:score=sigmoid": ("sigmoid instead of softmax", 1.741),
    "full:key_norm=false": ("no RMSNorm on the keys", 1.743),
    "full:mixing=learned": ("static mixing", 1.749),
    "full:window=8": ("sliding window W = 1 + 8", 1.764),
    "block": ("Block AttnRes, N = 8 blocks (the paper's S = 4; here 8 blocks of S = 2 sublayers)", 1.746),
    "block:block_size=4": ("Block, S = 4", 1.746),
    "block:block_size=8": ("Block, S = 8", 1.748),
    "block:block_size=16": ("Block, S = 16", 1.753),
    "block:heads=16": ("Block, 16-head depth routing", 1.752),
    "block:key_norm=false": ("Block without RMSNorm on the keys", 1.750),
    "denseformer": ("DenseFormer", 1.767),
}
PAPER_BASELINE = 1.766


def table(source: Path) -> str:
    losses = final_losses(source)  # the seeds every design finished
    lines = ["| paper's row | paper | paper - baseline | design here | ours (mean) | ours - PreNorm, 95% | "
             "ours - its design, 95% |", "|---|---|---|---|---|---|---|"]
    for label, (row, loss) in PAPER.items():
        if label not in losses:
            continue
        own = label.partition(":")[0]
        mine = losses[label]
        lines.append(" | ".join([
            f"| {row}", f"{loss:.3f}", f"{loss - PAPER_BASELINE:+.3f}", f"`{label}`",
            f"{statistics.fmean(mine.values()):.4f}",
            interval(losses["prenorm"] if label != "prenorm" else None, mine),
            interval(losses[own] if own in losses and label != own else None, mine),
        ]) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    for folder in sys.argv[1:]:
        print(table(Path(folder)))
