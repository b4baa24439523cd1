"""Depth attention for inference: each source scored once against every later query.

A source's logit for a query does not depend on the other sources, so without autograd a stream
can score each new source against all the sites that will ever read it, in one matmul, the
moment the source exists; a read then only gathers its column of every source's scores::

    scores_j = source_scores(v_j, queries[first:], gains[first:])      # [..., K, H]
    outs, lse = mix_scored([scores_j[..., rows, :] for j], sources)    # softmax over j, sum

For Block AttnRes this turns the ``O(N^2)`` thin per-block logit matmuls of a prefill into
``N`` wider ones (one per completed block). The weighted sums are those of the autograd op
(``ops.fused``); for at most ``FEW_TOKENS`` tokens they run over the stacked sources instead.
Results equal the autograd op's up to rounding (the wider matmul, the summation order).

No gradients flow through these functions: streams use them only with autograd off.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .cpu_kernels import mix_forward
from .fused import compute_dtype, fold_gain, key_inverse_rms, mix_logits, scoring_weights, source_logits
from .rmsnorm import rms_norm_forward

#: at most this many tokens (decoding), the weighted sums run over stacked sources: a few ops
#: instead of one per source and query, whose dispatch is then the whole cost
FEW_TOKENS = 64


@torch.no_grad()
def source_scores(
    v: torch.Tensor,
    queries: torch.Tensor,
    gains: torch.Tensor | None = None,
    *,
    heads: int = 1,
    eps: float = 1e-6,
    key_norm: bool = True,
    inv_rms: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits ``[..., K, H]`` (compute dtype) of one source ``v`` ``[..., D]`` for ``K`` queries
    ``[K, D]`` with key-norm gains ``[K, D]`` (or None), per head:
    ``s[k, h] = (q_k * g_k)[h] . (v * rsqrt(mean(v^2) + eps))[h]``.

    ``inv_rms`` ``[...]`` is the source's cached ``inverse_rms`` (computed here when None)."""
    dt = compute_dtype(v.dtype)
    if key_norm:
        inv_rms = key_inverse_rms(v, inv_rms, eps)
    weights = scoring_weights(fold_gain(queries, gains, dt), heads)
    return source_logits(v.to(dt), weights, heads, inv_rms if key_norm else None)


@torch.no_grad()
def mix_scored(
    scores: Sequence[torch.Tensor],
    sources: Sequence[torch.Tensor],
    *,
    score: str = "softmax",
    norm: tuple[torch.Tensor | None, float] | None = None,
    kernels: bool = False,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``S`` queries against ``sources`` from precomputed logits: ``(outs, lse)`` as
    ``depth_attention_multi`` returns them, ``S x [..., D]`` and ``[S, ..., H]``.

    ``scores[j]`` ``[..., S, H]`` holds source ``j``'s logits for the ``S`` queries
    (``source_scores``). ``norm = (weight, eps)`` returns the first output through ``rms_norm``.
    ``kernels``: the softmax, the sums and the norm in one pass of the CPU kernels
    (``ops.cpu_kernels``; fp32/fp64 CPU sources)."""
    if len(scores) != len(sources):
        raise ValueError(f"{len(scores)} score tensors for {len(sources)} sources")
    lead, D = sources[0].shape[:-1], sources[0].shape[-1]
    S, H = scores[0].shape[-2:]
    logits = torch.stack([s.expand(*lead, S, H) for s in scores]).movedim(-2, 1)  # [N, S, ..., H]
    if kernels:
        outs, lse, _, _ = mix_forward(sources, None, None, H, score, False, norm, logits=logits)
        return outs, lse
    few_tokens = lead.numel() <= FEW_TOKENS
    outs, lse = mix_logits(logits, sources, score, lead, H, D // H, stacked=few_tokens)
    if norm is not None:
        outs = (rms_norm_forward(outs[0], *norm, in_place=True)[0], *outs[1:])  # a fresh sum
    return outs, lse
