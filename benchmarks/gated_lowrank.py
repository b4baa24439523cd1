"""GR's read from its low-rank layer on the ``cpu`` backend: the kernel that forms the gates'
logits itself (``cpu_streams.gated_mix_lowrank``) against the BLAS product then ``gated_mix``
(what the backend runs past ``cpu_streams.LOWRANK_KERNEL_BYTES``), by the size of the
up-projection.

Each size is GR's at a model width ``dim``: 4 branches (``n D = 4 dim``), rank ``dim // 8``,
2048 tokens (16 x 128), fp32; forward and backward, every input requiring grad. The kernel
reads ``U^T`` (``r x n D`` numbers) once per block of 4 tokens, so its time grows with ``U``'s
size past what the core's caches hold, where the BLAS product reads it once per larger block of
rows. Both calls
alternate in every round; a figure is the median of the per-round ratios kernel / product.

    python benchmarks/gated_lowrank.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, machine, print_table, ratio_summary, span, write_csv  # noqa: E402

from attnres.ops.backends import cpu_streams  # noqa: E402

LEAD, N = (16, 128), 4


def calls(dim: int) -> dict:
    g = torch.Generator().manual_seed(0)
    rank = dim // 8
    R = torch.randn(*LEAD, N, dim, generator=g).requires_grad_()
    h = torch.randn(*LEAD, rank, generator=g).requires_grad_()
    up = (0.05 * torch.randn(N * dim, rank, generator=g)).requires_grad_()

    def product():
        return cpu_streams.gated_mix(R, (h @ up.T).unflatten(-1, (N, dim)))

    def kernel():
        return cpu_streams.gated_mix_lowrank(R, h, up)

    def with_backward(forward):
        def run():
            y = forward()
            y.backward(torch.ones_like(y))
        return run

    return {"product": with_backward(product), "kernel": with_backward(kernel)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dims", type=int, nargs="+", default=[96, 128, 192, 256, 512])
    p.add_argument("--rounds", type=int, default=21)
    p.add_argument("--csv", default="gated_lowrank")
    args = p.parse_args()
    print(f"# GR's low-rank read, tokens {LEAD}, n={N}, fp32, forward + backward; {machine()}")
    rows = []
    for dim in args.dims:
        s = ratio_summary(interleaved(calls(dim), args.rounds, warmup=2), "product")
        rows.append(dict(dim=dim, up_kib=4 * N * dim * (dim // 8) / 1024, product_ms=1000 * s["product"]["median_s"],
                         kernel_ms=1000 * s["kernel"]["median_s"], kernel_vs_product=s["kernel"]["ratio"],
                         spread=span(s["kernel"]["ratio_min"], s["kernel"]["ratio_max"], 2)))
    print_table(rows, ["dim", "up_kib", "product_ms", "kernel_ms", "kernel_vs_product", "spread"])
    print(f"wrote {write_csv(args.csv, rows)}")


if __name__ == "__main__":
    main()
