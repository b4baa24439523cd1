"""Training step of the reference LM for every residual design, against PreNorm.

dim 512, 8 layers, n_heads = n_kv_heads = 8, ffn_dim 1536, vocab 256, batch 8 x seq 256, fp32,
one step = forward, backward and AdamW. Ratios are per round against ``prenorm`` in the same
run; ``plain`` is a nanoGPT-style loop of the same shapes (benchmarks/plain_lm.py).

    python benchmarks/train_step.py
    python benchmarks/train_step.py --variants prenorm block mhar --rounds 9
    python benchmarks/train_step.py --revisions 7483a66 --rounds 5   # and the same variants at a git revision

With ``--revisions``, every variant also runs on the package as it was at each revision
(``block@REV``), interleaved in the same rounds; its ratios are against ``prenorm@REV``. A
second table (``NAME_against.csv``) gives each design's current step against the same design at
the revision: the median and min..max of the per-round ratios.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    against_revisions,
    allocator,
    child_memory,
    import_revision,
    interleaved,
    machine,
    own_baseline,
    print_table,
    ratio_to_own_baseline,
    report_child,
    rss_mib,
    span,
    split_variant,
    with_revisions,
    write_csv,
)
from plain_lm import PlainLM  # noqa: E402

import attnres  # noqa: E402

SIZES = dict(vocab_size=256, dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=1536, max_seq_len=256)
VARIANTS = {
    "plain": None,
    "prenorm": dict(residual="prenorm"),
    "block": dict(residual="block", num_blocks=8),
    "mhar": dict(residual="block", num_blocks=8, heads=8),
    "full": dict(residual="full"),
    "delta": dict(residual="delta", num_blocks=8, heads=8),
    "hc": dict(residual="hc", streams=4),
    "mhc": dict(residual="mhc", streams=4),
    "gr": dict(residual="gr", streams=4),
    "block-naive": dict(residual="block", num_blocks=8, backend="naive", two_phase=False),
    "block-torch": dict(residual="block", num_blocks=8, backend="torch"),
    "mhar-torch": dict(residual="block", num_blocks=8, heads=8, backend="torch"),
}


def build(variant, batch, seq):
    torch.manual_seed(0)
    name, rev = split_variant(variant)
    package = attnres if rev is None else import_revision(rev)
    if name == "plain":
        model = PlainLM(SIZES["vocab_size"], SIZES["dim"], SIZES["n_layers"], SIZES["n_heads"],
                        SIZES["ffn_dim"], SIZES["max_seq_len"])
        groups = [{"params": list(model.parameters()), "weight_decay": 0.1}]
    else:
        model = package.Transformer(package.ModelConfig(**SIZES, **VARIANTS[name]))
        groups = package.param_groups(model, 0.1)
    return training_step(model, groups, batch, seq)


def training_step(model, groups, batch: int, seq: int):
    """One step (forward, backward, AdamW) of ``model`` on a fixed random batch of ``batch`` x
    ``seq`` tokens, as a function; its ``init_optimizer_state()`` creates AdamW's moments. The
    stream's pseudo-queries are drawn at N(0, 0.02) first: live routing, as after some training."""
    with torch.no_grad():
        for name, p in getattr(model, "stream", torch.nn.Module()).named_parameters():
            if name == "pseudo_queries":
                p.normal_(0, 0.02)
    opt = torch.optim.AdamW(groups, lr=1e-4)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 256, (batch, seq + 1), generator=g)

    def step():
        opt.zero_grad(set_to_none=True)
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()

    def init_optimizer_state():
        """AdamW's moments exist before the measured steps: they are construction, not growth."""
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)

    step.init_optimizer_state = init_optimizer_state
    return step


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="*", default=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--revisions", nargs="*", default=[], metavar="REV",
                   help="also run every variant (but plain) on the package at these git revisions")
    p.add_argument("--csv", help="name of the results file under benchmarks/results/ (default: train_step, "
                   "train_step_malloc_fixed with glibc's thresholds fixed, and @REV for each revision)")
    p.add_argument("--child")
    args = p.parse_args()
    if args.child:
        step = build(args.child, args.batch, args.seq)
        step.init_optimizer_state()
        base = rss_mib()
        for _ in range(2):
            step()
        return report_child(base)
    variants = list(dict.fromkeys(["prenorm", *args.variants]))
    variants = with_revisions(variants, args.revisions, skip=("plain",))
    print(f"# train step: {SIZES}, batch {args.batch} x {args.seq}; {machine()}")
    steps = {v: build(v, args.batch, args.seq) for v in variants}
    times = interleaved(steps, args.rounds, warmup=1)
    summary = ratio_to_own_baseline(times, "prenorm")
    del steps
    extra = ["--batch", str(args.batch), "--seq", str(args.seq)]
    mem = {v: child_memory(__file__, v, extra)["growth_mib"] for v in variants}
    rows = [
        dict(variant=v, median_s=summary[v]["median_s"], time_vs_prenorm=summary[v]["ratio"],
             spread=span(summary[v]["ratio_min"], summary[v]["ratio_max"]),
             mem_growth_mib=mem[v], mem_vs_prenorm=mem[v] / mem[own_baseline(v, "prenorm")])
        for v in variants
    ]
    print_table(rows, ["variant", "median_s", "time_vs_prenorm", "spread", "mem_growth_mib", "mem_vs_prenorm"])
    name = "train_step" if allocator() == "malloc defaults" else "train_step_malloc_fixed"
    name = args.csv or name + "".join(f"@{rev}" for rev in args.revisions or ())
    write_csv(name, rows)
    if args.revisions:
        compared = against_revisions({"train_step": times})
        print_table(compared, list(compared[0]))
        write_csv(f"{name}_against", compared)


if __name__ == "__main__":
    main()
