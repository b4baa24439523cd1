"""Where the time of a demo-size training step goes, per design: the operator calls, their
self time by operator, and what is left for Python between them.

The model and batch of ``attnres compare``'s demo preset (dim 96, 8 layers, 16 sublayers, batch
16 x 128, fp32), each design as ``names.DESIGNS`` builds it; a step is forward, backward and
AdamW, as in ``train/steps.py`` without the trainer's logging. After ``--warmup`` steps,
``--steps`` steps run under ``torch.profiler`` (CPU activities): per step, the wall time, the
number of operator calls (top-level ATen calls, those the Python code makes; the calls inside
them are not counted again), the time spent inside them, and the rest (Python, autograd's
engine between nodes, the allocator, and the C++ kernels, which are ctypes calls outside ATen);
then ``--steps`` more under cProfile for ``kernels_ms``, the time in the C++ kernels
(``kernel_time``), and ``--steps`` more timing each kernel call by its name (``kernel_split``,
written to ``<csv>_kernels.csv``). ``--top`` lists the operators with the most self time beyond
PreNorm's.

    python benchmarks/demo_profile.py
    python benchmarks/demo_profile.py --designs prenorm mhc --top 15
"""

from __future__ import annotations

import argparse
import collections
import cProfile
import os
import pstats
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, write_csv  # noqa: E402

from attnres.model import Transformer  # noqa: E402
from attnres.names import DESIGNS  # noqa: E402
from attnres.train.designs import design_config  # noqa: E402
from attnres.train.config import demo  # noqa: E402


def step_fn(model: Transformer, opt: torch.optim.Optimizer, tokens: torch.Tensor):
    def step():
        logits = model(tokens[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def profile_design(design: str, warmup: int, steps: int):
    cfg = demo()
    torch.manual_seed(0)
    model = Transformer(design_config(cfg.model, design))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=False, foreach=True)
    tokens = torch.randint(0, cfg.model.vocab_size, (cfg.run.batch_size, cfg.run.seq_len + 1))
    step = step_fn(model, opt, tokens)
    for _ in range(warmup):
        step()
    t0 = time.perf_counter()
    for _ in range(steps):
        step()
    plain = (time.perf_counter() - t0) / steps
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            step()
    events = [e for e in prof.events() if e.name.startswith("aten::") and not _has_aten_parent(e)]
    self_by_op = collections.Counter()
    for e in prof.events():
        if e.name.startswith("aten::"):
            self_by_op[e.name] += e.self_cpu_time_total / 1e3 / steps  # ms per step
    inside = sum(e.cpu_time_total for e in events) / 1e3 / steps
    return dict(design=design, step_ms=plain * 1e3, op_calls=len(events) / steps, in_ops_ms=inside,
                outside_ops_ms=None, kernels_ms=kernel_time(step, steps)), self_by_op, kernel_split(step, steps)


def kernel_time(step, steps: int) -> float:
    """Milliseconds per step in the C++ kernels, from cProfile: the own time of the Python
    functions that make the ctypes calls (``cpu._call``, and the functions of ``cpu_streams``),
    which is the foreign call's time and a few microseconds of their own per call."""
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(steps):
        step()
    profiler.disable()
    stats = pstats.Stats(profiler).stats  # (file, line, name) -> (calls, prim, tottime, cumtime, callers)
    own = sum(tottime for (path, _, name), (_, _, tottime, _, _) in stats.items()
              if path.endswith(os.path.join("backends", "cpu.py")) and name == "_call"
              or path.endswith(os.path.join("backends", "cpu_streams.py")))
    return own * 1e3 / steps


def kernel_split(step, steps: int) -> dict[str, tuple[float, float]]:
    """``{kernel: (ms per step, calls per step)}`` of the C++ kernels over ``steps`` more steps,
    each foreign call timed under its name (``cpu._call``'s depth-attention kernels and the
    functions ``cpu_streams._kernel`` hands out)."""
    from attnres.ops.backends import cpu, cpu_streams

    spent, calls = collections.Counter(), collections.Counter()

    def record(name: str, start: float) -> None:
        spent[name] += time.perf_counter() - start
        calls[name] += 1

    depth_call, stream_kernel = cpu._call, cpu_streams._kernel

    def timed_call(name, dtype, args):
        start = time.perf_counter()
        depth_call(name, dtype, args)
        record(name, start)

    def timed_kernel(name, dtype):
        fn = stream_kernel(name, dtype)

        def call(*args):
            start = time.perf_counter()
            fn(*args)
            record(name, start)
        return call

    cpu._call, cpu_streams._kernel = timed_call, timed_kernel
    try:
        for _ in range(steps):
            step()
    finally:
        cpu._call, cpu_streams._kernel = depth_call, stream_kernel
    return {name: (1e3 * spent[name] / steps, calls[name] / steps) for name in spent}


def _has_aten_parent(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--designs", nargs="+", default=["prenorm", "block", "mhar", "full", "delta", "hc", "mhc", "gr"],
                    choices=sorted(DESIGNS))
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--top", type=int, default=8)
    ap.add_argument("--csv", default="demo_profile")
    args = ap.parse_args()
    if "prenorm" not in args.designs:
        args.designs.insert(0, "prenorm")
    torch.set_num_threads(torch.get_num_threads())
    print(machine())
    rows, by_op, by_kernel = [], {}, []
    sites = demo().model.n_layers * 2
    for design in args.designs:
        row, ops, kernels = profile_design(design, args.warmup, args.steps)
        by_kernel += [dict(design=design, kernel=name, ms_per_step=ms, calls_per_step=n)
                      for name, (ms, n) in sorted(kernels.items(), key=lambda kv: -kv[1][0])]
        row["outside_ops_ms"] = row["step_ms"] - row["in_ops_ms"]
        rows.append(row)
        by_op[design] = ops
    base = rows[0]
    for row in rows:
        row["extra_calls_per_site"] = (row["op_calls"] - base["op_calls"]) / sites
        row["extra_ms_per_site"] = (row["step_ms"] - base["step_ms"]) / sites
    print_table(rows, ["design", "step_ms", "op_calls", "in_ops_ms", "outside_ops_ms", "kernels_ms",
                       "extra_calls_per_site", "extra_ms_per_site"])
    for design in args.designs[1:]:
        extra = {op: ms - by_op["prenorm"].get(op, 0.0) for op, ms in by_op[design].items()}
        top = sorted(extra.items(), key=lambda kv: -kv[1])[: args.top]
        print(f"{design}: self ms per step beyond prenorm: " + ", ".join(f"{op[6:]} {ms:.1f}" for op, ms in top))
    if by_kernel:
        print_table(by_kernel, ["design", "kernel", "ms_per_step", "calls_per_step"])
    print(f"wrote {write_csv(args.csv, rows)}")
    print(f"wrote {write_csv(args.csv + '_kernels', by_kernel)}")


if __name__ == "__main__":
    main()
