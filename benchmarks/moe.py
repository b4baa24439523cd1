"""Mixture-of-experts: the sorted dispatch against its per-expert twin, and the training step of an
MoE model with Block AttnRes against the same MoE model with PreNorm.

Dispatch: one ``MoE`` sublayer, dim 512, 8 experts of width 384, top-2, on 8 x 256 tokens (fp32):
forward and backward of ``MoE.forward`` (``sorted``) and of ``moe_naive`` (``naive``), and
forward alone under ``no_grad`` (``*-fwd``); ratios per round against ``sorted``.

Training step: the train-step benchmark's model (dim 512, 8 layers, 8 heads, vocab 256, batch 8 x
256) with every MLP a mixture of 8 experts of width 384, top-2; one step = forward, backward and
AdamW; ratios per round against ``prenorm-moe``; memory growth in a fresh process per variant.

    python benchmarks/moe.py
    python benchmarks/moe.py --rounds 9 --part dispatch
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    child_memory,
    interleaved,
    machine,
    print_table,
    ratio_summary,
    report_child,
    rss_mib,
    span,
    write_csv,
)
from train_step import training_step  # noqa: E402

from attnres import ModelConfig, MoE, Transformer, param_groups  # noqa: E402
from attnres.moe import moe_naive  # noqa: E402

DIM, EXPERTS, TOP_K, HIDDEN = 512, 8, 2, 384
SIZES = dict(vocab_size=256, dim=DIM, n_layers=8, n_heads=8, n_kv_heads=8, max_seq_len=256,
             moe_experts=EXPERTS, moe_top_k=TOP_K, moe_hidden=HIDDEN)
MODELS = {
    "prenorm-moe": dict(residual="prenorm"),
    "block-moe": dict(residual="block", num_blocks=8),
    "mhar-moe": dict(residual="block", num_blocks=8, heads=8),
    "full-moe": dict(residual="full"),
}


def dispatch_calls(batch: int, seq: int) -> dict:
    torch.manual_seed(0)
    moe = MoE(DIM, EXPERTS, TOP_K, HIDDEN)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(batch, seq, DIM, requires_grad=True)

    def train(fn):
        def call():
            moe.zero_grad(set_to_none=True)
            x.grad = None
            fn(moe, x).sum().backward()
        return call

    def forward(fn):
        def call():
            with torch.no_grad():
                fn(moe, x)
        return call

    fast, naive = MoE.forward, moe_naive
    return {"sorted": train(fast), "naive": train(naive), "sorted-fwd": forward(fast), "naive-fwd": forward(naive)}


def build_step(variant: str, batch: int, seq: int):
    torch.manual_seed(0)
    model = Transformer(ModelConfig(**SIZES, **MODELS[variant]))
    return training_step(model, param_groups(model, 0.1), batch, seq)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--part", choices=("dispatch", "train", "both"), default="both")
    p.add_argument("--variants", nargs="*", default=list(MODELS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--child")
    args = p.parse_args()
    if args.child:
        step = build_step(args.child, args.batch, args.seq)
        step.init_optimizer_state()
        base = rss_mib()
        for _ in range(2):
            step()
        return report_child(base)
    print(f"# MoE: dim {DIM}, {EXPERTS} experts of width {HIDDEN}, top-{TOP_K}, batch {args.batch} x {args.seq}; "
          f"{machine()}")
    if args.part in ("dispatch", "both"):
        times = interleaved(dispatch_calls(args.batch, args.seq), args.rounds, warmup=1)
        summary = {**ratio_summary({k: times[k] for k in ("sorted", "naive")}, "sorted"),
                   **ratio_summary({k: times[k] for k in ("sorted-fwd", "naive-fwd")}, "sorted-fwd")}
        rows = [dict(variant=v, median_s=s["median_s"], ratio_to_sorted=s["ratio"],
                     spread=span(s["ratio_min"], s["ratio_max"])) for v, s in summary.items()]
        print_table(rows, ["variant", "median_s", "ratio_to_sorted", "spread"])
        write_csv("moe_dispatch", rows)
    if args.part in ("train", "both"):
        variants = list(dict.fromkeys(["prenorm-moe", *args.variants]))
        steps = {v: build_step(v, args.batch, args.seq) for v in variants}
        summary = ratio_summary(interleaved(steps, args.rounds, warmup=1), "prenorm-moe")
        del steps
        extra = ["--batch", str(args.batch), "--seq", str(args.seq)]
        mem = {v: child_memory(__file__, v, extra)["growth_mib"] for v in variants}
        rows = [dict(variant=v, median_s=summary[v]["median_s"], time_vs_prenorm_moe=summary[v]["ratio"],
                     spread=span(summary[v]["ratio_min"], summary[v]["ratio_max"]),
                     mem_growth_mib=mem[v], mem_vs_prenorm_moe=mem[v] / mem["prenorm-moe"]) for v in variants]
        print_table(rows, ["variant", "median_s", "time_vs_prenorm_moe", "spread", "mem_growth_mib",
                           "mem_vs_prenorm_moe"])
        write_csv("moe_train_step", rows)


if __name__ == "__main__":
    main()
