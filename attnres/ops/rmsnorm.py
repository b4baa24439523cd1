"""RMSNorm computed exactly as Hugging Face Llama/Qwen compute it (METHOD.md section 1, notation).

    RMSNorm_g(u) = g * cast_back(u_fp32 * rsqrt(mean(u_fp32^2) + eps))

The cast back to the input dtype happens *before* the gain, in that order: converting a
pretrained model is exact only if the norm is computed exactly like this.
"""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None = None, eps: float = 1e-6) -> torch.Tensor:
    """Normalize ``x`` ``[..., D]`` over its last dim; ``weight`` ``[D]`` is the gain (or None)."""
    return rms_norm_forward(x, weight, eps)[0]


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor | None, eps: float, in_place: bool = False):
    """``(rms_norm(x, weight, eps), rr)`` with ``rr = rsqrt(mean(x^2) + eps)`` ``[..., 1]`` in fp32
    (fp64 for fp64 input), what ``rms_norm_backward`` needs besides ``x``.

    Without autograd (inference, and inside the ``autograd.Function``s) the normalized ``x``
    is written into the square's buffer and the gain applied in place: the same arithmetic with
    one ``[..., D]`` allocation instead of three (a fresh tensor costs more than the op here).
    ``in_place=True`` (for a temporary nobody else reads) normalizes in ``x``'s own buffer."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))  # fp32 (fp64 stays fp64)
    square = xf * xf
    rr = torch.rsqrt(square.mean(-1, keepdim=True) + eps)
    reuse = not _records_graph(x, weight)  # buffers may be written in place
    if reuse and in_place and xf is x:
        y = x.mul_(rr)
    elif reuse:
        y = torch.mul(xf, rr, out=square).to(x.dtype)
    else:
        y = (xf * rr).to(x.dtype)
    if weight is None:
        return y, rr
    if reuse and torch.promote_types(weight.dtype, y.dtype) == y.dtype:
        return y.mul_(weight), rr
    return weight * y, rr


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor | None, rr: torch.Tensor,
                      need_weight: bool = True):
    """``(dx, d_weight)`` for ``y = weight * cast(x * rr)``: ``dx = rr * (dxn - xn * mean(dxn * xn))``
    with ``xn = x * rr`` recomputed and ``dxn = dy * weight``; ``dx`` in ``rr``'s dtype.

    Without autograd recording (``create_graph``), both products that are only reduced go
    through one scratch buffer and ``dx`` is built in ``xn``'s: three ``[..., D]`` allocations
    instead of six, with the same roundings."""
    xn = x.to(rr.dtype) * rr
    dxn = (dy if weight is None else dy * weight).to(rr.dtype)
    scratch = None if _records_graph(dy, x, weight, rr) else torch.empty_like(xn)

    def reduced_product(a, b):  # a * b, only ever summed
        if scratch is not None and torch.promote_types(a.dtype, b.dtype) == scratch.dtype:
            return torch.mul(a, b, out=scratch)
        return a * b

    d_weight = None
    if weight is not None and need_weight:
        d_weight = reduced_product(dy, xn.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
    m = reduced_product(dxn, xn).mean(-1, keepdim=True)
    if scratch is None:
        return (dxn - xn * m).mul_(rr), d_weight
    # dxn - xn * m, built in xn's buffer: xn * (-m) + dxn rounds exactly as dxn - xn * m
    return xn.mul_(m.neg_()).add_(dxn).mul_(rr), d_weight


def _records_graph(*tensors) -> bool:
    """Whether autograd would record ops on these tensors (then no op may be in place)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class RMSNormFunction(torch.autograd.Function):
    """``rms_norm`` with a hand-written backward that keeps only ``x`` (which its producer keeps
    anyway: for a pre-norm, the residual state) and one inverse RMS per token; the normalized
    ``x`` that autograd would keep is recomputed. Forward computes exactly what ``rms_norm``
    computes, in the same order."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rr = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rr)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rr = ctx.saved_tensors
        dx, d_weight = rms_norm_backward(dy, x, weight, rr, ctx.needs_input_grad[1])
        return dx.to(x.dtype), d_weight, None


def rms_norm_project(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``rms_norm(x, eps=eps) @ weight``, ``[..., K] x [K, C] -> [..., C]``, computed as
    ``rr * (x @ weight)`` with ``rr = rsqrt(mean(x^2) + eps)`` per row: the normalized ``x`` is
    never formed, forward or backward (``RMSNormProjectFunction``). The multi-stream designs'
    coefficients (HC per stream, mHC over all streams) are this with ``C`` a few numbers, where
    forming ``rms_norm(x)`` costs several passes over ``[..., K]`` and the product one."""
    return RMSNormProjectFunction.apply(x, weight, eps)


