"""The multi-stream designs' per-token work on the CPU kernels (``csrc/multi_stream_cpu.cpp``):
the mix of a read (weighted, or gated elementwise as GR's), the update of a write,
Sinkhorn-Knopp and GR's per-branch RMSNorm, each forward and backward one pass over the tokens
(or the matrices).

Each is an autograd function keeping its inputs and little else: the mix and the update form
their gradients from ``H``, the weights and ``v``; the gated mix keeps ``R`` and the gates'
logits (or GR's low-rank layer and ``U^T``) and forms the gates again, the RMSNorm one inverse
RMS per row; Sinkhorn's backward runs the iterations again per chunk of matrices from the
logits and then reverses them, so it keeps neither the ``2 x iterations`` intermediate
matrices autograd would keep nor anything beyond the logits.
A pointer handed to a kernel is always that of a tensor held in a local name.

``H`` ``[..., n, D]`` is read in place when its rows are contiguous and its leading dims fold
into one token stride (the embedding broadcast to every stream, ``e[..., None, :].expand``, is
read without a copy); anything else is made contiguous first. fp32 or fp64; the other arguments
in ``H``'s dtype.
"""

from __future__ import annotations

import ctypes

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..sinkhorn import check_iterations
from .cpu_build import load_library

_I64, _PTR, _I32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32
_SIGNATURES = {
    "stream_mix_forward": [_I64] * 3 + [_PTR, _I64, _I64, _PTR, _PTR, _I32],
    "stream_mix_backward": [_I64] * 3 + [_PTR, _I64, _I64] + [_PTR] * 4 + [_I32],
    "stream_update_forward": [_I64] * 3 + [_PTR, _I64, _I64, _PTR, _I32] + [_PTR] * 3 + [_I32],
    "stream_update_backward": [_I64] * 3 + [_PTR, _I64, _I64, _PTR, _I32] + [_PTR] * 7 + [_I32],
    "gated_mix_forward": [_I64] * 3 + [_PTR] * 3 + [_I32],
    "gated_mix_backward": [_I64] * 3 + [_PTR] * 5 + [_I32],
    "gated_lowrank_forward": [_I64] * 4 + [_PTR] * 4 + [_I32],
    "gated_lowrank_backward": [_I64] * 4 + [_PTR] * 7 + [_I32],
    "rms_norm_forward": [_I64] * 2 + [_PTR] * 2 + [ctypes.c_double] + [_PTR] * 2 + [_I32],
    "rms_norm_backward": [_I64] * 2 + [_PTR] * 6 + [_I32],
    "sinkhorn_forward": [_I64] * 3 + [_PTR, _PTR, _I32],
    "sinkhorn_backward": [_I64] * 3 + [_PTR] * 3 + [_I32],
}
_kernels: dict[tuple[str, torch.dtype], object] = {}


def _kernel(name: str, dtype: torch.dtype):
    fn = _kernels.get((name, dtype))
    if fn is None:
        fn = getattr(load_library(), f"attnres_{name}_{'f32' if dtype == torch.float32 else 'f64'}")
        fn.argtypes, fn.restype = _SIGNATURES[name], None
        _kernels[(name, dtype)] = fn
    return fn


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _streams(H: Tensor) -> tuple[Tensor, int, int]:
    """``H`` ``[..., n, D]`` as ``[T, n, D]`` rows and its token and stream strides."""
    n, D = H.shape[-2:]
    rows = H.reshape(-1, n, D)
    if rows.stride(-1) != 1 or (n > 1 and rows.stride(1) not in (0, D)):
        rows = rows.contiguous()
    return rows, rows.stride(0), rows.stride(1) if n > 1 else D


def _threads() -> int:
    return torch.get_num_threads()


