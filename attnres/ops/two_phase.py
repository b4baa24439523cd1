"""Phase 2 of the two-phase Block computation (SPEC section 3).

Phase 1 (``depth_attention_multi``) scores all queries of a block against its completed sources
once, keeping each query's normalized mix ``o1`` and log-sum-exp ``lse1``. Phase 2 adds the one
partial source ``P_i`` of sublayer ``i`` exactly::

    s2 = w_i . RMSNorm_{k_i}(P_i)                      (per head)
    h  = (exp(lse1) o1 + exp(s2) P) / (exp(lse1) + exp(s2)) = lerp(P, o1, sigmoid(lse1 - s2))

The ``lerp`` form needs no max-shift and keeps nothing for backward beyond references to ``o1``
and ``P`` (which exist anyway) and one weight per token and head.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .fused import head_matrix


def merge_partial(
    o1: torch.Tensor,
    lse1: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    *,
    heads: int = 1,
    eps: float = 1e-6,
    score: str = "softmax",
    key_norm: bool = True,
) -> torch.Tensor:
    """Merge the partial source into phase 1's result.

    Shapes: ``o1`` ``[..., D]``, ``lse1`` ``[..., H]``, ``partial`` ``[..., D]``, ``query`` and
    ``gain`` ``[D]``. Returns ``h`` ``[..., D]`` in ``partial``'s dtype. With the sigmoid score the
    weights are not normalized, so the merge is the plain sum ``o1 + sigmoid(s2) P``.
    """
    dt = torch.promote_types(partial.dtype, torch.float32)
    P = partial.to(dt)
    qg = query.to(dt) if gain is None else query.to(dt) * gain.to(dt)
    s2 = F.linear(P, head_matrix(qg.unsqueeze(0), heads))  # [..., H]
    if key_norm:
        d = partial.shape[-1]
        s2 = s2 * torch.rsqrt(torch.linalg.vector_norm(P, dim=-1).square() / d + eps).unsqueeze(-1)
    lead, D = partial.shape[:-1], partial.shape[-1]
    Ph = partial.view(*lead, heads, D // heads)
    o1h = o1.view(*lead, heads, D // heads)
    if score == "softmax":
        w1 = torch.sigmoid(lse1 - s2).unsqueeze(-1).to(partial.dtype)  # a / (a + b)
        return torch.lerp(Ph, o1h, w1).view(*lead, D)
    return (o1h + torch.sigmoid(s2).unsqueeze(-1).to(partial.dtype) * Ph).view(*lead, D)
