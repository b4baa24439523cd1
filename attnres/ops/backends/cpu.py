"""Fused depth attention and two-phase merge for CPU tensors (the ``cpu`` backend).

The same ops as the ``torch`` backend's ``DepthAttentionFunction`` (``S`` queries against a list of sources
that is never stacked, the first output optionally through its sublayer's pre-norm), with the
per-token work done by one C++/OpenMP kernel per pass (``csrc/depth_attention_cpu.cpp``, built
on first use by ``cpu_build``): a token's rows of every source stay in cache while its
logits, softmax, weighted sums and all gradient terms are computed, so forward reads each
source once and backward once, where the PyTorch path makes a pass over ``[tokens, D]`` memory
per product and sum.

What it keeps for backward: references to the sources, their inverse RMS, ``lse``
``[S, ..., H]`` and, with the fused norm, one inverse RMS per token; no ``[..., D]`` tensor of
its own (backward recomputes the first output when its norm needs it), and not the logits
``[N, S, ..., H]``, which backward computes again from the rows it reads anyway.

Sources that an ``ops.source_ledger`` tracks (training: the completed sources) get no gradient
from ``attend``'s backward: it writes ``dL/d logit`` and leaves each such source a
``DeferredRead``, and ``source_grad`` forms the source's gradient once every read of it has run
its backward.

The merge (phase 2 of the Block computation) is one pass per direction too,
with the next sublayer's pre-norm fused in the same way; it keeps ``h``, a reference to the
partial sum and numbers per token, as the PyTorch merge does.

Takes fp32 or fp64 sources (the math runs in their dtype); others run on the ``torch`` backend.
Shapes: queries and gains ``[S, D]``, sources ``N x [..., D]``, inverse RMS ``N x [...]``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import torch
from torch.autograd.function import once_differentiable

from ..source_ledger import DeferredRead, tracked
from .common import apply_depth_function, compute_dtype, fold_gain, key_inverse_rms, prepare, score_source, split_query_grad, stack_scores
from .cpu_build import load_library

__all__ = ["attend", "attend_scored", "decode_read", "merge", "prepare", "score_source", "source_grad"]

_P = ctypes.POINTER


class _DepthArgs(ctypes.Structure):
    """Mirror of ``DepthArgs`` in the C++ source (field order and types must match)."""

    _fields_ = [
        ("tokens", ctypes.c_int64), ("dim", ctypes.c_int64), ("n_src", ctypes.c_int64),
        ("n_q", ctypes.c_int64), ("heads", ctypes.c_int64),
        ("src", _P(ctypes.c_void_p)), ("src_stride", _P(ctypes.c_int64)),
        ("rinv", _P(ctypes.c_void_p)), ("rinv_stride", _P(ctypes.c_int64)),
        ("qg", ctypes.c_void_p), ("logits", ctypes.c_void_p), ("lse", ctypes.c_void_p),
        ("outs", _P(ctypes.c_void_p)),
        ("norm_w", ctypes.c_void_p), ("norm_rr", ctypes.c_void_p), ("norm_eps", ctypes.c_double),
        ("g_out", _P(ctypes.c_void_p)), ("g_lse", ctypes.c_void_p), ("d_src", _P(ctypes.c_void_p)),
        ("d_qg", ctypes.c_void_p), ("d_norm_w", ctypes.c_void_p),
        ("key_norm", ctypes.c_int32), ("sigmoid", ctypes.c_int32), ("logits_given", ctypes.c_int32),
        ("threads", ctypes.c_int32), ("ds_out", ctypes.c_void_p), ("g0_out", ctypes.c_void_p),
    ]


def _ptr(t: torch.Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _ptrs(tensors: Sequence[torch.Tensor | None]):
    return (ctypes.c_void_p * len(tensors))(*[_ptr(t) for t in tensors])


def _strides(values: Sequence[int]):
    return (ctypes.c_int64 * len(values))(*values)


def _as_rows(t: torch.Tensor, width: int) -> tuple[torch.Tensor, int]:
    """``t`` as rows of ``width`` numbers per token (1 for a number per token) and the row
    stride: ``width`` when contiguous, 0 when one row is broadcast to every token (Delta's null
    source, expanded), else a contiguous copy."""
    if t.is_contiguous():
        return t, width
    token_strides = t.stride()[:-1] if width > 1 else t.stride()
    if (width == 1 or t.stride(-1) == 1) and all(s == 0 for s in token_strides):
        return t, 0
    return t.contiguous(), width


def in_dtype(sources: Sequence[torch.Tensor], dt: torch.dtype) -> list[torch.Tensor]:
    """The sources in one dtype, the first one's (the kernels read them through one pointer type)."""
    return [v if v.dtype == dt else v.to(dt) for v in sources]


