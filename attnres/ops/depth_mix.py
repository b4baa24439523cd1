"""A read whose depth weights do not depend on the data: DenseFormer's weighted sum and Full
AttnRes's learned (static) mixing (docs/METHOD.md section 9).

Both mix a site's sources with one weight per source (per head slice with ``heads > 1``), the
same for every token, so there are no keys, no logits per token and nothing for a routing
backend to do: plain PyTorch ops on any device, which autograd differentiates as written.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.function import once_differentiable


def weighted_depth_sum(weights: torch.Tensor, sources: Sequence[torch.Tensor]) -> torch.Tensor:
    """``sum_j weights[j] * sources[j]``, accumulated left to right.

    Shapes: ``weights`` ``[N]`` or ``[N, H]`` (one weight per source and head slice: head ``h``
    scales dims ``[h D/H, (h+1) D/H)``), each source ``[..., D]``; the result ``[..., D]`` in the
    sources' dtype, computed in fp32 (fp64 for fp64 sources). Left to right, so that weights of
    1 give ``((e + v_0) + v_1) + ...``: PreNorm's running sum, bit for bit in fp32.

    Gradients: ``dL/dv_j = weights[j] * g`` and ``dL/dweights[j] = sum <g, v_j>`` (over the
    tokens, and over each head's slice for ``[N, H]``), with ``g = dL/dout`` in the compute
    dtype. Backward keeps only the sources themselves, which the stream holds anyway: a read of
    ``N`` bf16 sources allocates no fp32 copies that live until backward (autograd through the
    casts would save one per source and read, ``O(M^2)`` over a model's ``M`` reads).
    """
    if len(sources) != weights.shape[0]:
        raise ValueError(f"weighted_depth_sum: {weights.shape[0]} weights for {len(sources)} sources")
    return _WeightedDepthSum.apply(weights, *sources)


def _compute_dtype(source: torch.Tensor) -> torch.dtype:
    return torch.promote_types(source.dtype, torch.float32)


def _per_dim(weights: torch.Tensor, dim: int, dtype: torch.dtype) -> torch.Tensor:
    """``[N]`` -> ``[N, 1]``, ``[N, H]`` -> ``[N, D]`` (each head's weight over its slice)."""
    w = weights.to(dtype)
    return w.repeat_interleave(dim // w.shape[1], dim=1) if w.ndim == 2 else w[:, None]


class _WeightedDepthSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, weights, *sources):
        dtype = _compute_dtype(sources[0])
        w = _per_dim(weights, sources[0].shape[-1], dtype)
        out = sources[0].to(dtype) * w[0]
        for j in range(1, len(sources)):
            out = out + sources[j].to(dtype) * w[j]
        ctx.save_for_backward(weights, *sources)
        return out.to(sources[0].dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_out):
        weights, *sources = ctx.saved_tensors
        dtype = _compute_dtype(sources[0])
        dim = sources[0].shape[-1]
        g = grad_out.to(dtype)
        w = _per_dim(weights, dim, dtype)
        grad_sources = [(g * w[j]).to(v.dtype) if ctx.needs_input_grad[1 + j] else None
                        for j, v in enumerate(sources)]
        grad_weights = None
        if ctx.needs_input_grad[0]:
            heads = weights.shape[1] if weights.ndim == 2 else 1
            # per source: <g, v_j> over the tokens, each head's slice apart
            rows = [(g * v.to(dtype)).reshape(-1, heads, dim // heads).sum(dim=(0, 2)) for v in sources]
            grad_weights = torch.stack(rows).reshape(weights.shape).to(weights.dtype)
        return grad_weights, *grad_sources


def static_depth_weights(logits: torch.Tensor) -> torch.Tensor:
    """``alpha_j = softmax_j(l_j)`` of learned mixing: ``[N, H]`` logits -> ``[N, H]`` weights,
    in fp32 (fp64 for fp64 logits)."""
    return torch.softmax(logits.to(torch.promote_types(logits.dtype, torch.float32)), dim=0)
