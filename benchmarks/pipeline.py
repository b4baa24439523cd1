"""What crosses each pipeline hop, per design: the tensors a stage sends (``split_state`` of the
state at the cut, what ``StageModule`` returns) and their bytes per micro-batch, against the
analytical count.

The train-step benchmark's model (dim 512, 16 sublayers; Block and Delta in 8 blocks of 2, HC,
mHC and GR with 4 streams), a micro-batch of 2 x 256 tokens in fp32: one ``[tokens, D]`` tensor
is 1 MiB. Layouts: 4 stages (cuts before sublayers 4, 8, 12) and 8 virtual stages (every 2).
The sizes come from running the stream on one token and scaling by the micro-batch's tokens.

    python benchmarks/pipeline.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_csv  # noqa: E402
from train_step import SIZES, VARIANTS  # noqa: E402

from attnres import ModelConfig, Transformer  # noqa: E402

DESIGNS = ("prenorm", "block", "mhar", "full", "delta", "hc", "mhc", "gr")
TOKENS = 2 * 256
LAYOUTS = {"4 stages": (4, 8, 12), "8 virtual stages": (2, 4, 6, 8, 10, 12, 14)}


@torch.no_grad()
def hop(model: Transformer, cut: int) -> tuple[int, int]:
    """``(tensors, bytes per micro-batch)`` sent across the cut before sublayer ``cut``."""
    stream, D = model.stream, model.config.dim
    e = torch.zeros(1, 1, D)
    state = stream.init(e)
    for i in range(cut):
        state = stream.write(state, i, torch.zeros_like(e))
    completed, rest = stream.split_state(state)
    sent = [*completed, *rest]
    return len(sent), sum(t.numel() * t.element_size() for t in sent) * TOKENS


def analytical(design: str, model: Transformer, cut: int) -> int:
    """``[tokens, D]`` tensors the method needs across the cut: one running sum for PreNorm,
    ``n`` streams for HC/mHC/GR, every source for Full, ``e`` and the completed blocks (plus the
    partial mid-block) for Block, the same plus ``h`` for Delta."""
    kind = model.config.residual
    if kind == "prenorm":
        return 1
    if kind in ("hc", "mhc", "gr"):
        return model.config.streams
    if kind == "full":
        return cut + 1
    ends = {sum(model.stream.block_sizes[: k + 1]) for k in range(len(model.stream.block_sizes))}
    completed = sum(1 for end in ends if end <= cut)
    partial = int(cut not in ends and cut > 0)
    return 1 + completed + partial + (kind == "delta")


def main():
    rows = []
    for design in DESIGNS:
        model = Transformer(ModelConfig(**SIZES, **VARIANTS[design]))
        for layout, cuts in LAYOUTS.items():
            counts = [hop(model, c) for c in cuts]
            expected = [analytical(design, model, c) for c in cuts]
            unit = TOKENS * SIZES["dim"] * 4
            rows.append(dict(design=design, layout=layout,
                             tensors_per_hop=" ".join(str(n) for n, _ in counts),
                             mib_per_hop=" ".join(f"{b / 2**20:g}" for _, b in counts),
                             mib_total=sum(b for _, b in counts) / 2**20,
                             analytical_mib=" ".join(f"{n * unit / 2**20:g}" for n in expected),
                             matches=all(b == n * unit for (_, b), n in zip(counts, expected))))
    print_table(rows, list(rows[0]))
    write_csv("pipeline_hops", rows)


if __name__ == "__main__":
    main()