def _suffix(dtype: torch.dtype) -> str:
    return "f32" if dtype == torch.float32 else "f64"


def _call(name: str, dtype: torch.dtype, args: _DepthArgs) -> None:
    getattr(load_library(), f"attnres_depth_{name}_{_suffix(dtype)}")(ctypes.byref(args))


def _args(sources, inv_rms, qg, heads, score, key_norm, lse, logits=None) -> tuple[_DepthArgs, list]:
    """The kernel arguments shared by forward and backward, and the tensors they point into
    (kept alive by the caller for the call's duration)."""
    D = sources[0].shape[-1]
    rows = [_as_rows(v, D) for v in sources]
    rinv = [_as_rows(r, 1) for r in inv_rms] if key_norm else []
    args = _DepthArgs(
        tokens=sources[0].numel() // D, dim=D, n_src=len(sources), n_q=lse.shape[0], heads=heads,
        src=_ptrs([v for v, _ in rows]), src_stride=_strides([s for _, s in rows]),
        rinv=_ptrs([r for r, _ in rinv]) if key_norm else None,
        rinv_stride=_strides([s for _, s in rinv]) if key_norm else None,
        qg=_ptr(qg), logits=_ptr(logits), lse=lse.data_ptr(),
        key_norm=int(key_norm), sigmoid=int(score != "softmax"), threads=torch.get_num_threads(),
    )
    return args, [rows, rinv, qg, logits, lse]


def mix_forward(sources, inv_rms, qg, heads, score, key_norm, norm=None, logits=None):
    """``(outs, lse, logits, norm_rr)`` of ``S`` queries: ``outs`` ``S x [..., D]``, ``lse``
    ``[S, ..., H]``, ``logits`` ``[N, S, ..., H]``, and with ``norm = (weight, eps)`` the first
    output normalized (``rms_norm``) and its inverse RMS ``[..., 1]`` (else None).

    ``qg`` ``[S, D]`` holds the gain-folded queries in the sources' dtype. Given ``logits``
    (precomputed by ``score_source``) are used as they are, and then
    ``qg`` and ``inv_rms`` are not read (pass None and ``key_norm=False``)."""
    dt, lead, D = sources[0].dtype, sources[0].shape[:-1], sources[0].shape[-1]
    sources, N = in_dtype(sources, dt), len(sources)
    given = logits is not None
    logits = logits.to(dt).contiguous() if given else torch.empty(N, qg.shape[0], *lead, heads, dtype=dt)
    S = logits.shape[1]
    lse = torch.empty(S, *lead, heads, dtype=dt)
    outs = [torch.empty(*lead, D, dtype=dt) for _ in range(S)]
    args, keep = _args(sources, inv_rms, None if given else qg.contiguous(), heads, score, key_norm, lse, logits)
    args.outs = _ptrs(outs)
    args.logits_given = int(given)
    norm_rr = None
    if norm is not None:
        weight, norm_eps = norm
        weight = None if weight is None else weight.to(dt).contiguous()
        norm_rr = torch.empty(*lead, 1, dtype=dt)
        args.norm_w, args.norm_rr, args.norm_eps = _ptr(weight), norm_rr.data_ptr(), norm_eps
        keep.append(weight)
    _call("forward", dt, args)
    return tuple(outs), lse, logits, norm_rr