class RMSNormProjectFunction(torch.autograd.Function):
    """``z = rr * (x @ W)`` in ``x``'s math dtype (fp32, fp64 for fp64), cast to ``W``'s
    promotion with it. Backward, with ``y = x @ W`` and ``K`` the row width::

        dx = rr * (dz @ W^T) - x * (rr^3 / K) * sum_c(dz * y)
        dW = x^T @ (rr * dz)

    It keeps ``x`` (the caller's state, kept anyway), ``rr`` ``[..., 1]`` and ``y`` ``[..., C]``.

    ``C`` is a few numbers (HC's ``n + 2``, mHC's ``2n + n^2``), and a CPU BLAS runs such skinny
    products at very different speeds by layout: ``x @ W`` is formed with ``W`` as the transposed
    view of a contiguous ``[C, K]`` copy (a few KiB) and ``dW`` as ``(dz^T @ x)^T``, the layouts
    that took 0.525 of the time at 4 columns and lost nothing at 20 and 24 (docs/BENCHMARKS.md,
    "Multi-stream ops", K2); the numbers differ only in rounding."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        dt = torch.promote_types(torch.promote_types(x.dtype, torch.float32), weight.dtype)
        xf, wf = x.to(dt), weight.to(dt)
        K = x.shape[-1]
        rr = torch.rsqrt(torch.linalg.vector_norm(xf, dim=-1, keepdim=True).square_().div_(K).add_(eps))
        # [..., K] folded to [rows, K] by hand: matmul does not fold an input that requires grad
        # against a transposed weight, and runs a batched product instead
        y = (xf.reshape(-1, K) @ wf.T.contiguous().T).reshape(*x.shape[:-1], wf.shape[-1])
        ctx.save_for_backward(x, weight, rr, y)
        return y * rr

    @staticmethod
    def backward(ctx, dz):
        x, weight, rr, y = ctx.saved_tensors
        dt, K = rr.dtype, x.shape[-1]
        xf, wf = x.to(dt), weight.to(dt)
        dzr = dz.to(dt) * rr  # [..., C]
        dx = dW = None
        if ctx.needs_input_grad[0]:
            coef = (dz.to(dt) * y).sum(-1, keepdim=True).mul_(rr.pow(3)).div_(-K)  # [..., 1]
            dx = (dzr @ wf.T).addcmul_(xf, coef).to(x.dtype)
        if ctx.needs_input_grad[1]:
            dW = (dzr.reshape(-1, dzr.shape[-1]).T @ xf.reshape(-1, K)).T.to(weight.dtype)
        return dx, dW, None


def rms(x: torch.Tensor) -> torch.Tensor:
    """Root mean square over the last dim, in fp32: ``[..., D] -> [...]``."""
    return x.to(torch.promote_types(x.dtype, torch.float32)).pow(2).mean(-1).sqrt()


class RMSNorm(nn.Module):
    """RMSNorm with a learned gain ``weight`` ``[D]`` (init 1): ``rms_norm`` as one autograd op
    (``RMSNormFunction``) that keeps less for backward."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return RMSNormFunction.apply(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
