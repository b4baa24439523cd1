"""The multi-stream designs' operations at the demo size, the current code against a revision.

Shapes of ``attnres compare``'s demo and study preset: batch 16 x 128 tokens, D = 96, n = 4
streams (HC, mHC) or branches (GR), fp32. Each op runs forward and backward (every input
requires grad) through the ``cpu`` backend of each package:
  mix         ``stream_mix(H [.., 4, 96], w [.., 4])``: HC's and mHC's read
  update      ``stream_update(H, A [.., 4, 4], b, v)``: mHC's write
  sinkhorn    ``sinkhorn(logits [.., 4, 4], 20)``: mHC's write
  gated       ``gated_mix(R, z [.., 4, 96])``: GR's read from given logits
  gated-up    GR's read from its low-rank layer ``h [.., 12]`` and up-projection ``U [384, 12]``
              (``gated_mix_lowrank``; at a revision whose backends lack it, ``gated_mix`` of
              ``h @ U^T``, as GR ran there)
  branch-norm GR's per-branch RMSNorm of ``R [.., 4, 96]`` (``rms_norm`` of the backend, or
              ``ops.RMSNormFunction`` at a revision whose backends lack it, as GR ran there)
  project-C   ``ops.rms_norm_project`` of ``[.., 384]`` onto C columns of a ``[384, 24]`` matrix:
              mHC's read (C = 4) and write (C = 20) projections, and both at once (C = 24)
The revision's and the current code's calls alternate in every round; a figure is the median of
the per-round ratios now / revision, with their min..max.

    python benchmarks/stream_ops.py --revision 2374d2b --rounds 15
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import import_revision, interleaved, machine, print_table, ratio_summary, span, write_csv  # noqa: E402

import attnres  # noqa: E402

LEAD, N, D, ITERATIONS, RANK = (16, 128), 4, 96, 20, 12


def inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=g)).requires_grad_()

    return dict(H=rand(*LEAD, N, D), w=rand(*LEAD, N), A=rand(*LEAD, N, N), b=rand(*LEAD, N), v=rand(*LEAD, D),
                logits=rand(*LEAD, N, N, scale=2.0), z=rand(*LEAD, N, D), gain=rand(D), u=rand(*LEAD, N * D),
                P=rand(N * D, 24, scale=0.05), h=rand(*LEAD, RANK), U=rand(N * D, RANK, scale=0.05))


def calls(package, x: dict[str, torch.Tensor]) -> dict:
    """``{op: fn}``: each op's forward and backward on ``package``'s ``cpu`` backend."""
    ops = importlib.import_module(f"{package.__name__}.ops")
    cpu = ops.backend("cpu")
    branch_norm = getattr(cpu, "rms_norm", None) or ops.RMSNormFunction.apply
    gated_up = getattr(cpu, "gated_mix_lowrank", None) or (
        lambda R, h, U: cpu.gated_mix(R, (h @ U.T).unflatten(-1, R.shape[-2:])))
    forwards = {
        "mix": lambda: cpu.stream_mix(x["H"], x["w"]),
        "update": lambda: cpu.stream_update(x["H"], x["A"], x["b"], x["v"]),
        "sinkhorn": lambda: cpu.sinkhorn(x["logits"], ITERATIONS),
        "gated": lambda: cpu.gated_mix(x["H"], x["z"]),
        "gated-up": lambda: gated_up(x["H"], x["h"], x["U"]),
        "branch-norm": lambda: branch_norm(x["H"], x["gain"], 1e-6),
        "project-4": lambda: ops.rms_norm_project(x["u"], x["P"][:, :4], 1e-6),
        "project-20": lambda: ops.rms_norm_project(x["u"], x["P"][:, 4:], 1e-6),
        "project-24": lambda: ops.rms_norm_project(x["u"], x["P"], 1e-6),
    }

    def with_backward(forward):
        def run():
            y = forward()
            y.backward(torch.ones_like(y))
        return run

    return {op: with_backward(f) for op, f in forwards.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--revision", required=True, help="the git revision to compare against")
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--csv", default="stream_ops")
    args = p.parse_args()
    print(f"# multi-stream ops, tokens {LEAD}, n={N}, D={D}, fp32, forward + backward; {machine()}")
    x = inputs()
    now, then = calls(attnres, x), calls(import_revision(args.revision), x)
    rows = []
    for op in now:
        s = ratio_summary(interleaved({"rev": then[op], "now": now[op]}, args.rounds, warmup=2), "rev")
        rows.append(dict(op=op, revision=args.revision, rev_ms=1000 * s["rev"]["median_s"],
                         now_ms=1000 * s["now"]["median_s"], now_vs_rev=s["now"]["ratio"],
                         spread=span(s["now"]["ratio_min"], s["now"]["ratio_max"], 2)))
    print_table(rows, ["op", "revision", "rev_ms", "now_ms", "now_vs_rev", "spread"])
    print(f"wrote {write_csv(args.csv, rows)}")


if __name__ == "__main__":
    main()