class CpuDepthAttentionFunction(torch.autograd.Function):
    """The ``torch`` backend's ``DepthAttentionFunction`` on the kernels: the same inputs and outputs."""

    @staticmethod
    def forward(ctx, queries, gains, norm_weight, heads, eps, score, key_norm, norm_eps, n, *tensors):
        dt = tensors[0].dtype
        ctx.source_dtypes = [v.dtype for v in tensors[:n]]
        sources, cached = in_dtype(tensors[:n], dt), tensors[n:]
        inv_rms = [key_inverse_rms(v, r, eps) for v, r in zip(sources, cached)] if key_norm else []
        qg = fold_gain(queries, gains, dt).contiguous()
        norm = None if norm_eps is None else (norm_weight, norm_eps)
        outs, lse, logits, norm_rr = mix_forward(sources, inv_rms, qg, heads, score, key_norm, norm)
        # the logits are not kept: backward computes them again, token by token
        ctx.save_for_backward(queries, gains, norm_weight, norm_rr, lse, *inv_rms, *sources)
        ctx.config = (heads, score, key_norm, n, norm_eps)
        # the sources whose gradient a ledger forms: tracked by one whose reads compute as this one
        options = dict(heads=heads, eps=eps, score=score, key_norm=key_norm)
        ctx.tracked = [None if t is None or not t[0].takes(options, dt) else t for t in map(tracked, tensors[:n])]
        ctx.set_materialize_grads(False)
        if score != "softmax":
            ctx.mark_non_differentiable(lse)
        return (*outs, lse)

    @staticmethod
    def backward(ctx, *grads):
        # a backward that builds a graph (create_graph) does not defer: the sources' gradients
        # come from here, marked as once differentiable, as every other gradient of the kernels
        return _depth_backward(ctx, not torch.is_grad_enabled(), *grads)


@once_differentiable  # the kernels' backward is not itself differentiable: say so, not return zeros
def _depth_backward(ctx, may_defer, *grads):
    """``CpuDepthAttentionFunction``'s backward; ``may_defer``: leave the gradients of the
    sources a ledger tracks to it (not while building a graph)."""
    queries, gains, norm_weight, norm_rr, lse, *rest = ctx.saved_tensors
    heads, score, key_norm, n, norm_eps = ctx.config
    inv_rms, sources = (rest[:n], rest[n:]) if key_norm else ([], rest)
    S, D = queries.shape
    dt, lead = sources[0].dtype, sources[0].shape[:-1]
    g_outs = [None if g is None else g.to(dt).contiguous() for g in grads[:S]]
    g_lse = grads[S]
    # sources a ledger tracks get no gradient here: their terms are left to the ledger
    defer = [may_defer and need and t is not None for need, t in zip(ctx.needs_input_grad[9:9 + n], ctx.tracked)]
    need_src = [need and not d for need, d in zip(ctx.needs_input_grad[9:9 + n], defer)]
    deferred = [j for j, d in enumerate(defer) if d]
    need_q = ctx.needs_input_grad[0] or (gains is not None and ctx.needs_input_grad[1])
    need_w = norm_rr is not None and norm_weight is not None and ctx.needs_input_grad[2] and grads[0] is not None
    threads = torch.get_num_threads()
    qg = fold_gain(queries, gains, dt).contiguous()
    d_src = [torch.empty(*lead, D, dtype=dt) if need else None for need in need_src]
    d_qg = torch.zeros(threads, S, D, dtype=dt) if need_q else None
    d_norm_w = torch.zeros(threads, D, dtype=dt) if need_w else None
    g_lse = None if g_lse is None else g_lse.to(dt).contiguous()
    weight = None if norm_weight is None else norm_weight.to(dt).contiguous()
    args, keep = _args(sources, inv_rms, qg, heads, score, key_norm, lse)
    args.g_out, args.g_lse, args.d_src = _ptrs(g_outs), _ptr(g_lse), _ptrs(d_src)
    args.d_qg, args.d_norm_w = _ptr(d_qg), _ptr(d_norm_w)
    if norm_rr is not None:
        args.norm_w, args.norm_rr, args.norm_eps = _ptr(weight), norm_rr.data_ptr(), norm_eps
    args.threads = threads
    ds = g0 = None
    if deferred:
        ds = torch.empty(n, *lse.shape, dtype=dt)
        args.ds_out = ds.data_ptr()
        if norm_rr is not None and g_outs[0] is not None:  # the first query's gradient before its norm
            g0 = torch.empty(*lead, D, dtype=dt)
            args.g0_out = g0.data_ptr()
    _call("backward", dt, args)
    del keep
    if deferred:
        reads_grads = (g0 if g0 is not None else g_outs[0], *g_outs[1:])
        for j in deferred:
            ledger, index = ctx.tracked[j]
            ledger.defer(index, DeferredRead(qg, lse, ds[j], reads_grads))
    d_queries = d_gains = None
    if need_q:
        d_queries, d_gains = split_query_grad(d_qg.sum(0), queries, gains, *ctx.needs_input_grad[:2])
    d_weight = d_norm_w.sum(0).to(norm_weight.dtype) if need_w else None
    d_src = [None if d is None else d.to(t) for d, t in zip(d_src, ctx.source_dtypes)]
    return (d_queries, d_gains, d_weight, *([None] * 6), *d_src, *([None] * n))


