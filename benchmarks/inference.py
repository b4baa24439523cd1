"""Inference latency of the reference LM for each residual design, against PreNorm.

Prefill: batch 1, a 1024-token prompt, one forward (no_grad). Decode: batch 1, 128 tokens
generated one at a time after a 1024-token prompt, with the KV cache (the residual state is per
token, so nothing else is cached). Same model as benchmarks/train_step.py; ratios per round
against ``prenorm`` in the same run.

    python benchmarks/inference.py
    python benchmarks/inference.py --variants prenorm block mhar --rounds 7
    python benchmarks/inference.py --revisions 7483a66   # and the same variants at a git revision (block@REV)

glibc's malloc makes prefill timings depend on its heap state (see docs/BENCHMARKS.md); to time
without page-fault churn, fix its thresholds in the environment:

    MALLOC_MMAP_THRESHOLD_=33554432 MALLOC_TRIM_THRESHOLD_=4294967296 python benchmarks/inference.py

The table header names the settings; a run with them writes ``inference_malloc_fixed.csv``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    allocator,
    import_revision,
    interleaved,
    machine,
    print_table,
    ratio_to_own_baseline,
    split_variant,
    with_revisions,
    write_csv,
)
from train_step import SIZES, VARIANTS  # noqa: E402

import attnres  # noqa: E402


def build(variant, prompt_len, new_tokens):
    torch.manual_seed(0)
    name, rev = split_variant(variant)
    package = attnres if rev is None else import_revision(rev)
    config = package.ModelConfig(**{**SIZES, "max_seq_len": prompt_len + new_tokens}, **VARIANTS[name])
    model = package.Transformer(config).eval()
    with torch.no_grad():
        if hasattr(model.stream, "pseudo_queries"):
            model.stream.pseudo_queries.normal_(0, 0.02)
    prompt = torch.randint(0, 256, (1, prompt_len), generator=torch.Generator().manual_seed(0))

    @torch.no_grad()
    def prefill():
        model(prompt)

    @torch.no_grad()
    def decode():
        cache = model.new_cache(1, prompt_len + new_tokens)
        model(prompt, cache=cache, start_pos=0)
        token = prompt[:, -1:]
        start = __import__("time").perf_counter()
        for t in range(new_tokens):
            token = model(token, cache=cache, start_pos=prompt_len + t)[:, -1].argmax(-1, keepdim=True)
        return __import__("time").perf_counter() - start

    return prefill, decode


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="*", default=["prenorm", "block", "mhar", "full", "delta", "hc", "mhc", "gr"])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--prompt", type=int, default=1024)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--revisions", nargs="*", default=[], metavar="REV",
                   help="also run every variant on the package at these git revisions")
    args = p.parse_args()
    variants = list(dict.fromkeys(["prenorm", *args.variants]))
    variants = with_revisions(variants, args.revisions)
    print(f"# inference: {SIZES}, prompt {args.prompt}, decode {args.new_tokens}; {machine()}")
    built = {v: build(v, args.prompt, args.new_tokens) for v in variants}
    pre = ratio_to_own_baseline(interleaved({v: b[0] for v, b in built.items()}, args.rounds, warmup=1), "prenorm")
    dec_times = {v: [] for v in variants}
    for _ in range(max(2, args.rounds // 2)):  # decode timing excludes the prefill inside it
        for v, b in built.items():
            dec_times[v].append(b[1]())
    dec = ratio_to_own_baseline(dec_times, "prenorm")
    rows = [
        dict(variant=v, prefill_ms=1000 * pre[v]["median_s"], prefill_vs_prenorm=pre[v]["ratio"],
             prefill_spread=f"{pre[v]['ratio_min']:.3f}..{pre[v]['ratio_max']:.3f}",
             decode_ms_per_token=1000 * dec[v]["median_s"] / args.new_tokens, decode_vs_prenorm=dec[v]["ratio"],
             decode_spread=f"{dec[v]['ratio_min']:.3f}..{dec[v]['ratio_max']:.3f}")
        for v in variants
    ]
    print_table(rows, list(rows[0]))
    name = "inference" if allocator() == "malloc defaults" else "inference_malloc_fixed"
    write_csv(name + "".join(f"@{rev}" for rev in args.revisions or ()), rows)


if __name__ == "__main__":
    main()
