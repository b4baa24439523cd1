"""The Python cost of routing, apart from the arithmetic, against the code at a git revision.

Two measurements of the current package against ``--revision`` (imported beside it):

  calls     Python function calls per pass of the reference LM (dim 64, 8 layers, batch 2 x 32)
            for each design: a training step (forward + backward), a prefill and a one-token
            decode step (cProfile's count: deterministic, unlike a timing on a shared machine)
  tiny      seconds per forward + backward of 32 routing points on tiny tensors (8 tokens,
            D = 64: the per-call cost is all there is), current and revision paired in each
            round, in alternating order so that neither always runs first
  decode    seconds per one-token decode step of the same small LM, paired the same way: where
            Python per call weighs most against arithmetic

    python benchmarks/overhead.py --revision 7483a66

Results go to ``results/overhead_{calls,tiny,decode}@REV.csv``.
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import import_revision, machine, print_table, write_csv  # noqa: E402

import attnres  # noqa: E402

SIZES = dict(vocab_size=256, dim=64, n_layers=8, n_heads=4, max_seq_len=64)
DESIGNS = {"prenorm": dict(residual="prenorm"), "block": dict(residual="block", num_blocks=8),
           "mhar": dict(residual="block", num_blocks=8, heads=4), "full": dict(residual="full"),
           "delta": dict(residual="delta", num_blocks=8, heads=4)}


def calls_per_pass(fn, passes=5) -> float:
    fn()
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(passes):
        fn()
    profile.disable()
    return pstats.Stats(profile).total_calls / passes


def model_passes(package, options):
    torch.manual_seed(0)
    model = package.Transformer(package.ModelConfig(**SIZES, **options))
    x = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(0))
    cache = model.new_cache(2, 64)
    with torch.no_grad():
        model(x[:, :32], cache=cache, start_pos=0)

    def train():
        model.loss(x[:, :-1], x[:, 1:]).backward()

    @torch.no_grad()
    def prefill():
        model(x[:, :32])

    # a decode pass, as generate asks for it (a revision without the flag inferred it)
    flag = {"decode": True} if "decode" in inspect.signature(model.forward).parameters else {}

    @torch.no_grad()
    def decode():
        model(x[:, 32:], cache=cache, start_pos=32, **flag)

    return {"train": train, "prefill": prefill, "decode": decode}


def tiny_step(package, kind, backend):
    torch.manual_seed(0)
    options = dict(backend=backend) if kind == "full" else dict(backend=backend, num_blocks=8)
    stream = package.build_stream(kind, dim=64, num_sublayers=32, **options)
    scales = torch.nn.Parameter(torch.ones(32, 64))
    with torch.no_grad():
        stream.pseudo_queries.normal_(0, 0.02)
    e = torch.randn(8, 64, requires_grad=True)

    def step():
        state = stream.init(e)
        for i in range(32):
            state = stream.write(state, i, torch.tanh(stream.read(state, i)) * scales[i])
        stream.output(state).square().mean().backward()

    return step


def paired(a, b, rounds, repeats=10):
    """Median seconds of ``a`` and ``b`` and the median per-round ratio, order alternating."""
    for _ in range(5):
        a(), b()
    times, ratios = {0: [], 1: []}, []
    for r in range(rounds):
        for k in ((0, 1) if r % 2 == 0 else (1, 0)):
            fn = (a, b)[k]
            start = time.perf_counter()
            for _ in range(repeats):
                fn()
            times[k].append((time.perf_counter() - start) / repeats)
        ratios.append(times[0][-1] / times[1][-1])
    return statistics.median(times[0]), statistics.median(times[1]), statistics.median(ratios), min(ratios), max(ratios)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--revision", required=True)
    p.add_argument("--rounds", type=int, default=30)
    args = p.parse_args()
    old = import_revision(args.revision)
    print(f"# overhead against {args.revision}; {machine()}")
    rows = []
    for design, options in DESIGNS.items():
        current, before = model_passes(attnres, options), model_passes(old, options)
        row = dict(design=design)
        for name in ("train", "prefill", "decode"):
            row[f"{name}_calls"] = calls_per_pass(current[name])
            row[f"{name}_calls_rev"] = calls_per_pass(before[name])
        rows.append(row)
    print_table(rows, list(rows[0]))
    write_csv(f"overhead_calls@{args.revision}", rows)
    print()
    tiny = []
    for kind in ("block", "full"):
        for backend in ("cpu", "torch"):
            now, then, ratio, lo, hi = paired(tiny_step(attnres, kind, backend), tiny_step(old, kind, backend),
                                              args.rounds)
            tiny.append(dict(design=kind, backend=backend, ms=1000 * now, ms_rev=1000 * then, ratio=ratio,
                             spread=f"{lo:.2f}..{hi:.2f}"))
    print_table(tiny, list(tiny[0]))
    write_csv(f"overhead_tiny@{args.revision}", tiny)
    print()
    decode = []
    for design, options in DESIGNS.items():
        now, then, ratio, lo, hi = paired(model_passes(attnres, options)["decode"],
                                          model_passes(old, options)["decode"], args.rounds)
        decode.append(dict(design=design, ms=1000 * now, ms_rev=1000 * then, ratio=ratio, spread=f"{lo:.2f}..{hi:.2f}"))
    print_table(decode, list(decode[0]))
    write_csv(f"overhead_decode@{args.revision}", decode)


if __name__ == "__main__":
    main()
