"""Reference depth attention: the specification written as plainly as possible.

This is the oracle every fast path is tested against (SPEC sections 2 and 4). It stacks the
sources, normalizes every one of them and materializes all logits; memory grows with the number
of sources, which is exactly what the fast paths avoid.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .rmsnorm import rms_norm


def depth_attention_naive(
    query: torch.Tensor,
    sources: Sequence[torch.Tensor],
    gain: torch.Tensor | None = None,
    *,
    heads: int = 1,
    eps: float = 1e-6,
    score: str = "softmax",
    key_norm: bool = True,
    return_weights: bool = False,
):
    """Mix ``sources`` over depth with weights from one pseudo-query.

    Shapes: ``query`` ``[D]`` (or per token ``[..., D]``), each source ``[..., D]``, ``gain``
    ``[D]``. With ``V = stack(sources)`` ``[N, ..., D]`` and ``K = RMSNorm_gain(V)`` (normalized
    over the full D, then split into ``heads`` contiguous slices of width ``D / heads``)::

        s[j, ..., h]     = query[h] . K[j, ..., h]
        alpha[j, ..., h] = softmax_j(s)             (or sigmoid(s) without normalization)
        out[..., h]      = sum_j alpha[j, ..., h] * V[j, ..., h]

    Math in fp32 (fp64 for fp64 inputs); the output ``[..., D]`` is in the sources' dtype. With ``return_weights`` also
    returns ``alpha`` ``[N, ..., heads]`` (fp32).
    """
    math_dtype = torch.promote_types(sources[0].dtype, torch.float32)  # fp32, or fp64 for fp64
    values = torch.stack(list(sources)).to(math_dtype)  # [N, ..., D]
    dim = values.shape[-1]
    keys = rms_norm(values, eps=eps) if key_norm else values
    if gain is not None:
        keys = keys * gain.to(math_dtype)
    head_dim = dim // heads
    keys = keys.unflatten(-1, (heads, head_dim))  # [N, ..., H, Dh]
    q = query.to(math_dtype).unflatten(-1, (heads, head_dim))  # [H, Dh] or [..., H, Dh]
    logits = (keys * q).sum(-1)  # [N, ..., H]
    if score == "softmax":
        weights = torch.softmax(logits, dim=0)
    else:
        weights = torch.sigmoid(logits)
    mixed = (weights.unsqueeze(-1) * values.unflatten(-1, (heads, head_dim))).sum(0)  # [..., H, Dh]
    out = mixed.flatten(-2).to(sources[0].dtype)
    return (out, weights) if return_weights else out
