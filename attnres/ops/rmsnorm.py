"""RMSNorm computed exactly as Hugging Face Llama/Qwen compute it (SPEC "Notation").

    RMSNorm_g(u) = g * cast_back(u_fp32 * rsqrt(mean(u_fp32^2) + eps))

The cast back to the input dtype happens *before* the gain, in that order: converting a
pretrained model is exact only if the norm is computed exactly like this.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Normalize ``x`` ``[..., D]`` over its last dim; ``weight`` ``[D]`` is the gain (or None)."""
    dtype = x.dtype
    xf = x.to(torch.promote_types(dtype, torch.float32))  # fp32 (fp64 stays fp64)
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)
    return y if weight is None else weight * y


def rms(x: torch.Tensor) -> torch.Tensor:
    """Root mean square over the last dim, in fp32: ``[..., D] -> [...]``."""
    return x.to(torch.promote_types(x.dtype, torch.float32)).pow(2).mean(-1).sqrt()


class RMSNorm(nn.Module):
    """RMSNorm with a learned gain ``weight`` ``[D]`` (init 1)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
