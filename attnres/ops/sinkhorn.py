"""Sinkhorn-Knopp normalization to a doubly stochastic matrix (mHC, docs/METHOD.md section 7)."""

from __future__ import annotations

import torch


def check_iterations(iterations) -> None:
    """``ValueError`` unless ``iterations`` is an integer >= 1."""
    if isinstance(iterations, bool) or not isinstance(iterations, int) or iterations < 1:
        raise ValueError(f"iterations={iterations!r} must be an integer >= 1")


def sinkhorn(logits: torch.Tensor, iterations: int = 20) -> torch.Tensor:
    """Project ``exp(logits)`` ``[..., n, n]`` onto (nearly) doubly stochastic matrices.

    Alternates row and column normalization ``iterations`` times, in fp32 (fp64 for fp64 logits). The logits are shifted by
    their per-matrix maximum first, so every entry lies in (0, 1] and nothing overflows; the
    iteration then runs on probabilities (two divisions per step, a quarter of the kernels of
    the log-space form). The columns of the result sum to 1 exactly and its rows to 1 within the
    convergence of the iteration (well under 1e-5 for the logits mHC produces).
    """
    check_iterations(iterations)
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))  # fp32, fp64 for fp64
    p = (x - x.amax(dim=(-2, -1), keepdim=True)).exp()
    tiny = torch.finfo(p.dtype).tiny
    # multiplying by the reciprocal of the small [..., n, 1] sums is cheaper, forward and
    # backward, than dividing the [..., n, n] matrix
    for _ in range(iterations):
        p = p * p.sum(dim=-1, keepdim=True).clamp_min(tiny).reciprocal()  # rows sum to 1
        p = p * p.sum(dim=-2, keepdim=True).clamp_min(tiny).reciprocal()  # columns sum to 1
    return p.to(logits.dtype)
