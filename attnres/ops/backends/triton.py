"""Fused Triton kernels for depth attention (the ``triton`` backend).

Two kernel pairs, forward and backward, each multi-head aware:

- ``depth_attention``: ``S`` queries against a list of sources (an ordinary read is ``S = 1``;
  phase 1 of the two-phase Block computation is all queries of a block). The sources are never
  stacked: the kernel reads them through a table of pointers, one online-softmax sweep in
  forward (each source read once), one sweep in backward.
- ``merge``: phase 2, the exact merge of one partial source into phase 1's result.

The key-norm gain is folded into the query before the call (``qg = w * k``), so the kernels see
one ``[S, D]`` query matrix and PyTorch's autograd handles the fold. Both pairs are registered as
``torch.library`` custom ops (``attnres::...``) with autograd and fake (meta) implementations, so
they compose with ``torch.compile``. With ``TRITON_INTERPRET=1`` they run on CPU tensors.

Shapes: sources ``N x [T, D]`` (flattened tokens), ``qg`` ``[S, D]``, ``out`` ``[S, T, D]``,
``lse`` ``[S, T, H]`` (fp32).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..rmsnorm import RMSNormFunction
from . import triton_streams
from .naive import KernelStreamOps

_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@triton.jit
def _source_ptr(table, j, DT: tl.constexpr):
    raw = tl.load(table + j)
    if DT == 1:
        return raw.to(tl.pointer_type(tl.bfloat16))
    elif DT == 2:
        return raw.to(tl.pointer_type(tl.float16))
    else:
        return raw.to(tl.pointer_type(tl.float32))


@triton.jit
def _per_head(x, head, H: tl.constexpr):
    """Sum ``x`` ``[BT, BD]`` over each head's slice and broadcast it back over the slice."""
    out = tl.zeros_like(x)
    for h in tl.static_range(H):
        in_h = (head == h)[None, :]
        out = tl.where(in_h, tl.sum(tl.where(in_h, x, 0.0), axis=1)[:, None], out)
    return out


