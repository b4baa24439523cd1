"""Compiled training step on CPU: the fused CPU kernels' custom ops against the ``torch`` backend.

A small LM (dim 256, 4 layers, n_heads = n_kv_heads = 4, ffn_dim 768, vocab 256, batch 4 x seq
128, fp32), its loss compiled with ``torch.compile`` (inductor); one step = forward, backward and
AdamW. Each design (Full and Block by default; MHAR and Delta on request) runs compiled on
``backend="cpu"`` (the kernels as ``attnres::`` custom ops in the graph, what ``auto`` picks),
compiled on ``backend="torch"`` (PyTorch ops, which inductor fuses), and eagerly on
``backend="cpu"`` for reference. Ratios are per round against the compiled ``torch`` step of the
same design, in the same run; compilation happens in the warm-up.

    python benchmarks/compiled_step.py
    python benchmarks/compiled_step.py --designs full block mhar delta --rounds 9
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, machine, print_table, ratio_summary, span, write_csv  # noqa: E402

import attnres  # noqa: E402

SIZES = dict(vocab_size=256, dim=256, n_layers=4, n_heads=4, n_kv_heads=4, ffn_dim=768)
DESIGNS = {
    "full": dict(residual="full"),
    "block": dict(residual="block", num_blocks=4),
    "mhar": dict(residual="block", num_blocks=4, heads=8),
    "delta": dict(residual="delta", num_blocks=4, heads=8),
}
#: how each design runs: (compiled, backend)
MODES = {
    "compiled-cpu": (True, "cpu"),
    "compiled-torch": (True, "torch"),
    "eager-cpu": (False, "cpu"),
}
BASELINE = "compiled-torch"


def training_step(design: str, mode: str, batch: int, seq: int, compiler: str):
    """One step (forward, backward, AdamW) of the design's model on a fixed random batch, as a
    function; the loss compiled when the mode says so. Pseudo-queries at N(0, 0.02): live
    routing, as after some training."""
    compiled, backend = MODES[mode]
    torch.manual_seed(0)
    config = attnres.ModelConfig(**SIZES, max_seq_len=seq, **DESIGNS[design], backend=backend)
    model = attnres.Transformer(config)
    with torch.no_grad():
        for name, p in model.stream.named_parameters():
            if name == "pseudo_queries":
                p.normal_(0, 0.02)
    opt = torch.optim.AdamW(attnres.param_groups(model, 0.1), lr=1e-4)
    loss = torch.compile(model.loss, backend=compiler) if compiled else model.loss
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, SIZES["vocab_size"], (batch, seq + 1), generator=g)

    def step():
        opt.zero_grad(set_to_none=True)
        loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()

    return step


def main():
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--designs", nargs="*", default=["full", "block"], choices=list(DESIGNS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--compiler", default="inductor",
                   help="torch.compile's backend (default: inductor)")
    p.add_argument("--csv", default="compiled_step",
                   help="name of the results file under benchmarks/results/")
    args = p.parse_args()
    # one compiled graph per model: more models than dynamo's default limit of recompilations
    torch._dynamo.config.recompile_limit = 64
    print(f"# compiled train step: {SIZES}, batch {args.batch} x {args.seq}, {args.compiler}; "
          f"{machine()}")
    steps = {f"{d} {m}": training_step(d, m, args.batch, args.seq, args.compiler)
             for d in args.designs for m in MODES}
    times = interleaved(steps, args.rounds, warmup=1)
    rows = []
    for d in args.designs:
        summary = ratio_summary({m: times[f"{d} {m}"] for m in MODES}, BASELINE)
        rows += [dict(design=d, mode=m, median_s=s["median_s"], time_vs_compiled_torch=s["ratio"],
                      spread=span(s["ratio_min"], s["ratio_max"]))
                 for m, s in summary.items()]
    print_table(rows, ["design", "mode", "median_s", "time_vs_compiled_torch", "spread"])
    write_csv(args.csv, rows)


if __name__ == "__main__":
    main()
