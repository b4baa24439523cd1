"""The measurements behind the tuning choices in the ``torch`` backend: in each case what the code
does (``a``, following its own constants) against the alternative (``b``), interleaved in one
run (fp32, the reference LM's widths):

  logits     one source's logits for S queries x 8 heads: one block-diagonal [S*8, D] matmul
             against an einsum per head (common.BLOCK_DIAGONAL_ROWS)
  dots       per-head dot products g . v: through one reused scratch buffer (head_dots) against a
             fresh product per call (linalg.vecdot)
  sums       the weighted sums of 2 queries over 9 sources: one accumulator per query (the
             backend's) against one [S, ..., D] accumulator
  few        the inference path's weighted sums of 2 queries over 9 sources for a few tokens:
             over the stacked sources against one op per source and query (torch.FEW_TOKENS)

    python benchmarks/tuning.py --rounds 15
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import interleaved, machine, print_table, ratio_summary, span, write_csv  # noqa: E402

from attnres.ops.backends import common as shared  # noqa: E402
from attnres.ops.backends import torch as backend  # noqa: E402

D, HEADS, SOURCES = 512, 8, 9


def code_first(pair: dict, code_takes_first: bool) -> dict:
    return pair if code_takes_first else dict(reversed(pair.items()))


def logits_pair(queries: int, tokens: int) -> dict:
    g = torch.Generator().manual_seed(0)
    v = torch.randn(tokens, D, generator=g)
    qg = torch.randn(queries, D, generator=g)
    block = shared.head_matrix(qg, HEADS)
    per_head = qg.view(queries, HEADS, D // HEADS)
    pair = {"block-diagonal": lambda: shared.source_logits(v, block, HEADS),
            "per-head": lambda: shared.source_logits(v, per_head, HEADS)}
    return code_first(pair, queries * HEADS <= shared.BLOCK_DIAGONAL_ROWS)


def dots_pair(tokens: int) -> dict:
    g = torch.Generator().manual_seed(1)
    a, b = (torch.randn(tokens, HEADS, D // HEADS, generator=g) for _ in range(2))
    scratch = torch.empty_like(a)
    return {"reused-buffer": lambda: backend.head_dots(a, b, scratch),
            "fresh": lambda: torch.linalg.vecdot(a, b)}


def sums_pair(tokens: int) -> dict:
    g = torch.Generator().manual_seed(2)
    sources = [torch.randn(tokens, D, generator=g) for _ in range(SOURCES)]
    weights = torch.softmax(torch.randn(SOURCES, 2, tokens, HEADS, generator=g), 0)
    lead, dh = (tokens,), D // HEADS

    def one_accumulator():
        w = weights.unsqueeze(-1)
        acc = w[0] * sources[0].view(1, *lead, HEADS, dh)
        for j in range(1, SOURCES):
            acc.addcmul_(w[j], sources[j].view(1, *lead, HEADS, dh))
        return acc

    return {"per-query": lambda: backend._weighted_sums(weights, sources, lead, HEADS, dh),
            "one-accumulator": one_accumulator}


def few_pair(tokens: int) -> dict:
    g = torch.Generator().manual_seed(3)
    sources = [torch.randn(tokens, D, generator=g) for _ in range(SOURCES)]
    weights = torch.softmax(torch.randn(SOURCES, 2, tokens, HEADS, generator=g), 0)
    lead, dh = (tokens,), D // HEADS
    pair = {"stacked": lambda: backend._stacked_weighted_sums(weights, sources, lead, HEADS, dh),
            "per-source": lambda: backend._weighted_sums(weights, sources, lead, HEADS, dh)}
    return code_first(pair, tokens <= backend.FEW_TOKENS)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=15)
    args = p.parse_args()
    print(f"# tuning: D={D}, {HEADS} heads, {SOURCES} sources; {machine()}")
    cases = [("logits", f"{q} queries, 2048 tokens", logits_pair(q, 2048)) for q in (1, 2, 3, 17)]
    cases += [("dots", "2048 tokens", dots_pair(2048))]
    cases += [("sums", f"{t} tokens", sums_pair(t)) for t in (1024, 2048)]
    cases += [("few", f"{t} tokens", few_pair(t)) for t in (1, 8, 64, 256, 1024)]
    rows = []
    with torch.no_grad():
        for op, shape, pair in cases:
            chosen, other = pair
            s = ratio_summary(interleaved(pair, args.rounds, warmup=3), other)
            rows.append(dict(op=op, shape=shape, a=chosen, a_ms=1000 * s[chosen]["median_s"], b=other,
                             b_ms=1000 * s[other]["median_s"], a_vs_b=s[chosen]["ratio"],
                             spread=span(s[chosen]["ratio_min"], s[chosen]["ratio_max"], 2)))
    print_table(rows, ["op", "shape", "a", "a_ms", "b", "b_ms", "a_vs_b", "spread"])
    write_csv("tuning", rows)


if __name__ == "__main__":
    main()
