"""Sinkhorn-Knopp normalization to a doubly stochastic matrix (mHC, SPEC section 7)."""

from __future__ import annotations

import torch


def sinkhorn(logits: torch.Tensor, iterations: int = 20) -> torch.Tensor:
    """Project ``exp(logits)`` ``[..., n, n]`` onto (nearly) doubly stochastic matrices.

    Alternates row and column normalization ``iterations`` times, in log space so that large
    logits cannot overflow. The result's columns sum to 1 exactly and its rows to 1 within the
    convergence of the iteration (well under 1e-5 for the logits mHC produces).
    """
    if iterations < 1:
        raise ValueError(f"iterations={iterations} must be >= 1")
    log_p = logits.float()
    for _ in range(iterations):
        log_p = log_p - torch.logsumexp(log_p, dim=-1, keepdim=True)  # rows sum to 1
        log_p = log_p - torch.logsumexp(log_p, dim=-2, keepdim=True)  # columns sum to 1
    return log_p.exp().to(logits.dtype)
