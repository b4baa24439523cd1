"""Whether the depth-attention kernels run at the memory's speed: the rate a plain read streams
at on this machine, against the rate the ``cpu`` backend's forward reads its sources at.

``stream`` rows: ``x.sum()`` of a float32 tensor of each size in MiB (PyTorch's threads), the
bytes read per second; sizes below the last-level cache show the cache's rate, the largest the memory's.
``attend`` rows: one read of ``--sources`` sources of ``[16, 128, 96]`` (fp32, the demo size's
tokens and width; a Full read near the end of the model), its pre-norm fused, autograd off, on
the ``cpu`` backend, the whole call (its checks and allocations included); ``warm`` repeats one set of sources (left in the cache by the previous
call), ``cold`` cycles through ``--sets`` sets (more than the last-level cache holds), and the
rate counts each source's bytes once per call. A round times each row once, in turn; a figure is
the median over ``--rounds`` rounds, with the min..max.

    python benchmarks/depth_bandwidth.py
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

from attnres.ops import RMSNorm, backend  # noqa: E402

LEAD, D = (16, 128), 96
STREAM_MIB = (0.75, 4, 13, 26, 200)


def rate(fn, nbytes: int, calls: int) -> float:
    """GB/s of ``calls`` calls of ``fn`` reading ``nbytes`` each."""
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return nbytes * calls / (time.perf_counter() - start) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sources", type=int, default=17)
    p.add_argument("--sets", type=int, default=8)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--csv", default="depth_bandwidth")
    args = p.parse_args()
    print(f"# plain reads against the depth-attention forward; {machine()}")
    torch.manual_seed(0)
    cpu = backend("cpu")
    query, norm = 0.02 * torch.randn(1, D), RMSNorm(D)
    sets = [[torch.randn(*LEAD, D) for _ in range(args.sources)] for _ in range(args.sets)]
    prepared = [[cpu.prepare(v) for v in sources] for sources in sets]
    source_bytes = args.sources * sets[0][0].numel() * 4
    cycle = iter(range(1 << 62))

    def attend(k: int):
        return lambda: cpu.attend(query, sets[k], None, norm=norm, prepared=prepared[k])

    def attend_cold():
        k = next(cycle) % args.sets
        cpu.attend(query, sets[k], None, norm=norm, prepared=prepared[k])

    tensors = {mib: torch.randn(int(mib * 2**20 / 4)) for mib in STREAM_MIB}
    rows = {f"stream {mib} MiB": (lambda x=x: x.sum(), x.numel() * 4) for mib, x in tensors.items()}
    rows[f"attend warm ({args.sources} x {D})"] = (attend(0), source_bytes)
    rows[f"attend cold ({args.sources} x {D})"] = (attend_cold, source_bytes)
    rates = {name: [] for name in rows}
    with torch.no_grad():
        for name, (fn, _) in rows.items():  # warm-up
            fn()
        for _ in range(args.rounds):
            for name, (fn, nbytes) in rows.items():
                rates[name].append(rate(fn, nbytes, max(4, int(2e8 // nbytes))))
    out = [dict(read=name, median_gb_s=statistics.median(r), min_gb_s=min(r), max_gb_s=max(r),
                bytes_per_call=rows[name][1]) for name, r in rates.items()]
    print_table(out, ["read", "median_gb_s", "min_gb_s", "max_gb_s", "bytes_per_call"])
    print(f"wrote {write_csv(args.csv, out)}")


if __name__ == "__main__":
    main()
