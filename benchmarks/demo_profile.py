"""Where the time of a demo-size training step goes, per design: the operator calls, their
self time by operator, and what is left for Python between them.

The model and batch of ``attnres compare``'s demo preset (dim 96, 8 layers, 16 sublayers, batch
16 x 128, fp32), each design as ``names.DESIGNS`` builds it; a step is forward, backward and
AdamW, as in ``train/steps.py`` without the trainer's logging. After ``--warmup`` steps,
``--steps`` steps run under ``torch.profiler`` (CPU activities): per step, the wall time, the
number of operator calls (top-level ATen and ``attnres::`` calls, those the Python code makes;
the calls inside them are not counted again), the time spent inside them, and the rest (Python,
autograd's engine between nodes, the allocator); ``kernels_ms``, the self time of the C++
kernels' operators (``attnres::cpu_*``), and per kernel its time and calls (``kernel_split``,
written to ``<csv>_kernels.csv``), from the same profile. ``--top`` lists the operators with the
most self time beyond PreNorm's.

    python benchmarks/demo_profile.py
    python benchmarks/demo_profile.py --designs prenorm mhc --top 15
"""

from __future__ import annotations

import argparse
import collections
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, print_table, write_csv  # noqa: E402

from attnres.model import Transformer  # noqa: E402
from attnres.names import DESIGNS  # noqa: E402
from attnres.experiments.designs import design_config  # noqa: E402
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
    events = [e for e in prof.events() if e.name.startswith(OPERATORS) and not _has_operator_parent(e)]
    self_by_op = collections.Counter()
    for e in prof.events():
        if e.name.startswith(OPERATORS):
            self_by_op[e.name] += e.self_cpu_time_total / 1e3 / steps  # ms per step
    inside = sum(e.cpu_time_total for e in events) / 1e3 / steps
    kernels = kernel_split(prof.events(), steps)
    return dict(design=design, step_ms=plain * 1e3, op_calls=len(events) / steps, in_ops_ms=inside,
                outside_ops_ms=None, kernels_ms=sum(ms for ms, _ in kernels.values())), self_by_op, kernels


def kernel_split(events, steps: int) -> dict[str, tuple[float, float]]:
    """``{kernel: (ms per step, calls per step)}`` of the C++ kernels' operators
    (``attnres::cpu_*``) among a profile's ``events`` over ``steps`` steps: their self time."""
    spent, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.name.startswith("attnres::cpu_"):
            spent[e.name] += e.self_cpu_time_total
            calls[e.name] += 1
    return {name: (spent[name] / 1e3 / steps, calls[name] / steps) for name in spent}


#: the operators whose calls are counted: PyTorch's and the package's kernels
OPERATORS = ("aten::", "attnres::")


def _has_operator_parent(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith(OPERATORS):
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
        print(f"{design}: self ms per step beyond prenorm: " + ", ".join(f"{op.split('::')[1]} {ms:.1f}" for op, ms in top))
    if by_kernel:
        print_table(by_kernel, ["design", "kernel", "ms_per_step", "calls_per_step"])
    print(f"wrote {write_csv(args.csv, rows)}")
    print(f"wrote {write_csv(args.csv + '_kernels', by_kernel)}")


if __name__ == "__main__":
    main()