@triton.jit
def _fwd_kernel(table, n_src, qg, out, lse, T, D, eps,
                H: tl.constexpr, DH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                DT: tl.constexpr):
    pid_t, s = tl.program_id(0), tl.program_id(1)
    t = pid_t * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    tm, dm = t < T, d < D
    mask = tm[:, None] & dm[None, :]
    head = d // DH
    q = tl.load(qg + s * D + d, mask=dm, other=0.0)
    m = tl.full([BLOCK_T, BLOCK_D], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    acc = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
    for j in range(n_src):
        v = tl.load(_source_ptr(table, j, DT) + t[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
        logit = _per_head(v * q[None, :], head, H) * r[:, None]
        m_new = tl.maximum(m, logit)
        alpha = tl.exp(m - m_new)
        p = tl.exp(logit - m_new)
        l = l * alpha + p
        acc = acc * alpha + p * v
        m = m_new
    tl.store(out + s * T * D + t[:, None] * D + d[None, :], acc / l, mask=mask)
    first = dm & (d % DH == 0)
    tl.store(lse + s * T * H + t[:, None] * H + head[None, :], m + tl.log(l), mask=tm[:, None] & first[None, :])


@triton.jit
def _bwd_kernel(table, grad_table, n_src, n_q, qg, out, lse, g_out, g_lse, dq_part, T, D, eps,
                H: tl.constexpr, DH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
                DT: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    tm, dm = t < T, d < D
    mask = tm[:, None] & dm[None, :]
    head = d // DH
    for j in range(n_src):
        v = tl.load(_source_ptr(table, j, DT) + t[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
        r = 1.0 / tl.sqrt(tl.sum(v * v, axis=1) / D + eps)
        dv = tl.zeros([BLOCK_T, BLOCK_D], tl.float32)
        coef = tl.zeros([BLOCK_T], tl.float32)
        for s in range(n_q):
            q = tl.load(qg + s * D + d, mask=dm, other=0.0)
            o = tl.load(out + s * T * D + t[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
            g = tl.load(g_out + s * T * D + t[:, None] * D + d[None, :], mask=mask, other=0.0)
            hmask = mask & (head < H)[None, :]
            lse_s = tl.load(lse + s * T * H + t[:, None] * H + head[None, :], mask=hmask, other=0.0)
            glse_s = tl.load(g_lse + s * T * H + t[:, None] * H + head[None, :], mask=hmask, other=0.0)
            logit = _per_head(v * q[None, :], head, H) * r[:, None]
            p = tl.where(mask, tl.exp(logit - lse_s), 0.0)
            ds = p * (_per_head(g * v, head, H) - _per_head(g * o, head, H) + glse_s)
            c = ds * r[:, None]
            dv += p * g + c * q[None, :]
            coef += tl.sum(ds * logit, axis=1) / DH  # each head's value is repeated over its DH slots
            slot = dq_part + pid * n_q * D + s * D + d
            tl.store(slot, tl.load(slot, mask=dm, other=0.0) + tl.sum(c * v, axis=0), mask=dm)
        dv -= (coef * r * r / D)[:, None] * v
        gptr = tl.load(grad_table + j).to(tl.pointer_type(tl.float32))
        tl.store(gptr + t[:, None] * D + d[None, :], dv, mask=mask)


@triton.jit
def _merge_terms(o1_ptr, lse_ptr, p_ptr, qg, t, d, T, D, eps, H: tl.constexpr, DH: tl.constexpr):
    tm, dm = t < T, d < D
    mask = tm[:, None] & dm[None, :]
    head = d // DH
    o1 = tl.load(o1_ptr + t[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    P = tl.load(p_ptr + t[:, None] * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    q = tl.load(qg + d, mask=dm, other=0.0)
    lse1 = tl.load(lse_ptr + t[:, None] * H + head[None, :], mask=mask & (head < H)[None, :], other=0.0)
    r = 1.0 / tl.sqrt(tl.sum(P * P, axis=1) / D + eps)
    s2 = _per_head(P * q[None, :], head, H) * r[:, None]
    w = 1.0 / (1.0 + tl.exp(s2 - lse1))  # sigmoid(lse1 - s2) = a / (a + b)
    return mask, head, o1, P, q, r, s2, w


@triton.jit
def _merge_fwd_kernel(o1_ptr, lse_ptr, p_ptr, qg, h_ptr, T, D, eps,
                      H: tl.constexpr, DH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    mask, head, o1, P, q, r, s2, w = _merge_terms(o1_ptr, lse_ptr, p_ptr, qg, t, d, T, D, eps, H, DH)
    tl.store(h_ptr + t[:, None] * D + d[None, :], P + w * (o1 - P), mask=mask)


@triton.jit
def _merge_bwd_kernel(o1_ptr, lse_ptr, p_ptr, qg, g_ptr, do1_ptr, dlse_ptr, dp_ptr, dq_part, T, D, eps,
                      H: tl.constexpr, DH: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    pid = tl.program_id(0)
    t = pid * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, BLOCK_D)
    mask, head, o1, P, q, r, s2, w = _merge_terms(o1_ptr, lse_ptr, p_ptr, qg, t, d, T, D, eps, H, DH)
    g = tl.load(g_ptr + t[:, None] * D + d[None, :], mask=mask, other=0.0)
    dz = _per_head(g * (o1 - P), head, H) * w * (1.0 - w)  # d loss / d (lse1 - s2)
    c = -dz * r[:, None]  # d loss / d raw partial logit
    coef = tl.sum(-dz * s2, axis=1) / DH
    dP = g * (1.0 - w) + c * q[None, :] - (coef * r * r / D)[:, None] * P
    tl.store(do1_ptr + t[:, None] * D + d[None, :], g * w, mask=mask)
    tl.store(dp_ptr + t[:, None] * D + d[None, :], dP, mask=mask)
    first = (d < D) & (d % DH == 0)
    tl.store(dlse_ptr + t[:, None] * H + head[None, :], dz, mask=(t < T)[:, None] & first[None, :])
    tl.store(dq_part + pid * D + d, tl.sum(tl.where(mask, c * P, 0.0), axis=0), mask=d < D)


def _blocks(T: int, D: int) -> tuple[int, int]:
    """Tile ``[BLOCK_T, BLOCK_D]``: a token's whole row (per-head sums need all of it), and as many
    tokens as keep the tile near 8192 elements, at most 16 (not tuned on a GPU yet)."""
    block_d = triton.next_power_of_2(D)
    block_t = max(1, min(16, 8192 // block_d))
    return block_t, block_d


def _table(tensors) -> torch.Tensor:
    return torch.tensor([x.data_ptr() for x in tensors], dtype=torch.int64, device=tensors[0].device)


# -- custom ops ----------------------------------------------------------------------------

@torch.library.custom_op("attnres::depth_attention_fwd", mutates_args=())
def depth_attention_fwd(qg: torch.Tensor, sources: list[torch.Tensor], heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    S, D = qg.shape
    T = sources[0].shape[0]
    out = torch.empty((S, T, D), dtype=sources[0].dtype, device=qg.device)
    lse = torch.empty((S, T, heads), dtype=torch.float32, device=qg.device)
    bt, bd = _blocks(T, D)
    _fwd_kernel[(triton.cdiv(T, bt), S)](
        _table(sources), len(sources), qg.float().contiguous(), out, lse, T, D, eps,
        H=heads, DH=D // heads, BLOCK_T=bt, BLOCK_D=bd, DT=_DTYPE_CODE[sources[0].dtype])
    return out, lse


@depth_attention_fwd.register_fake
def _(qg, sources, heads, eps):
    S, D = qg.shape
    T = sources[0].shape[0]
    return sources[0].new_empty((S, T, D)), qg.new_empty((S, T, heads), dtype=torch.float32)


@torch.library.custom_op("attnres::depth_attention_bwd", mutates_args=())
def depth_attention_bwd(g_out: torch.Tensor, g_lse: torch.Tensor, qg: torch.Tensor, out: torch.Tensor,
                        lse: torch.Tensor, sources: list[torch.Tensor], heads: int, eps: float
                        ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    S, D = qg.shape
    T = sources[0].shape[0]
    bt, bd = _blocks(T, D)
    n_blocks = triton.cdiv(T, bt)
    grads = [torch.empty((T, D), dtype=torch.float32, device=qg.device) for _ in sources]
    dq_part = torch.zeros((n_blocks, S, D), dtype=torch.float32, device=qg.device)
    _bwd_kernel[(n_blocks,)](
        _table(sources), _table(grads), len(sources), S, qg.float().contiguous(), out, lse,
        g_out.float().contiguous(), g_lse.float().contiguous(), dq_part, T, D, eps,
        H=heads, DH=D // heads, BLOCK_T=bt, BLOCK_D=bd, DT=_DTYPE_CODE[sources[0].dtype])
    return dq_part.sum(0).to(qg.dtype), [g.to(s.dtype) for g, s in zip(grads, sources)]


@depth_attention_bwd.register_fake
def _(g_out, g_lse, qg, out, lse, sources, heads, eps):
    return torch.empty_like(qg), [torch.empty_like(s) for s in sources]


def _fwd_setup(ctx, inputs, output):
    qg, sources, heads, eps = inputs
    ctx.save_for_backward(qg, output[0], output[1], *sources)
    ctx.heads, ctx.eps = heads, eps


def _fwd_backward(ctx, g_out, g_lse):
    qg, out, lse, *sources = ctx.saved_tensors
    g_out = torch.zeros_like(out, dtype=torch.float32) if g_out is None else g_out
    g_lse = torch.zeros_like(lse) if g_lse is None else g_lse
    d_qg, d_sources = depth_attention_bwd(g_out, g_lse, qg, out, lse, sources, ctx.heads, ctx.eps)
    return d_qg, d_sources, None, None


depth_attention_fwd.register_autograd(_fwd_backward, setup_context=_fwd_setup)


@torch.library.custom_op("attnres::merge_fwd", mutates_args=())
def merge_fwd(o1: torch.Tensor, lse1: torch.Tensor, partial: torch.Tensor, qg: torch.Tensor, heads: int,
              eps: float) -> torch.Tensor:
    T, D = partial.shape
    h = torch.empty_like(partial)
    bt, bd = _blocks(T, D)
    _merge_fwd_kernel[(triton.cdiv(T, bt),)](o1, lse1, partial, qg.float().contiguous(), h, T, D, eps,
                                             H=heads, DH=D // heads, BLOCK_T=bt, BLOCK_D=bd)
    return h


@merge_fwd.register_fake
def _(o1, lse1, partial, qg, heads, eps):
    return torch.empty_like(partial)


@torch.library.custom_op("attnres::merge_bwd", mutates_args=())
def merge_bwd(g: torch.Tensor, o1: torch.Tensor, lse1: torch.Tensor, partial: torch.Tensor, qg: torch.Tensor,
              heads: int, eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    T, D = partial.shape
    bt, bd = _blocks(T, D)
    n_blocks = triton.cdiv(T, bt)
    d_o1 = torch.empty((T, D), dtype=torch.float32, device=g.device)
    d_p = torch.empty((T, D), dtype=torch.float32, device=g.device)
    d_lse = torch.empty((T, heads), dtype=torch.float32, device=g.device)
    dq_part = torch.empty((n_blocks, D), dtype=torch.float32, device=g.device)
    _merge_bwd_kernel[(n_blocks,)](o1, lse1, partial, qg.float().contiguous(), g.float().contiguous(),
                                   d_o1, d_lse, d_p, dq_part, T, D, eps,
                                   H=heads, DH=D // heads, BLOCK_T=bt, BLOCK_D=bd)
    return d_o1.to(o1.dtype), d_lse, d_p.to(partial.dtype), dq_part.sum(0).to(qg.dtype)


@merge_bwd.register_fake
def _(g, o1, lse1, partial, qg, heads, eps):
    return torch.empty_like(o1), torch.empty_like(lse1), torch.empty_like(partial), torch.empty_like(qg)


def _merge_setup(ctx, inputs, output):
    o1, lse1, partial, qg, heads, eps = inputs
    ctx.save_for_backward(o1, lse1, partial, qg)
    ctx.heads, ctx.eps = heads, eps


def _merge_backward(ctx, g):
    o1, lse1, partial, qg = ctx.saved_tensors
    d_o1, d_lse, d_p, d_qg = merge_bwd(g, o1, lse1, partial, qg, ctx.heads, ctx.eps)
    return d_o1, d_lse, d_p, d_qg, None, None


merge_fwd.register_autograd(_merge_backward, setup_context=_merge_setup)


def _fold(query, gain):
    return query if gain is None else query * gain


def _normed(x, norm):
    return x if norm is None else RMSNormFunction.apply(x, norm.weight, norm.eps)


class TritonOps(KernelStreamOps):
    """The ``triton`` backend's operations (``ops.backends.BackendOps``)."""

    name = "triton"
    stream_kernels = triton_streams

    def attend(self, queries, sources, gains=None, *, heads=1, eps=1e-6, score="softmax",
               key_norm=True, norm=None, prepared=None, logits=None):
        """``(outs, lse)``: ``S x [..., D]`` and ``[S, ..., H]``, as the ``torch`` backend returns
        them; the first output through ``norm`` when given (applied after the kernel). The kernels
        normalize the keys themselves: ``prepared`` is not used. The method only (softmax over
        RMS-normalized keys): the registry refuses the ablations before a call gets here."""
        lead, D, dt = sources[0].shape[:-1], sources[0].shape[-1], sources[0].dtype
        # the kernel reads every source through the first one's pointer type
        flat = [s.to(dt).reshape(-1, D).contiguous() for s in sources]
        out, lse = depth_attention_fwd(_fold(queries, gains).float(), flat, heads, eps)
        outs = out.view(queries.shape[0], *lead, D).unbind(0)
        return (_normed(outs[0], norm), *outs[1:]), lse.view(queries.shape[0], *lead, heads)

    def merge(self, o1, lse, partial, query, gain=None, *, heads=1, eps=1e-6, score="softmax",
              key_norm=True, norm=None):
        """Phase 2, as the ``torch`` backend's ``merge``; ``norm`` applied after the kernel."""
        lead, D = partial.shape[:-1], partial.shape[-1]
        h = merge_fwd(o1.reshape(-1, D).contiguous(), lse.reshape(-1, heads).contiguous(),
                      partial.reshape(-1, D).contiguous(), _fold(query, gain).float(), heads, eps)
        return _normed(h.view(*lead, D), norm)

    def prepare(self, source, *, eps=1e-6, key_norm=True):
        """Nothing: the kernels normalize each source as they read it."""
        return None

    # The multi-stream operations on their kernels (KernelStreamOps: ``triton_streams``; the
    # reference's forms while torch.compile traces) but GR's per-branch norm: PyTorch's ops
    # (RMSNormFunction's one-pass backward), not a Triton kernel.

    def rms_norm(self, x, weight, eps=1e-6):
        return RMSNormFunction.apply(x, weight, eps)


OPS = TritonOps()