class _SourceGradArgs(ctypes.Structure):
    """Mirror of ``SourceGradArgs`` in the C++ source (field order and types must match)."""

    _fields_ = [
        ("tokens", ctypes.c_int64), ("dim", ctypes.c_int64), ("heads", ctypes.c_int64), ("n_reads", ctypes.c_int64),
        ("src", ctypes.c_void_p), ("src_stride", ctypes.c_int64), ("rinv", ctypes.c_void_p),
        ("rinv_stride", ctypes.c_int64), ("n_q", _P(ctypes.c_int64)), ("qg", _P(ctypes.c_void_p)),
        ("lse", _P(ctypes.c_void_p)), ("ds", _P(ctypes.c_void_p)),
        ("g", _P(ctypes.c_void_p)), ("grad_in", ctypes.c_void_p), ("d_src", ctypes.c_void_p),
        ("sigmoid", ctypes.c_int32), ("threads", ctypes.c_int32),
    ]


def source_grad(source, inv_rms, reads, grad=None, *, heads=1, eps=1e-6, score="softmax", key_norm=True):
    """A source's gradient from the reads that deferred it (``ops.source_ledger``), in one pass
    of the kernels: ``grad`` (or zeros) plus every read's terms. ``source`` ``[..., D]``,
    ``inv_rms`` ``[...]`` its inverse RMS (None without the key norm; ``eps`` is not read),
    ``reads`` a list of ``DeferredRead`` in the kernels' dtype. Returns ``[..., D]`` in the
    source's dtype. Its twin is the naive backend's ``source_grad``."""
    dt = reads[0].queries.dtype
    D = source.shape[-1]
    v, v_stride = _as_rows(source.to(dt), D)
    rinv, rinv_stride = _as_rows(inv_rms.to(dt), 1) if key_norm else (None, 0)
    parts = [(r.queries.to(dt).contiguous(), r.lse.to(dt).contiguous(), r.ds.to(dt).contiguous(),
              [None if g is None else g.to(dt).contiguous() for g in r.grads]) for r in reads]
    grad_in = None if grad is None else grad.to(dt).contiguous()
    out = torch.empty(source.shape, dtype=dt)
    args = _SourceGradArgs(
        tokens=out.numel() // D, dim=D, heads=heads, n_reads=len(parts), src=v.data_ptr(), src_stride=v_stride,
        rinv=_ptr(rinv), rinv_stride=rinv_stride, n_q=_strides([q.shape[0] for q, *_ in parts]),
        qg=_ptrs([p[0] for p in parts]), lse=_ptrs([p[1] for p in parts]), ds=_ptrs([p[2] for p in parts]),
        g=_ptrs([g for p in parts for g in p[3]]), grad_in=_ptr(grad_in),
        d_src=out.data_ptr(), sigmoid=int(score != "softmax"), threads=torch.get_num_threads(),
    )
    getattr(load_library(), "attnres_source_grad_" + _suffix(dt))(ctypes.byref(args))
    return out.to(source.dtype)


