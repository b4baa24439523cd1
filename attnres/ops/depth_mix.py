"""A read whose depth weights do not depend on the data: DenseFormer's weighted sum and Full
AttnRes's learned (static) mixing (docs/METHOD.md section 9).

Both mix a site's sources with one weight per source (per head slice with ``heads > 1``), the
same for every token, so there are no keys, no logits per token and nothing for a routing
backend to do: plain PyTorch ops on any device, which autograd differentiates as written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def weighted_depth_sum(weights: torch.Tensor, sources: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_j weights[j] * sources[j]``, accumulated left to right.

    Shapes: ``weights`` ``[N]`` or ``[N, H]`` (one weight per source and head slice: head ``h``
    scales dims ``[h D/H, (h+1) D/H)``), each source ``[..., D]``; the result ``[..., D]`` in the
    sources' dtype, computed in fp32 (fp64 for fp64 sources). Left to right, so that weights of
    1 give ``((e + v_0) + v_1) + ...``: PreNorm's running sum, bit for bit in fp32.
    """
    if len(sources) != weights.shape[0]:
        raise ValueError(f"weighted_depth_sum: {weights.shape[0]} weights for {len(sources)} sources")
    dtype = torch.promote_types(sources[0].dtype, torch.float32)
    dim = sources[0].shape[-1]
    w = weights.to(dtype)
    if w.ndim == 2:  # [N, H] -> [N, D]: each head's weight over its slice
        w = w.repeat_interleave(dim // w.shape[1], dim=1)
    else:
        w = w[:, None]
    out = sources[0].to(dtype) * w[0]
    for j in range(1, len(sources)):
        out = out + sources[j].to(dtype) * w[j]
    return out.to(sources[0].dtype)


def static_depth_weights(logits: torch.Tensor) -> torch.Tensor:
    """``alpha_j = softmax_j(l_j)`` of learned mixing: ``[N, H]`` logits -> ``[N, H]`` weights,
    in fp32 (fp64 for fp64 logits)."""
    return torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=0)
