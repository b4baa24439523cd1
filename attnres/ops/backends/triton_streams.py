"""The multi-stream designs' per-token work as Triton kernels (the ``triton`` backend's
``stream_mix``, ``stream_update``, ``gated_mix`` and ``sinkhorn``), forward and backward.

A program takes ``BLOCK_T`` tokens and all their streams: each of a token's ``n`` rows of
``D`` numbers is read once per kernel, and every sum over ``D`` (a weight's or a coefficient's
gradient) is formed from rows already loaded. Sinkhorn takes ``BLOCK_B`` matrices per program,
each ``n x n`` padded to a power of two; its backward runs the iterations again, writing each
half step's input and reciprocals to a scratch buffer (``[B, 2 x iterations, n, n]`` and
``[B, 2 x iterations, n]``, freed after the call), then reverses them as autograd differentiates
``ops.sinkhorn``. Math in fp32; results in the inputs' dtype (fp32, bf16 or fp16). With
``TRITON_INTERPRET=1`` the kernels run on CPU tensors (the tests).

Layouts: ``H``, ``out``, ``dH`` ``[T, n, D]``; ``w``, ``b`` ``[T, n]``; ``A`` ``[T, n, n]``;
``v``, ``y`` ``[T, D]``; all contiguous.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..sinkhorn import check_iterations

BLOCK_T = 16
BLOCK_B = 32


@triton.jit
def _token_block(T, D, BT: tl.constexpr, BD: tl.constexpr):
    """This program's ``BT`` tokens ``t`` and the ``BD`` columns ``d``, the tokens that exist
    (``tm``, ``[BT]``) and the entries that do (``mask``, ``[BT, BD]``)."""
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    d = tl.arange(0, BD)
    tm = t < T
    return t, d, tm, tm[:, None] & (d < D)[None, :]


@triton.jit
def _row(X, t, d, D, mask):
    """Each token's row ``[BT, BD]`` of ``X`` ``[T, D]``, in fp32 (0 outside)."""
    return tl.load(X + t[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _stream(X, t, k, d, N: tl.constexpr, D, mask):
    """Each token's stream ``k`` ``[BT, BD]`` of ``X`` ``[T, N, D]``, in fp32 (0 outside)."""
    return tl.load(X + (t[:, None] * N + k) * D + d[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _entry(X, t, k, N: tl.constexpr, tm):
    """Each token's number ``k`` ``[BT]`` of ``X`` ``[T, N]``, in fp32 (0 outside)."""
    return tl.load(X + t * N + k, mask=tm, other=0.0).to(tl.float32)


@triton.jit
def _mix_fwd(H, w, y, T, D, N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    t, d, tm, mask = _token_block(T, D, BT, BD)
    acc = tl.zeros([BT, BD], tl.float32)
    for k in tl.static_range(N):
        h = _stream(H, t, k, d, N, D, mask)
        a = _entry(w, t, k, N, tm)
        acc += a[:, None] * h
    tl.store(y + t[:, None] * D + d[None, :], acc.to(y.dtype.element_ty), mask=mask)


@triton.jit
def _mix_bwd(H, w, g, dH, dw, T, D, N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
             NEED_ROWS: tl.constexpr, NEED_WEIGHTS: tl.constexpr):
    t, d, tm, mask = _token_block(T, D, BT, BD)
    gt = _row(g, t, d, D, mask)
    for k in tl.static_range(N):
        if NEED_ROWS:
            a = _entry(w, t, k, N, tm)
            tl.store(dH + (t[:, None] * N + k) * D + d[None, :], (a[:, None] * gt).to(dH.dtype.element_ty), mask=mask)
        if NEED_WEIGHTS:
            h = _stream(H, t, k, d, N, D, mask)
            tl.store(dw + t * N + k, tl.sum(gt * h, axis=1).to(dw.dtype.element_ty), mask=tm)


@triton.jit
def _coef(A, t, tm, j, k, N: tl.constexpr, TRANS: tl.constexpr):
    """``A[t, j, k]`` of each token (``A`` stored as ``[T, k, j]`` when ``TRANS``)."""
    if TRANS:
        return tl.load(A + (t * N + k) * N + j, mask=tm, other=0.0).to(tl.float32)
    return tl.load(A + (t * N + j) * N + k, mask=tm, other=0.0).to(tl.float32)


@triton.jit
def _update_fwd(H, A, b, v, out, T, D, N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                HAS_A: tl.constexpr, TRANS: tl.constexpr):
    t, d, tm, mask = _token_block(T, D, BT, BD)
    vt = _row(v, t, d, D, mask)
    for j in tl.static_range(N):
        bj = _entry(b, t, j, N, tm)
        acc = bj[:, None] * vt
        if HAS_A:
            for k in tl.static_range(N):
                h = _stream(H, t, k, d, N, D, mask)
                acc += _coef(A, t, tm, j, k, N, TRANS)[:, None] * h
        else:
            acc += _stream(H, t, j, d, N, D, mask)
        tl.store(out + (t[:, None] * N + j) * D + d[None, :], acc.to(out.dtype.element_ty), mask=mask)


@triton.jit
def _update_bwd(H, A, b, v, g, dH, dA, db, dv, T, D, N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
                HAS_A: tl.constexpr, TRANS: tl.constexpr, NEED_H: tl.constexpr, NEED_A: tl.constexpr,
                NEED_B: tl.constexpr, NEED_V: tl.constexpr):
    t, d, tm, mask = _token_block(T, D, BT, BD)
    vt = _row(v, t, d, D, mask)
    dvt = tl.zeros([BT, BD], tl.float32)
    for j in tl.static_range(N):
        gj = _stream(g, t, j, d, N, D, mask)
        if NEED_B:
            tl.store(db + t * N + j, tl.sum(gj * vt, axis=1).to(db.dtype.element_ty), mask=tm)
        if NEED_V:
            dvt += _entry(b, t, j, N, tm)[:, None] * gj
        if NEED_A:
            for k in tl.static_range(N):
                h = _stream(H, t, k, d, N, D, mask)
                s = tl.sum(gj * h, axis=1).to(dA.dtype.element_ty)
                if TRANS:
                    tl.store(dA + (t * N + k) * N + j, s, mask=tm)
                else:
                    tl.store(dA + (t * N + j) * N + k, s, mask=tm)
    if NEED_V:
        tl.store(dv + t[:, None] * D + d[None, :], dvt.to(dv.dtype.element_ty), mask=mask)
    if NEED_H:
        for k in tl.static_range(N):
            if HAS_A:
                acc = tl.zeros([BT, BD], tl.float32)
                for j in tl.static_range(N):
                    gj = _stream(g, t, j, d, N, D, mask)
                    acc += _coef(A, t, tm, j, k, N, TRANS)[:, None] * gj
            else:
                acc = _stream(g, t, k, d, N, D, mask)
            tl.store(dH + (t[:, None] * N + k) * D + d[None, :], acc.to(dH.dtype.element_ty), mask=mask)


@triton.jit
def _gated_fwd(R, z, y, T, D, N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr):
    t, d, _, mask = _token_block(T, D, BT, BD)
    acc = tl.zeros([BT, BD], tl.float32)
    for k in tl.static_range(N):
        acc += tl.sigmoid(_stream(z, t, k, d, N, D, mask)) * _stream(R, t, k, d, N, D, mask)
    tl.store(y + t[:, None] * D + d[None, :], (acc / N).to(y.dtype.element_ty), mask=mask)


@triton.jit
def _gated_bwd(R, z, g, dR, dz, T, D, N: tl.constexpr, BT: tl.constexpr, BD: tl.constexpr,
               NEED_ROWS: tl.constexpr, NEED_WEIGHTS: tl.constexpr):
    t, d, _, mask = _token_block(T, D, BT, BD)
    gn = _row(g, t, d, D, mask) / N
    for k in tl.static_range(N):
        offs = (t[:, None] * N + k) * D + d[None, :]
        s = tl.sigmoid(_stream(z, t, k, d, N, D, mask))
        if NEED_ROWS:
            tl.store(dR + offs, (s * gn).to(dR.dtype.element_ty), mask=mask)
        if NEED_WEIGHTS:
            r = _stream(R, t, k, d, N, D, mask)
            tl.store(dz + offs, (gn * r * ((1.0 - s) * s)).to(dz.dtype.element_ty), mask=mask)


@triton.jit
def _normalize(p, COL: tl.constexpr):
    """One half step of ``[BB, BN, BN]`` matrices: rows (``COL`` 0) or columns scaled to sum 1;
    returns the result, the reciprocals and whether each sum was above the clamp."""
    tiny = 1.1754943508222875e-38  # torch.finfo(torch.float32).tiny
    s = tl.sum(p, axis=2 - COL)
    inv = 1.0 / tl.maximum(s, tiny)
    live = s >= tiny
    if COL:
        return p * inv[:, None, :], inv, live
    return p * inv[:, :, None], inv, live


@triton.jit
def _matrices(B, N, BB: tl.constexpr, BN: tl.constexpr):
    b = tl.program_id(0) * BB + tl.arange(0, BB)
    i = tl.arange(0, BN)
    offs = b[:, None, None] * N * N + i[None, :, None] * N + i[None, None, :]
    mask = (b < B)[:, None, None] & (i < N)[None, :, None] & (i < N)[None, None, :]
    return b, i, offs, mask


@triton.jit
def _sinkhorn_fwd(x, p_out, B, N, ITERS, BB: tl.constexpr, BN: tl.constexpr):
    b, i, offs, mask = _matrices(B, N, BB, BN)
    xb = tl.load(x + offs, mask=mask, other=float("-inf")).to(tl.float32)
    m = tl.max(tl.max(xb, axis=2), axis=1)
    p = tl.where(mask, tl.exp(xb - m[:, None, None]), 0.0)
    for _ in range(ITERS):
        p, inv, live = _normalize(p, 0)
        p, inv, live = _normalize(p, 1)
    tl.store(p_out + offs, p.to(p_out.dtype.element_ty), mask=mask)


@triton.jit
def _sinkhorn_bwd(x, gp, dx, ps, invs, B, N, ITERS, BB: tl.constexpr, BN: tl.constexpr):
    b, i, offs, mask = _matrices(B, N, BB, BN)
    bm = b < B
    line = b[:, None] * N + i[None, :]  # [BB, BN]: a line's index within its matrix
    lmask = bm[:, None] & (i < N)[None, :]
    xb = tl.load(x + offs, mask=mask, other=float("-inf")).to(tl.float32)
    m = tl.max(tl.max(xb, axis=2), axis=1)
    p0 = tl.where(mask, tl.exp(xb - m[:, None, None]), 0.0)
    p = p0
    steps = 2 * ITERS
    for s in range(steps):  # forward again, keeping each half step's input and reciprocals
        tl.store(ps + s * B * N * N + offs, p, mask=mask)
        if s % 2 == 0:
            p, inv, live = _normalize(p, 0)
        else:
            p, inv, live = _normalize(p, 1)
        tl.store(invs + s * B * N + line, tl.where(live, inv, 0.0), mask=lmask)
    dp = tl.load(gp + offs, mask=mask, other=0.0).to(tl.float32)
    for r in range(steps):
        s = steps - 1 - r
        p = tl.load(ps + s * B * N * N + offs, mask=mask, other=0.0)
        inv_live = tl.load(invs + s * B * N + line, mask=lmask, other=0.0)  # 0 where clamped
        if s % 2 == 0:
            inv = 1.0 / tl.maximum(tl.sum(p, axis=2), 1.1754943508222875e-38)
            dsum = -inv_live * inv_live * tl.sum(dp * p, axis=2)
            dp = dp * inv[:, :, None] + dsum[:, :, None]
        else:
            inv = 1.0 / tl.maximum(tl.sum(p, axis=1), 1.1754943508222875e-38)
            dsum = -inv_live * inv_live * tl.sum(dp * p, axis=1)
            dp = dp * inv[:, None, :] + dsum[:, None, :]
        dp = tl.where(mask, dp, 0.0)  # a padded entry's line sum must not reach it
    d = tl.where(mask, dp * p0, 0.0)
    total = tl.sum(tl.sum(d, axis=2), axis=1)
    at_max = mask & (xb == m[:, None, None])
    maxima = tl.sum(tl.sum(at_max.to(tl.float32), axis=2), axis=1)
    d = tl.where(at_max, d - (total / maxima)[:, None, None], d)
    tl.store(dx + offs, d.to(dx.dtype.element_ty), mask=mask)


def _grid(T: int, block: int):
    return (triton.cdiv(T, block),)


def _rows(H: torch.Tensor) -> torch.Tensor:
    n, D = H.shape[-2:]
    return H.reshape(-1, n, D).contiguous()


class TritonWeightedRows(torch.autograd.Function):
    """A read ``[..., D]`` of the streams ``H`` ``[..., n, D]`` with their per-token weights
    (``stream_mix``'s ``[..., n]``, or ``gated_mix``'s gate logits ``[..., n, D]``) on a pair of
    kernels ``(forward, backward)``; both inputs kept as contiguous rows."""

    @staticmethod
    def forward(ctx, H, weights, kernels):
        forward_kernel, ctx.backward_kernel = kernels
        rows = _rows(H)
        T, n, D = rows.shape
        ctx.shapes = H.shape, weights.shape
        weights = weights.reshape(T, *weights.shape[H.dim() - 2:]).contiguous()
        y = torch.empty(T, D, dtype=H.dtype, device=H.device)
        forward_kernel[_grid(T, BLOCK_T)](rows, weights, y, T, D, N=n, BT=BLOCK_T, BD=triton.next_power_of_2(D))
        ctx.save_for_backward(rows, weights)
        return y.view(*H.shape[:-2], D)

    @staticmethod
    def backward(ctx, g):
        rows, weights = ctx.saved_tensors
        T, n, D = rows.shape
        need_rows, need_weights, _ = ctx.needs_input_grad
        d_rows = torch.empty_like(rows) if need_rows else None
        d_weights = torch.empty_like(weights) if need_weights else None
        ctx.backward_kernel[_grid(T, BLOCK_T)](rows, weights, g.reshape(T, D).contiguous(), d_rows, d_weights, T, D,
                                               N=n, BT=BLOCK_T, BD=triton.next_power_of_2(D), NEED_ROWS=need_rows,
                                               NEED_WEIGHTS=need_weights)
        d_rows, d_weights = (None if d is None else d.view(shape) for d, shape in zip((d_rows, d_weights), ctx.shapes))
        return d_rows, d_weights, None


class TritonStreamUpdate(torch.autograd.Function):
    @staticmethod
    def forward(ctx, H, A, b, v, transposed):
        rows = _rows(H)
        T, n, D = rows.shape
        ctx.transposed, ctx.shapes = bool(transposed), (H.shape, b.shape, v.shape)
        A = None if A is None else A.reshape(T, n, n).contiguous()
        b, v = b.reshape(T, n).contiguous(), v.reshape(T, D).contiguous()
        out = torch.empty_like(rows)
        _update_fwd[_grid(T, BLOCK_T)](rows, A if A is not None else b, b, v, out, T, D, N=n, BT=BLOCK_T,
                                       BD=triton.next_power_of_2(D), HAS_A=A is not None, TRANS=bool(transposed))
        ctx.save_for_backward(rows, A, b, v)
        return out.view(H.shape[:-2] + (n, D))

    @staticmethod
    def backward(ctx, g):
        rows, A, b, v = ctx.saved_tensors
        T, n, D = rows.shape
        need_h, need_a, need_b, need_v, _ = ctx.needs_input_grad
        need_a = need_a and A is not None
        dH = torch.empty_like(rows) if need_h else None
        dA = torch.empty_like(A) if need_a else None
        db = torch.empty_like(b) if need_b else None
        dv = torch.empty_like(v) if need_v else None
        _update_bwd[_grid(T, BLOCK_T)](rows, A if A is not None else b, b, v, g.reshape(T, n, D).contiguous(),
                                       dH, dA, db, dv, T, D, N=n, BT=BLOCK_T, BD=triton.next_power_of_2(D),
                                       HAS_A=A is not None, TRANS=ctx.transposed, NEED_H=need_h, NEED_A=need_a,
                                       NEED_B=need_b, NEED_V=need_v)
        h_shape, b_shape, v_shape = ctx.shapes
        lead = h_shape[:-2]
        return (dH.view(h_shape) if need_h else None, dA.view(*lead, n, n) if need_a else None,
                db.view(b_shape) if need_b else None, dv.view(v_shape) if need_v else None, None)


class TritonSinkhorn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, iterations):
        n = x.shape[-1]
        flat = x.reshape(-1, n, n).contiguous()
        B = flat.shape[0]
        p = torch.empty_like(flat)
        _sinkhorn_fwd[_grid(B, BLOCK_B)](flat, p, B, n, iterations, BB=BLOCK_B, BN=triton.next_power_of_2(n))
        ctx.save_for_backward(flat)
        ctx.iterations, ctx.shape = iterations, x.shape
        return p.view(x.shape)

    @staticmethod
    def backward(ctx, g):
        flat, = ctx.saved_tensors
        B, n, _ = flat.shape
        steps = 2 * ctx.iterations
        ps = torch.empty(steps, B, n, n, dtype=torch.float32, device=flat.device)
        invs = torch.empty(steps, B, n, dtype=torch.float32, device=flat.device)
        dx = torch.empty_like(flat)
        _sinkhorn_bwd[_grid(B, BLOCK_B)](flat, g.reshape(B, n, n).contiguous(), dx, ps, invs, B, n, ctx.iterations,
                                         BB=BLOCK_B, BN=triton.next_power_of_2(n))
        return dx.view(ctx.shape), None


def stream_mix(H: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return TritonWeightedRows.apply(H, w.to(H.dtype), (_mix_fwd, _mix_bwd))


def stream_update(H: torch.Tensor, A: torch.Tensor | None, b: torch.Tensor, v: torch.Tensor,
                  transposed: bool = False) -> torch.Tensor:
    A = None if A is None else A.to(H.dtype)
    return TritonStreamUpdate.apply(H, A, b.to(H.dtype), v.to(H.dtype), transposed)


def gated_mix(R: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    return TritonWeightedRows.apply(R, z.to(R.dtype), (_gated_fwd, _gated_bwd))


def sinkhorn(logits: torch.Tensor, iterations: int) -> torch.Tensor:
    check_iterations(iterations)
    return TritonSinkhorn.apply(logits.float(), iterations).to(logits.dtype)
