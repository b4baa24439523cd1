"""The multi-stream designs' per-token work on the CPU kernels (``csrc/multi_stream_cpu.cpp``,
through their operators ``attnres::cpu_stream_mix`` and the others, ``cpu_ops``): the mix of a
read (weighted, or gated elementwise as GR's), the update of a write, Sinkhorn-Knopp and GR's
per-branch RMSNorm, each forward and backward one pass over the tokens (or the matrices).

Each is an autograd function keeping its inputs and little else: the mix and the update form
their gradients from ``H``, the weights and ``v``; the gated mix keeps ``R`` and the gates'
logits (or GR's low-rank layer and ``U``) and forms the gates again, the RMSNorm one inverse
RMS per row; Sinkhorn's backward runs the iterations again per chunk of matrices from the
logits and then reverses them, so it keeps neither the ``2 x iterations`` intermediate
matrices autograd would keep nor anything beyond the logits. A backward operator returns an
empty tensor for a gradient not asked for.

``H`` ``[..., n, D]`` is read in place when its rows are contiguous and its leading dims fold
into one token stride (the embedding broadcast to every stream, ``e[..., None, :].expand``, is
read without a copy); anything else is made contiguous first. fp32 or fp64; the other arguments
in ``H``'s dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..sinkhorn import check_iterations
from .cpu_ops import kernels, none_if_empty


def _grads(ctx, backward, *args) -> tuple:
    """``backward(*args, *ctx.needs_input_grad)``, a backward operator's gradients, None where
    one was not asked for."""
    return tuple(none_if_empty(d) for d in backward(*args, *ctx.needs_input_grad))


class StreamMixFunction(torch.autograd.Function):
    """``y = sum_k w[..., k] H[..., k, :]`` ``[..., D]``."""

    @staticmethod
    def forward(ctx, H, w):
        ctx.save_for_backward(H, w)
        return kernels().cpu_stream_mix(H, w)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return _grads(ctx, kernels().cpu_stream_mix_backward, *ctx.saved_tensors, g)


class StreamUpdateFunction(torch.autograd.Function):
    """``H'[..., j, :] = sum_k A[..., j, k] H[..., k, :] + b[..., j] v`` ``[..., n, D]``."""

    @staticmethod
    def forward(ctx, H, A, b, v, transposed):
        ctx.save_for_backward(H, A, b, v)
        ctx.transposed = transposed
        return kernels().cpu_stream_update(H, A, b, v, transposed)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        H, A, b, v = ctx.saved_tensors
        needs = ctx.needs_input_grad[:4]
        return (*(none_if_empty(d) for d in kernels().cpu_stream_update_backward(H, A, b, v, ctx.transposed, g,
                                                                                 *needs)), None)


class GatedMixFunction(torch.autograd.Function):
    """``y = mean_k(sigmoid(z[..., k, :]) * R[..., k, :])`` ``[..., D]`` (GR's read). The kernel
    forms the gates ``sigmoid(z)`` token by token with a vectorized exponential, in forward and
    again in backward, so that only ``R`` and ``z`` are kept and the gates never pass through
    memory."""

    @staticmethod
    def forward(ctx, R, z):
        if z.shape != R.shape:
            raise ValueError(f"gated_mix takes logits z of R's shape [..., n, D], given z {tuple(z.shape)} for R "
                             f"{tuple(R.shape)}")
        ctx.save_for_backward(R, z)
        return kernels().cpu_gated_mix(R, z)  # z read in R's dtype

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return _grads(ctx, kernels().cpu_gated_mix_backward, *ctx.saved_tensors, g)


#: the largest up-projection (bytes) ``gated_mix_lowrank`` forms the logits from in its kernel: the
#: kernel reads all of ``U^T`` once per block of 4 tokens, from the core's caches; past this the
#: BLAS product then ``gated_mix`` is faster (``benchmarks/gated_lowrank.py``, docs/BENCHMARKS.md "Tuning
#: choices in the code")
LOWRANK_KERNEL_BYTES = 128 * 1024