class _MergeArgs(ctypes.Structure):
    """Mirror of ``MergeArgs`` in the C++ source (field order and types must match)."""

    _fields_ = [
        ("tokens", ctypes.c_int64), ("dim", ctypes.c_int64), ("heads", ctypes.c_int64),
        ("o1", ctypes.c_void_p), ("lse1", ctypes.c_void_p), ("partial", ctypes.c_void_p),
        ("qg", ctypes.c_void_p), ("eps", ctypes.c_double),
        ("h", ctypes.c_void_p), ("y", ctypes.c_void_p), ("norm_w", ctypes.c_void_p),
        ("norm_eps", ctypes.c_double), ("norm_rr", ctypes.c_void_p),
        ("s2", ctypes.c_void_p), ("w", ctypes.c_void_p), ("r", ctypes.c_void_p),
        ("g", ctypes.c_void_p), ("d_o1", ctypes.c_void_p), ("d_lse1", ctypes.c_void_p),
        ("d_partial", ctypes.c_void_p), ("d_qg", ctypes.c_void_p), ("d_norm_w", ctypes.c_void_p),
        ("key_norm", ctypes.c_int32), ("sigmoid", ctypes.c_int32), ("threads", ctypes.c_int32),
    ]


def _merge_args(o1, lse1, partial, qg, heads, eps, score, key_norm, weight, norm_eps) -> _MergeArgs:
    D = partial.shape[-1]
    return _MergeArgs(
        tokens=partial.numel() // D, dim=D, heads=heads, o1=_ptr(o1), lse1=_ptr(lse1), partial=_ptr(partial),
        qg=_ptr(qg), eps=eps, norm_w=_ptr(weight), norm_eps=0.0 if norm_eps is None else norm_eps,
        key_norm=int(key_norm), sigmoid=int(score != "softmax"), threads=torch.get_num_threads(),
    )


def _merge_inputs(o1, lse1, partial, query, gain, norm_weight):
    """The merge's inputs, contiguous, in the dtype the kernels compute in: the partial's
    (fp32 for a half-precision partial, as the ``torch`` backend computes it)."""
    dt = compute_dtype(partial.dtype)
    return (o1.to(dt).contiguous(), lse1.to(dt).contiguous(), partial.to(dt).contiguous(),
            fold_gain(query, gain, dt).contiguous(), None if norm_weight is None else norm_weight.to(dt).contiguous())


def _out_dtype(dtype, norm_weight, norm_eps):
    """The dtype of a kernel's output computed in ``dtype`` (the merge's: its partial's): that,
    or through a norm with a gain the dtype ``rms_norm`` promotes to."""
    if norm_eps is None or norm_weight is None:
        return dtype
    return torch.promote_types(dtype, norm_weight.dtype)