class StreamMixFunction(torch.autograd.Function):
    """``y = sum_k w[..., k] H[..., k, :]`` ``[..., D]``."""

    @staticmethod
    def forward(ctx, H, w):
        rows, ts, ks = _streams(H)
        T, n, D = rows.shape
        w = w.contiguous()
        y = torch.empty(H.shape[:-2] + H.shape[-1:], dtype=H.dtype)
        _kernel("stream_mix_forward", H.dtype)(T, n, D, _ptr(rows), ts, ks, _ptr(w), _ptr(y), _threads())
        ctx.save_for_backward(H, w)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        H, w = ctx.saved_tensors
        rows, ts, ks = _streams(H)
        T, n, D = rows.shape
        g = g.contiguous()
        dH = torch.empty(H.shape, dtype=H.dtype) if ctx.needs_input_grad[0] else None
        dw = torch.empty(w.shape, dtype=w.dtype) if ctx.needs_input_grad[1] else None
        _kernel("stream_mix_backward", H.dtype)(T, n, D, _ptr(rows), ts, ks, _ptr(w), _ptr(g), _ptr(dH), _ptr(dw),
                                                _threads())
        return dH, dw


class StreamUpdateFunction(torch.autograd.Function):
    """``H'[..., j, :] = sum_k A[..., j, k] H[..., k, :] + b[..., j] v`` ``[..., n, D]``."""

    @staticmethod
    def forward(ctx, H, A, b, v, transposed):
        rows, ts, ks = _streams(H)
        T, n, D = rows.shape
        A = None if A is None else A.contiguous()
        b, v = b.contiguous(), v.contiguous()
        out = torch.empty(H.shape[:-2] + (n, D), dtype=H.dtype)
        _kernel("stream_update_forward", H.dtype)(T, n, D, _ptr(rows), ts, ks, _ptr(A), int(transposed), _ptr(b),
                                                  _ptr(v), _ptr(out), _threads())
        ctx.save_for_backward(H, A, b, v)
        ctx.transposed = transposed
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        H, A, b, v = ctx.saved_tensors
        rows, ts, ks = _streams(H)
        T, n, D = rows.shape
        g = g.contiguous()
        need = ctx.needs_input_grad
        dH = torch.empty(H.shape, dtype=H.dtype) if need[0] else None
        dA = torch.empty(A.shape, dtype=A.dtype) if need[1] and A is not None else None
        db = torch.empty(b.shape, dtype=b.dtype) if need[2] else None
        dv = torch.empty(v.shape, dtype=v.dtype) if need[3] else None
        _kernel("stream_update_backward", H.dtype)(T, n, D, _ptr(rows), ts, ks, _ptr(A), int(ctx.transposed),
                                                   _ptr(b), _ptr(v), _ptr(g), _ptr(dH), _ptr(dA), _ptr(db), _ptr(dv),
                                                   _threads())
        return dH, dA, db, dv, None


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
        n, D = R.shape[-2:]
        R, z = R.contiguous(), z.to(R.dtype).contiguous()  # the kernel reads both through one pointer type
        y = torch.empty(R.shape[:-2] + (D,), dtype=R.dtype)
        _kernel("gated_mix_forward", R.dtype)(R.numel() // (n * D), n, D, _ptr(R), _ptr(z), _ptr(y), _threads())
        ctx.save_for_backward(R, z)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        R, z = ctx.saved_tensors
        n, D = R.shape[-2:]
        g = g.contiguous()  # held here: a temporary's memory would be freed before the kernel reads it
        dR = torch.empty_like(R) if ctx.needs_input_grad[0] else None
        dz = torch.empty_like(z) if ctx.needs_input_grad[1] else None
        _kernel("gated_mix_backward", R.dtype)(R.numel() // (n * D), n, D, _ptr(R), _ptr(z), _ptr(g),
                                               _ptr(dR), _ptr(dz), _threads())
        return dR, dz


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
    Keeps ``R``, ``h`` and ``U^T`` (padded with zero columns to whole 64-byte vectors, the
    kernel's unit)."""

    @staticmethod
    def forward(ctx, R, h, up):
        if h.dtype != R.dtype or up.dtype != R.dtype:  # the kernel reads all three through one pointer type
            raise TypeError(f"gated_mix_lowrank takes R, h and up of one dtype, given {R.dtype}, {h.dtype} "
                            f"and {up.dtype}")
        n, D = R.shape[-2:]
        m, r = n * D, h.shape[-1]
        if h.shape[:-1] != R.shape[:-2] or up.shape != (m, r) or r < 1:
            raise ValueError(f"gated_mix_lowrank takes R [..., n, D], h [..., r] (R's leading dims, r >= 1) and up "
                             f"[n D, r], given R {tuple(R.shape)}, h {tuple(h.shape)}, up {tuple(up.shape)}")
        lanes = 64 // R.element_size()
        upT = up.new_zeros(r, -(-m // lanes) * lanes)  # U^T [r, mp]
        upT[:, :m] = up.t()
        R, h = R.contiguous(), h.contiguous()
        y = torch.empty(R.shape[:-2] + (D,), dtype=R.dtype)
        _kernel("gated_lowrank_forward", R.dtype)(R.numel() // m, n, D, r, _ptr(R), _ptr(h), _ptr(upT), _ptr(y),
                                                  _threads())
        ctx.save_for_backward(R, h, upT)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        R, h, upT = ctx.saved_tensors
        n, D = R.shape[-2:]
        m, (r, mp) = n * D, upT.shape
        g = g.contiguous()  # held here: a temporary's memory would be freed before the kernel reads it
        threads = _threads()
        dR = torch.empty_like(R) if ctx.needs_input_grad[0] else None
        dh = torch.empty_like(h) if ctx.needs_input_grad[1] else None
        d_upT = torch.zeros(threads, r, mp, dtype=R.dtype) if ctx.needs_input_grad[2] else None
        _kernel("gated_lowrank_backward", R.dtype)(R.numel() // m, n, D, r, _ptr(R), _ptr(h), _ptr(upT), _ptr(g),
                                                   _ptr(dR), _ptr(dh), _ptr(d_upT), threads)
        return dR, dh, None if d_upT is None else d_upT.sum(0)[:, :m].t()


class RMSNormRowsFunction(torch.autograd.Function):
    """``ops.rms_norm`` of rows ``x`` ``[..., D]`` with the gain ``weight`` ``[D]``, one pass over
    ``x`` per direction where PyTorch's ops make several over ``[..., D]`` memory (GR normalizes
    every branch, ``[..., n, D]``, at every site). Keeps ``x`` and one inverse RMS per row."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x, weight = x.contiguous(), weight.contiguous()
        D = x.shape[-1]
        y = torch.empty_like(x)
        rr = torch.empty(x.shape[:-1], dtype=x.dtype)
        _kernel("rms_norm_forward", x.dtype)(x.numel() // D, D, _ptr(x), _ptr(weight), float(eps), _ptr(y), _ptr(rr),
                                             _threads())
        ctx.save_for_backward(x, weight, rr)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, weight, rr = ctx.saved_tensors
        D = x.shape[-1]
        g = g.contiguous()  # held here: a temporary's memory would be freed before the kernel reads it
        dx = torch.empty_like(x) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(weight) if ctx.needs_input_grad[1] else None
        _kernel("rms_norm_backward", x.dtype)(x.numel() // D, D, _ptr(x), _ptr(weight), _ptr(rr), _ptr(g),
                                              _ptr(dx), _ptr(dw), _threads())
        return dx, dw, None


class SinkhornFunction(torch.autograd.Function):
    """``ops.sinkhorn`` of fp32 or fp64 logits ``[..., n, n]``, in their dtype."""

    @staticmethod
    def forward(ctx, x, iterations):
        x = x.contiguous()
        n = x.shape[-1]
        p = torch.empty_like(x)
        _kernel("sinkhorn_forward", x.dtype)(x.numel() // (n * n), n, iterations, _ptr(x), _ptr(p), _threads())
        ctx.save_for_backward(x)
        ctx.iterations = iterations
        return p

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        x, = ctx.saved_tensors
        n = x.shape[-1]
        g = g.contiguous()  # held here: a temporary's memory would be freed before the kernel reads it
        dx = torch.empty_like(x)
        _kernel("sinkhorn_backward", x.dtype)(x.numel() // (n * n), n, ctx.iterations, _ptr(x),
                                              _ptr(g), _ptr(dx), _threads())
        return dx, None


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