class GatedMixLowRankFunction(torch.autograd.Function):
    """``gated_mix(R, z)`` with ``z = (h @ U^T)`` ``[..., n, D]`` formed in the kernel, a block of 4
    tokens at a time, from GR's low-rank hidden layer ``h`` ``[..., r]`` and its up-projection ``U``
    ``[n D, r]``: the logits and the gates never pass through memory, and backward forms
    ``dh = dz U`` and ``dU = dz^T h`` in the same pass instead of two products over ``[tokens, n D]``.
    Keeps ``R``, ``h`` and ``U`` (the operators read ``U^T`` padded with zero columns to whole
    vectors, the kernel's unit of 64 bytes with AVX-512 and 32 with AVX2, formed in each
    direction)."""

    @staticmethod
    def forward(ctx, R, h, up):
        if h.dtype != R.dtype or up.dtype != R.dtype:  # the kernel reads all three through one pointer type
            raise TypeError(f"gated_mix_lowrank takes R, h and up of one dtype, given {R.dtype}, {h.dtype} "
                            f"and {up.dtype}")
        n, D = R.shape[-2:]
        if h.shape[:-1] != R.shape[:-2] or up.shape != (n * D, h.shape[-1]) or h.shape[-1] < 1:
            raise ValueError(f"gated_mix_lowrank takes R [..., n, D], h [..., r] (R's leading dims, r >= 1) and up "
                             f"[n D, r], given R {tuple(R.shape)}, h {tuple(h.shape)}, up {tuple(up.shape)}")
        ctx.save_for_backward(R, h, up)
        return kernels().cpu_gated_mix_lowrank(R, h, up)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        return _grads(ctx, kernels().cpu_gated_mix_lowrank_backward, *ctx.saved_tensors, g)


class RMSNormRowsFunction(torch.autograd.Function):
    """``ops.rms_norm`` of rows ``x`` ``[..., D]`` with the gain ``weight`` ``[D]``, one pass over
    ``x`` per direction where PyTorch's ops make several over ``[..., D]`` memory (GR normalizes
    every branch, ``[..., n, D]``, at every site). Keeps ``x`` and one inverse RMS per row."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rr = kernels().cpu_rms_norm(x, weight, float(eps))
        ctx.save_for_backward(x, weight, rr)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, weight, rr = ctx.saved_tensors
        dx, dw = (none_if_empty(d) for d in kernels().cpu_rms_norm_backward(x, weight, rr, g,
                                                                           *ctx.needs_input_grad[:2]))
        return dx, dw, None


class SinkhornFunction(torch.autograd.Function):
    """``ops.sinkhorn`` of fp32 or fp64 logits ``[..., n, n]``, in their dtype."""

    @staticmethod
    def forward(ctx, x, iterations):
        ctx.save_for_backward(x)
        ctx.iterations = iterations
        return kernels().cpu_sinkhorn(x, iterations)

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, = ctx.saved_tensors
        return kernels().cpu_sinkhorn_backward(x, g, ctx.iterations), None


def stream_mix(H: Tensor, w: Tensor) -> Tensor:
    return StreamMixFunction.apply(H, w)


def stream_update(H: Tensor, A: Tensor | None, b: Tensor, v: Tensor, transposed: bool = False) -> Tensor:
    return StreamUpdateFunction.apply(H, A, b, v, transposed)


def gated_mix(R: Tensor, z: Tensor) -> Tensor:
    return GatedMixFunction.apply(R, z)


def gated_mix_lowrank(R: Tensor, h: Tensor, up: Tensor) -> Tensor:
    return GatedMixLowRankFunction.apply(R, h, up)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return RMSNormRowsFunction.apply(x, weight.to(x.dtype), eps)


def sinkhorn(logits: Tensor, iterations: int) -> Tensor:
    check_iterations(iterations)
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return SinkhornFunction.apply(x, iterations).to(logits.dtype)