class CpuMergeFunction(torch.autograd.Function):
    """The ``torch`` backend's ``MergeFunction`` on the kernels: the same inputs and outputs."""

    @staticmethod
    def forward(ctx, o1, lse1, partial, query, gain, norm_weight, heads, eps, norm_eps, score, key_norm):
        partial_dtype = partial.dtype
        o1c, lse1c, partial, qg, weight = _merge_inputs(o1, lse1, partial, query, gain, norm_weight)
        lead, D = partial.shape[:-1], partial.shape[-1]
        dt = partial.dtype
        h = torch.empty(*lead, D, dtype=dt)
        y = None if norm_eps is None else torch.empty(*lead, D, dtype=dt)
        s2, w = torch.empty(*lead, heads, dtype=dt), torch.empty(*lead, heads, dtype=dt)
        r = torch.empty(*lead, dtype=dt) if key_norm else None
        rr = None if norm_eps is None else torch.empty(*lead, dtype=dt)
        args = _merge_args(o1c, lse1c, partial, qg, heads, eps, score, key_norm, weight, norm_eps)
        args.h, args.y, args.norm_rr, args.s2, args.w, args.r = _ptr(h), _ptr(y), _ptr(rr), _ptr(s2), _ptr(w), _ptr(r)
        getattr(load_library(), "attnres_merge_forward_" + _suffix(dt))(ctypes.byref(args))
        ctx.save_for_backward(h, partial, query, gain, norm_weight, s2, w, r, rr)
        ctx.config = (heads, eps, norm_eps, score, key_norm, o1.dtype, lse1.dtype, partial_dtype)
        return (h if y is None else y).to(_out_dtype(partial_dtype, norm_weight, norm_eps))

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        h, partial, query, gain, norm_weight, s2, w, r, rr = ctx.saved_tensors
        heads, eps, norm_eps, score, key_norm, o1_dtype, lse1_dtype, partial_dtype = ctx.config
        needs = ctx.needs_input_grad
        dt, lead, D = partial.dtype, partial.shape[:-1], partial.shape[-1]
        threads = torch.get_num_threads()
        qg = fold_gain(query, gain, dt).contiguous()
        weight = None if norm_weight is None else norm_weight.to(dt).contiguous()
        need_q = needs[3] or (gain is not None and needs[4])
        need_w = rr is not None and norm_weight is not None and needs[5]
        d_o1 = torch.empty(*lead, D, dtype=dt) if needs[0] else None
        d_lse1 = torch.empty(*lead, heads, dtype=dt) if needs[1] and score == "softmax" else None
        d_partial = torch.empty(*lead, D, dtype=dt) if needs[2] else None
        d_qg = torch.zeros(threads, D, dtype=dt) if need_q else None
        d_norm_w = torch.zeros(threads, D, dtype=dt) if need_w else None
        g = g.to(dt).contiguous()
        args = _merge_args(None, None, partial, qg, heads, eps, score, key_norm, weight, norm_eps)
        args.h, args.norm_rr, args.s2, args.w, args.r, args.g = _ptr(h), _ptr(rr), _ptr(s2), _ptr(w), _ptr(r), _ptr(g)
        args.d_o1, args.d_lse1, args.d_partial = _ptr(d_o1), _ptr(d_lse1), _ptr(d_partial)
        args.d_qg, args.d_norm_w, args.threads = _ptr(d_qg), _ptr(d_norm_w), threads
        getattr(load_library(), "attnres_merge_backward_" + _suffix(dt))(ctypes.byref(args))
        d_query = d_gain = None
        if need_q:
            d_query, d_gain = split_query_grad(d_qg.sum(0, keepdim=True), query[None], gain, needs[3], needs[4])
            d_query = None if d_query is None else d_query[0]
            d_gain = None if d_gain is None else d_gain[0]
        d_weight = d_norm_w.sum(0).to(norm_weight.dtype) if need_w else None
        return (None if d_o1 is None else d_o1.to(o1_dtype), None if d_lse1 is None else d_lse1.to(lse1_dtype),
                None if d_partial is None else d_partial.to(partial_dtype), d_query, d_gain, d_weight,
                None, None, None, None, None)


# -- the backend interface (ops.backends) --------------------------------------------------------

def attend(queries, sources, gains=None, *, heads=1, eps=1e-6, score="softmax", key_norm=True, norm=None,
           prepared=None):
    """The ``torch`` backend's ``attend`` on the kernels: the same arguments and results (the
    first output through a norm with a gain in the dtype ``rms_norm`` promotes to)."""
    outs, lse = apply_depth_function(CpuDepthAttentionFunction, queries, sources, gains, heads, eps, score,
                                     key_norm, prepared, norm)
    if norm is not None:
        outs = (outs[0].to(_out_dtype(outs[0].dtype, norm.weight, norm.eps)), *outs[1:])
    return outs, lse


def merge(o1, lse, partial, query, gain=None, *, heads=1, eps=1e-6, score="softmax", key_norm=True, norm=None):
    """The ``torch`` backend's ``merge`` on the kernels: ``h`` ``[..., D]``, or
    ``rms_norm(h, norm.weight, norm.eps)``. Without autograd nothing is kept, and with the norm
    ``h`` is never written to memory."""
    norm_weight, norm_eps = (norm.weight, norm.eps) if norm is not None else (None, None)
    if torch.is_grad_enabled():
        return CpuMergeFunction.apply(o1, lse, partial, query, gain, norm_weight, heads, eps, norm_eps, score, key_norm)
    partial_dtype = partial.dtype
    o1, lse, partial, qg, weight = _merge_inputs(o1, lse, partial, query, gain, norm_weight)
    out = torch.empty_like(partial)
    args = _merge_args(o1, lse, partial, qg, heads, eps, score, key_norm, weight, norm_eps)
    if norm_eps is None:
        args.h = out.data_ptr()
    else:
        args.y = out.data_ptr()
    getattr(load_library(), "attnres_merge_forward_" + _suffix(partial.dtype))(ctypes.byref(args))
    return out.to(_out_dtype(partial_dtype, norm_weight, norm_eps))


