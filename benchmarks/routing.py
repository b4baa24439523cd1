"""Routing microbenchmark: M sublayers of cheap work, so that depth routing dominates.

Full and Block AttnRes (8 blocks), forward + backward, four implementations:
  cpu       the fused CPU kernels (backend="cpu", what "auto" picks on CPU; two-phase for Block)
  fast      the PyTorch fast path (backend="torch": memory-efficient autograd; two-phase for Block)
  naive     the reference: sources stacked and normalized at every read (METHOD.md section 2)
  compiled  torch.compile(naive)
Time ratios are against ``naive`` of the same design, in the same run. Memory growth per
variant in a fresh process; a sweep over M shows how Block's memory grows.

    python benchmarks/routing.py                       # M=32, 2048 tokens, D=1024
    python benchmarks/routing.py --sweep 16 32 64      # memory of Block (fast) over M
    python benchmarks/routing.py --designs block --impls cpu fast naive
    python benchmarks/routing.py --impls cpu --revisions 7483a66 --baseline cpu@7483a66   # cpu against cpu@REV

With ``--revisions``, each implementation also runs on the package at each git revision
(``cpu@REV``), interleaved in the same rounds; ``--baseline`` picks what the ratios are against.
"""

from __future__ import annotations

import argparse
import sys

import torch
from torch import nn

sys.path.insert(0, str(__import__("pathlib").Path(__file__).resolve().parent))
from common import (  # noqa: E402
    child_memory,
    import_revision,
    interleaved,
    machine,
    print_table,
    ratio_summary,
    report_child,
    rss_mib,
    span,
    split_variant,
    with_revisions,
    write_csv,
)

import attnres  # noqa: E402

IMPLS = {
    "triton": dict(backend="triton"),  # CUDA only (benchmarks/gpu_check.py)
    "cpu": dict(backend="cpu"),
    "fast": dict(backend="torch"),
    "naive": dict(backend="naive", two_phase=False),
    "compiled": dict(backend="naive", two_phase=False),
}


class CheapStack(nn.Module):
    """M sublayers that cost almost nothing: v_i = tanh(x_i) * c_i (c_i a learned [D] vector)."""

    def __init__(self, kind, dim, m, impl):
        super().__init__()
        name, rev = split_variant(impl)
        package = attnres if rev is None else import_revision(rev)
        opts = dict(IMPLS[name])
        if kind == "full":
            opts.pop("two_phase", None)
        else:
            opts["num_blocks"] = 8
        self.stream = package.build_stream(kind, dim=dim, num_sublayers=m, **opts)
        self.scales = nn.Parameter(torch.ones(m, dim))
        with torch.no_grad():  # live routing: non-zero queries
            self.stream.pseudo_queries.normal_(0, 0.02)

    def forward(self, e):
        state = self.stream.init(e)
        for i in range(self.scales.shape[0]):
            state = self.stream.write(state, i, torch.tanh(self.stream.read(state, i)) * self.scales[i])
        return self.stream.output(state)


def build(kind, impl, dim, m, tokens):
    torch.manual_seed(0)
    model = CheapStack(kind, dim, m, impl)
    fn = torch.compile(model) if split_variant(impl)[0] == "compiled" else model
    e = torch.randn(tokens, dim, requires_grad=True)

    def step():
        model.zero_grad(set_to_none=True)
        e.grad = None
        fn(e).square().mean().backward()

    return step


def child(variant, args):
    kind, impl, m = variant.split(":")
    step = build(kind, impl, args.dim, int(m), args.tokens)
    if impl == "compiled":
        step()  # compile before the baseline: code generation is not activation memory
    base = rss_mib()
    for _ in range(2):
        step()
    report_child(base)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--m", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--sweep", type=int, nargs="*", default=None)
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--designs", nargs="*", default=["block", "full"], choices=["block", "full"])
    p.add_argument("--impls", nargs="*", default=None, choices=list(IMPLS),
                   help="default: cpu fast naive compiled (the baseline is always measured)")
    p.add_argument("--revisions", nargs="*", default=[], metavar="REV",
                   help="also run each implementation on the package at these git revisions (IMPL@REV)")
    p.add_argument("--baseline", default="naive", help="the implementation ratios are against (default: naive)")
    p.add_argument("--child")
    args = p.parse_args()
    if args.child:
        return child(args.child, args)
    impls = args.impls or ["cpu", "fast", "naive"] + ([] if args.no_compile else ["compiled"])
    impls = with_revisions(impls, args.revisions, skip=("compiled", "naive"))
    if args.baseline not in impls:
        impls.append(args.baseline)
    print(f"# routing: M={args.m}, tokens={args.tokens}, D={args.dim}; {machine()}")
    rows = []
    for kind in args.designs:
        steps = {impl: build(kind, impl, args.dim, args.m, args.tokens) for impl in impls}
        summary = ratio_summary(interleaved(steps, args.rounds, warmup=1), args.baseline)
        mem = {impl: child_memory(__file__, f"{kind}:{impl}:{args.m}", ["--dim", str(args.dim), "--tokens", str(args.tokens)]) for impl in impls}
        for impl in impls:
            s = summary[impl]
            rows.append(dict(
                design=kind, impl=impl, M=args.m, median_ms=1000 * s["median_s"],
                time_vs_baseline=s["ratio"], spread=span(s["ratio_min"], s["ratio_max"], 2),
                mem_growth_mib=mem[impl]["growth_mib"],
                mem_vs_baseline=mem[impl]["growth_mib"] / mem[args.baseline]["growth_mib"],
            ))
    cols = ["design", "impl", "M", "median_ms", "time_vs_baseline", "spread", "mem_growth_mib", "mem_vs_baseline"]
    print_table(rows, cols)
    selected = args.designs != ["block", "full"] or args.impls is not None or args.revisions
    write_csv(f"routing_{'-'.join(args.designs)}_{'-'.join(impls)}" if selected else "routing", rows)
    if args.sweep:
        sweep = []
        for m in args.sweep:
            for impl in [i for i in impls if split_variant(i)[0] != "compiled"]:
                mem = child_memory(__file__, f"block:{impl}:{m}", ["--dim", str(args.dim), "--tokens", str(args.tokens)])
                sweep.append(dict(design="block", impl=impl, M=m, blocks=8, mem_growth_mib=mem["growth_mib"]))
        for r in sweep:
            first = next(x for x in sweep if x["impl"] == r["impl"] and x["M"] == args.sweep[0])
            r["growth_vs_first"] = r["mem_growth_mib"] / first["mem_growth_mib"]
        print()
        print_table(sweep, ["design", "impl", "M", "blocks", "mem_growth_mib", "growth_vs_first"])
        write_csv(f"routing_sweep_{'-'.join(args.designs)}_{'-'.join(impls)}" if selected else "routing_sweep", sweep)


if __name__ == "__main__":
    main()
