"""Where a demo-size training step's routing time goes: the bytes each routing kernel reads and
writes per step, its time, and how far that is from what the machine's memory could stream.

The model and batch of ``attnres compare``'s demo preset (dim 96, 8 layers, 16 sublayers, batch
16 x 128, fp32), each design as ``names.DESIGNS`` builds it, a step as ``demo_profile.py`` runs it
(forward, backward, AdamW). After ``--warmup`` steps, ``--steps`` steps run under
``torch.profiler``; every CPU kernel operator (``attnres::cpu_*``) is timed by its self time, and
one more step counts the bytes of the tensors its calls take (read: each input tensor once, the
sources among them) and return (written). The
bandwidth a plain read reaches (``x.sum()`` of a float32 tensor, PyTorch's threads) is measured
in the same run at the size of one step's routing traffic and at 200 MiB (from memory); each
kernel's ``floor_ms`` is its bytes at the larger of the two rates that applies, the time no
kernel moving those bytes could beat, and ``x_floor`` how many times that its time is.

    python benchmarks/routing_traffic.py
    python benchmarks/routing_traffic.py --designs block full --steps 3
"""

from __future__ import annotations

import argparse
import collections
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, write_csv  # noqa: E402
from demo_profile import step_fn  # noqa: E402

from attnres.model import Transformer  # noqa: E402
from attnres.train.config import demo  # noqa: E402
from attnres.experiments.designs import design_config  # noqa: E402

#: the kernel operators' names as the profiler lists them
KERNEL_PREFIX = "attnres::cpu_"


def tensor_bytes(value) -> int:
    """The bytes of the tensors in ``value``: a tensor, or a list or tuple of them (and of None),
    each counted once; anything else counts 0."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def read_rate(mib: float, rounds: int) -> float:
    """GB/s of ``x.sum()`` over a float32 tensor of ``mib`` MiB: the median of ``rounds``."""
    x = torch.randn(int(mib * 2**20 / 4))
    x.sum()
    rates = []
    for _ in range(rounds):
        start = time.perf_counter()
        x.sum()
        rates.append(x.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


def traffic(design: str, warmup: int, steps: int) -> tuple[float, dict]:
    """``(step ms, per kernel {calls, read_mb, written_mb, ms})`` per step of ``design``."""
    cfg = demo()
    torch.manual_seed(0)
    model = Transformer(design_config(cfg.model, design))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=False, foreach=True)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.run.batch_size, cfg.run.seq_len + 1))
    step = step_fn(model, opt, tokens)
    for _ in range(warmup):
        step()
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        for _ in range(steps):
            step()
    step_ms = (time.perf_counter() - start) / steps * 1e3
    kernels = collections.defaultdict(lambda: {"calls": 0.0, "read_mb": 0.0, "written_mb": 0.0, "ms": 0.0})
    for event in prof.key_averages():
        if event.key.startswith(KERNEL_PREFIX):
            row = kernels[event.key[len("attnres::"):]]
            row["calls"] = event.count / steps
            row["ms"] = event.self_cpu_time_total / 1e3 / steps
    for name, (read, written) in _bytes_per_step(step).items():
        kernels[name]["read_mb"], kernels[name]["written_mb"] = read / 1e6, written / 1e6
    return step_ms, dict(kernels)


def _bytes_per_step(step) -> dict[str, tuple[int, int]]:
    """Per kernel operator, the bytes its calls take (each input tensor once) and return in one
    ``step``: the operators of ``torch.ops.attnres`` wrapped for the step's length."""
    moved = collections.defaultdict(lambda: [0, 0])
    ops = torch.ops.attnres
    names = [n for n in dir(ops) if n.startswith("cpu_")]
    originals = {n: getattr(ops, n) for n in names}

    def counting(name, op):
        def call(*args, **kwargs):
            out = op(*args, **kwargs)
            moved[name][0] += tensor_bytes(list(args) + list(kwargs.values()))
            moved[name][1] += tensor_bytes(out)
            return out
        return call

    for n in names:
        setattr(ops, n, counting(n, originals[n]))
    try:
        step()
    finally:
        for n in names:
            setattr(ops, n, originals[n])
    return {name: tuple(v) for name, v in moved.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--designs", nargs="+", default=["prenorm", "block", "mhar", "full", "delta", "hc", "mhc", "gr"])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=21, help="rounds of each bandwidth measurement")
    ap.add_argument("--csv", default="routing_traffic")
    args = ap.parse_args()
    print(machine())
    results = {design: traffic(design, args.warmup, args.steps) for design in args.designs}
    largest = max((sum(k["read_mb"] + k["written_mb"] for k in ks.values()) for _, ks in results.values()),
                  default=0.0)
    cached = read_rate(max(largest, 1.0) / 1.048576, args.rounds)
    memory = read_rate(200, args.rounds)
    print(f"read bandwidth: {cached:.1f} GB/s at {largest:.0f} MB (one step's routing traffic), "
          f"{memory:.1f} GB/s at 200 MiB")
    rows = []
    for design, (step_ms, kernels) in results.items():
        for name, k in sorted(kernels.items(), key=lambda kv: -kv[1]["ms"]):
            moved = k["read_mb"] + k["written_mb"]
            floor = moved / 1e3 / cached * 1e3  # ms at the cached rate: the faster of the two
            rows.append(dict(design=design, step_ms=round(step_ms, 1), kernel=name, calls=round(k["calls"], 1),
                             read_mb=round(k["read_mb"], 1), written_mb=round(k["written_mb"], 1),
                             ms=round(k["ms"], 2), gb_per_s=round(moved / max(k["ms"], 1e-9), 1),
                             floor_ms=round(floor, 2), x_floor=round(k["ms"] / max(floor, 1e-9), 1),
                             bandwidth_cached=round(cached, 1), bandwidth_memory=round(memory, 1)))
        if not kernels:
            rows.append(dict(design=design, step_ms=round(step_ms, 1), kernel="(none)", calls=0, read_mb=0,
                             written_mb=0, ms=0, gb_per_s=0, floor_ms=0, x_floor=0,
                             bandwidth_cached=round(cached, 1), bandwidth_memory=round(memory, 1)))
    print_table(rows, ["design", "step_ms", "kernel", "calls", "read_mb", "written_mb", "ms", "gb_per_s",
                       "floor_ms", "x_floor"])
    print(f"wrote {write_csv(args.csv, rows)}")


if __name__ == "__main__":
    main()
