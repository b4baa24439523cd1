"""The CPU kernels against the PyTorch fast path, op by op, at the reference LM's shapes.

Ops (8 x 256 tokens, D = 512, fp32; H = 1 and H = 8):
  phase1  phase 1 of a Block read: 2 queries against 9 completed sources, the first output through
          its pre-norm, the second output and lse used (as by a merge); forward + backward
  merge   phase 2 with the pre-norm fused (``merge(..., norm=...)``); forward + backward
  merge-nograd, phase1-nograd  the same without autograd (the inference path)
Ratios are ``cpu`` over ``torch`` per round, interleaved in one process.

    python benchmarks/kernels.py --rounds 15
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, machine, print_table, ratio_summary, span, write_csv  # noqa: E402

from attnres.ops import backend  # noqa: E402

LEAD, D, SOURCES, QUERIES = (8, 256), 512, 9, 2


class Norm(NamedTuple):
    """A read's pre-norm as the backends take it."""

    weight: torch.Tensor
    eps: float


def ops(heads: int) -> dict:
    """``{(op, backend): fn}`` on one set of inputs."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).requires_grad_()

    sources = [rand(*LEAD, D) for _ in range(SOURCES)]
    stats = [backend("torch").prepare(v) for v in sources]
    queries, gains, weight = rand(QUERIES, D, scale=0.1), rand(QUERIES, D), rand(D)
    o1, lse1, partial = rand(*LEAD, D), rand(*LEAD, heads), rand(*LEAD, D)
    query, gain = rand(D, scale=0.1), rand(D)
    cot = [torch.randn(*LEAD, D, generator=g) for _ in range(2)] + [torch.randn(QUERIES, *LEAD, heads, generator=g)]
    table = {}
    norm = Norm(weight, 1e-6)
    for name in ("torch", "cpu"):
        fns = backend(name)

        def phase1(fns=fns):
            outs, lse = fns.attend(queries, sources, gains, heads=heads, prepared=stats, norm=norm)
            if torch.is_grad_enabled():
                torch.autograd.backward([*outs, lse], cot)

        def merge(fns=fns):
            y = fns.merge(o1, lse1, partial, query, gain, heads=heads, norm=norm)
            if torch.is_grad_enabled():
                y.backward(cot[0])

        def nograd(fn):
            def run():
                with torch.no_grad():
                    fn()
            return run

        table.update({("phase1", name): phase1, ("merge", name): merge,
                      ("phase1-nograd", name): nograd(phase1), ("merge-nograd", name): nograd(merge)})
    return table


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    print(f"# kernels: {SOURCES} sources, {QUERIES} queries, tokens {LEAD}, D={D}; {machine()}")
    rows = []
    for heads in (1, 8):
        table = ops(heads)
        names = sorted({op for op, _ in table})
        for op in names:
            pair = {b: table[(op, b)] for b in ("torch", "cpu")}
            s = ratio_summary(interleaved(pair, args.rounds, warmup=2), "torch")
            rows.append(dict(op=op, heads=heads, torch_ms=1000 * s["torch"]["median_s"],
                             cpu_ms=1000 * s["cpu"]["median_s"], cpu_vs_torch=s["cpu"]["ratio"],
                             spread=span(s["cpu"]["ratio_min"], s["cpu"]["ratio_max"], 2)))
    print_table(rows, ["op", "heads", "torch_ms", "cpu_ms", "cpu_vs_torch", "spread"])
    write_csv("kernels", rows)


if __name__ == "__main__":
    main()