@torch.no_grad()
def attend_scored(scores, sources, *, score="softmax", norm=None):
    """``attend``'s ``(outs, lse)`` from precomputed logits (inference): the softmax, the sums
    and the norm in one pass of the kernels."""
    logits = stack_scores(scores, sources)
    norm = None if norm is None else (norm.weight, norm.eps)
    outs, lse, _, _ = mix_forward(sources, None, None, logits.shape[-1], score, False, norm, logits=logits)
    return outs, lse


_DECODE_ARGS = [ctypes.c_int64] * 4 + [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_double,
                                       ctypes.c_int32, ctypes.c_void_p, ctypes.c_double, ctypes.c_int32, ctypes.c_void_p,
                                       ctypes.c_double, ctypes.c_void_p, ctypes.c_int32]
_decode_kernels: dict[torch.dtype, object] = {}


def _decode_kernel(dtype: torch.dtype):
    """The decode read's C function for ``dtype``, its argument types declared once (ctypes
    then converts plain numbers without building a structure per call)."""
    fn = _decode_kernels.get(dtype)
    if fn is None:
        fn = getattr(load_library(), "attnres_decode_read_" + _suffix(dtype))
        fn.argtypes, fn.restype = _DECODE_ARGS, None
        _decode_kernels[dtype] = fn
    return fn


def decode_read(sources, count, query, *, heads=1, eps=1e-6, score="softmax", key_norm=True, base=None, gate=0.0,
                norm=None):
    """One read of a decode pass in one kernel call (the naive backend's ``decode_read``: the
    same arguments and result), with autograd off: nothing here is differentiable. ``sources``
    must be contiguous; ``query``, ``base`` and the norm's gain are read in the sources' dtype."""
    if torch.is_grad_enabled():
        raise RuntimeError("decode_read is for a decode pass, with autograd off (torch.no_grad()): the kernel keeps "
                           "nothing for a backward")
    if not sources.is_contiguous() or not 1 <= count <= sources.shape[0]:
        raise ValueError(f"decode_read reads the first count sources of a contiguous buffer [capacity, ..., D]: given "
                         f"count={count} of {tuple(sources.shape)}, contiguous={sources.is_contiguous()}")
    D = sources.shape[-1]
    if query.shape != (D,) or D % heads or (norm is not None and norm.weight is not None and norm.weight.shape != (D,)):
        raise ValueError(f"decode_read: query {tuple(query.shape)} and the norm's gain must be [{D}], and heads={heads} "
                         f"must divide {D}")
    if base is not None and base.shape != sources.shape[1:]:
        raise ValueError(f"decode_read: base must be one source's shape {tuple(sources.shape[1:])}, "
                         f"given {tuple(base.shape)}")
    dt = sources.dtype
    out = torch.empty(sources.shape[1:], dtype=dt)
    tokens = out.numel() // D
    query = query if query.dtype == dt and query.is_contiguous() else query.to(dt).contiguous()
    if base is not None and (base.dtype != dt or not base.is_contiguous()):
        base = base.to(dt).contiguous()
    weight = None if norm is None else norm.weight
    if weight is not None and weight.dtype != dt:
        weight = weight.to(dt)
    _decode_kernel(dt)(tokens, D, heads, count, sources.data_ptr(), tokens * D, query.data_ptr(), int(key_norm), eps,
                       int(score != "softmax"), None if base is None else base.data_ptr(), float(gate),
                       int(norm is not None), None if weight is None else weight.data_ptr(),
                       0.0 if norm is None else norm.eps, out.data_ptr(), torch.get_num_threads())
    return out
