"""What each design's forward keeps for backward, against PreNorm: the bytes of the distinct
tensors autograd saves in one training forward (``torch.autograd.graph.saved_tensors_hooks``,
each storage counted once, parameters excluded), on the train-step model and batch.

The training step's measured peak growth (``train_step.py``) less this is what backward adds
on top of the saved activations at its peak, at the start of backward: on the CPU kernels, the
output routing's upstream gradient (each source's gradient is formed at its own backward,
``ops/source_ledger.py``); with gradients accumulated per read, one running sum per completed
source.

    python benchmarks/saved_for_backward.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import print_table, write_csv  # noqa: E402
from train_step import SIZES, VARIANTS  # noqa: E402

from attnres import ModelConfig, Transformer  # noqa: E402
from attnres.model import lm_loss  # noqa: E402

BATCH, SEQ = 8, 256


def saved_mib(design: str) -> float:
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**SIZES, **VARIANTS[design]))
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    x = torch.randint(0, SIZES["vocab_size"], (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        lm_loss(model(x), x.roll(-1, 1))
    return sum(saved.values()) / 2**20


def main() -> None:
    base = saved_mib("prenorm")
    rows = []
    for design in ("prenorm", "block", "mhar", "full", "delta"):
        mib = saved_mib(design)
        rows.append(dict(design=design, saved_mib=mib, over_prenorm_mib=mib - base))
    print_table(rows, list(rows[0]))
    write_csv("saved_for_backward", rows)


if __name__ == "__main__":
    main()
