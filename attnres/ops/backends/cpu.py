"""Fused depth attention and two-phase merge for CPU tensors (the ``cpu`` backend).

The same operations as the ``torch`` backend (``S`` queries against a list of sources that is
never stacked, the first output optionally through its sublayer's pre-norm), with the
per-token work done by one C++/OpenMP kernel per pass (``csrc/depth_attention_cpu.cpp``, built
on first use by ``cpu_build``): a token's rows of every source stay in cache while its
logits, softmax, weighted sums and all gradient terms are computed, so forward reads each
source once and backward once, where the PyTorch path makes a pass over ``[tokens, D]`` memory
per product and sum.

What it keeps for backward: references to the sources, their inverse RMS, ``lse``
``[S, ..., H]`` and, with the fused norm, one inverse RMS per token; no ``[..., D]`` tensor of
its own (backward recomputes the first output, to rounding, when its norm needs it), and not the logits
``[N, S, ..., H]``, which backward computes again from the rows it reads anyway.

Sources that an ``ops.source_ledger`` tracks (training: the completed sources) get no gradient
from ``attend``'s backward: it writes ``dL/d logit`` and leaves each such source a
``DeferredRead``, and ``source_grad`` forms the source's gradient once every read of it has run
its backward.

The merge (phase 2 of the Block computation) is one pass per direction too,
with the next sublayer's pre-norm fused in the same way; it keeps ``h``, a reference to the
partial sum and numbers per token, as the PyTorch merge does.

Each kernel is also a ``torch.library`` custom op (``attnres::cpu_attend``,
``attnres::cpu_attend_backward``, ``attnres::cpu_merge``, ``attnres::cpu_merge_backward``,
``attnres::cpu_source_grad``, ``attnres::cpu_decode_read``) with a fake (meta) implementation
and, for the two forward ops, an autograd formula, so that ``torch.compile`` captures them in
its graph. Eager calls run the same kernel functions without the dispatcher (a decode read
costs less than a dispatch): through ``CpuDepthAttentionFunction`` and ``CpuMergeFunction``,
which also defer the sources' gradients to a ledger. A compiled graph calls the ops, and
defers nothing (a ledger follows tensors by identity, which tracing does not keep).

Takes fp32 or fp64 sources (the math runs in their dtype); others run on the ``torch`` backend.
Shapes: queries and gains ``[S, D]``, sources ``N x [..., D]``, inverse RMS ``N x [...]``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..rmsnorm import RMSNormFunction
from ..sinkhorn import sinkhorn
from ..source_ledger import DeferredRead, tracked
from . import cpu_streams
from .common import (
    KeyStatisticsOps,
    compute_dtype,
    fold_gain,
    key_inverse_rms,
    split_query_grad,
    stack_scores,
)
from .cpu_build import load_library
from .naive import gated_mix_naive, stream_mix_naive, stream_update_naive

__all__ = ["OPS", "CpuDepthAttentionFunction", "CpuMergeFunction", "CpuOps"]

_P = ctypes.POINTER


# -- the kernels' arguments (mirrors of the C++ structures) --------------------------------------

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


class _SourceGradArgs(ctypes.Structure):
    """Mirror of ``SourceGradArgs`` in the C++ source (field order and types must match)."""

    _fields_ = [
        ("tokens", ctypes.c_int64), ("dim", ctypes.c_int64), ("heads", ctypes.c_int64),
        ("n_reads", ctypes.c_int64),
        ("src", ctypes.c_void_p), ("src_stride", ctypes.c_int64), ("rinv", ctypes.c_void_p),
        ("rinv_stride", ctypes.c_int64), ("n_q", _P(ctypes.c_int64)), ("qg", _P(ctypes.c_void_p)),
        ("lse", _P(ctypes.c_void_p)), ("ds", _P(ctypes.c_void_p)),
        ("g", _P(ctypes.c_void_p)), ("grad_in", ctypes.c_void_p), ("d_src", ctypes.c_void_p),
        ("sigmoid", ctypes.c_int32), ("threads", ctypes.c_int32),
    ]


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


_DECODE_ARGS = [ctypes.c_int64] * 4 + [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int32, ctypes.c_double,
    ctypes.c_int32, ctypes.c_void_p, ctypes.c_double, ctypes.c_int32, ctypes.c_void_p,
    ctypes.c_double, ctypes.c_void_p, ctypes.c_int32]
_decode_kernels: dict[torch.dtype, object] = {}


def _ptr(t: Tensor | None) -> int | None:
    return None if t is None else t.data_ptr()


def _ptrs(tensors: Sequence[Tensor | None]):
    return (ctypes.c_void_p * len(tensors))(*[_ptr(t) for t in tensors])


def _strides(values: Sequence[int]):
    return (ctypes.c_int64 * len(values))(*values)


def _as_rows(t: Tensor, width: int) -> tuple[Tensor, int]:
    """``t`` as rows of ``width`` numbers per token (1 for a number per token) and the row
    stride: ``width`` when contiguous, 0 when one row is broadcast to every token (Delta's null
    source, expanded), else a contiguous copy."""
    if t.is_contiguous():
        return t, width
    token_strides = t.stride()[:-1] if width > 1 else t.stride()
    if (width == 1 or t.stride(-1) == 1) and all(s == 0 for s in token_strides):
        return t, 0
    return t.contiguous(), width


def in_dtype(sources: Sequence[Tensor], dt: torch.dtype) -> list[Tensor]:
    """The sources in one dtype, the first one's (the kernels read them through one pointer
    type)."""
    return [v if v.dtype == dt else v.to(dt) for v in sources]


def _suffix(dtype: torch.dtype) -> str:
    return "f32" if dtype == torch.float32 else "f64"


def _call(name: str, dtype: torch.dtype, args: ctypes.Structure) -> None:
    getattr(load_library(), f"attnres_{name}_{_suffix(dtype)}")(ctypes.byref(args))


def _args(sources, inv_rms, qg, heads, score, key_norm, lse, logits=None
          ) -> tuple[_DepthArgs, list]:
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


def _out_dtype(dtype, norm_weight, norm_eps):
    """The dtype of a kernel's output computed in ``dtype``: that, or through a norm with a gain
    the dtype ``rms_norm`` promotes to."""
    if norm_eps is None or norm_weight is None:
        return dtype
    return torch.promote_types(dtype, norm_weight.dtype)


# -- the kernels: what the eager functions and the custom ops both run ---------------------------

def mix_forward(sources, inv_rms, qg, heads, score, key_norm, norm=None, logits=None):
    """``(outs, lse, norm_rr)`` of ``S`` queries: ``outs`` ``S x [..., D]``, ``lse``
    ``[S, ..., H]``, and with ``norm = (weight, eps)`` the first output normalized
    (``rms_norm``) and its inverse RMS ``[..., 1]`` (else None).

    ``qg`` ``[S, D]`` holds the gain-folded queries in the sources' dtype. Given ``logits``
    ``[N, S, ..., H]`` (precomputed by ``score_source``) are used as they are, and then
    ``qg`` and ``inv_rms`` are not read (pass None and ``key_norm=False``); otherwise the kernel
    scores each token's sources as it goes and keeps no logits."""
    dt, lead, D = sources[0].dtype, sources[0].shape[:-1], sources[0].shape[-1]
    sources = in_dtype(sources, dt)
    given = logits is not None
    if given:
        logits = logits.to(dt).contiguous()
    S = logits.shape[1] if given else qg.shape[0]
    lse = torch.empty(S, *lead, heads, dtype=dt)
    outs = [torch.empty(*lead, D, dtype=dt) for _ in range(S)]
    args, keep = _args(sources, inv_rms, None if given else qg.contiguous(), heads, score, key_norm,
                       lse, logits)
    args.outs = _ptrs(outs)
    args.logits_given = int(given)
    norm_rr = None
    if norm is not None:
        weight, norm_eps = norm
        weight = None if weight is None else weight.to(dt).contiguous()
        norm_rr = torch.empty(*lead, 1, dtype=dt)
        args.norm_w, args.norm_rr, args.norm_eps = _ptr(weight), norm_rr.data_ptr(), norm_eps
        keep.append(weight)
    _call("depth_forward", dt, args)
    return tuple(outs), lse, norm_rr


class AttendGrads(NamedTuple):
    """What ``attend_backward`` computes (the kernels' dtype; None where not asked for)."""

    d_qg: Tensor | None  # [S, D], the gain-folded queries'
    d_sources: list[Tensor | None]  # N x [..., D]
    d_weight: Tensor | None  # [D], the fused norm's gain
    ds: Tensor | None  # [N, S, ..., H]: dL/d logit per source, for a ledger
    g0: Tensor | None  # [..., D]: dL/d out_0 before its fused norm, for a ledger


def attend_backward(grad_outs, grad_lse, qg, sources, inv_rms, lse, *, heads, score, key_norm,
                    norm_weight, norm_rr, norm_eps, sources_need, qg_needs, weight_needs,
                    for_ledger=False) -> AttendGrads:
    """The backward kernel of ``mix_forward``: ``grad_outs`` ``S x [..., D]`` (None where an
    output got none), ``grad_lse`` ``[S, ..., H]`` or None; ``sources_need``, ``qg_needs``,
    ``weight_needs`` say which gradients to form. ``for_ledger``: also ``ds`` and ``g0``."""
    S, D = qg.shape
    dt, lead = sources[0].dtype, sources[0].shape[:-1]
    weight_needs = (weight_needs and norm_rr is not None and norm_weight is not None
                    and grad_outs[0] is not None)
    g_outs = [None if g is None else g.to(dt).contiguous() for g in grad_outs]
    threads = torch.get_num_threads()
    d_src = [torch.empty(*lead, D, dtype=dt) if need else None for need in sources_need]
    d_qg = torch.zeros(threads, S, D, dtype=dt) if qg_needs else None
    d_norm_w = torch.zeros(threads, D, dtype=dt) if weight_needs else None
    g_lse = None if grad_lse is None else grad_lse.to(dt).contiguous()
    weight = None if norm_weight is None else norm_weight.to(dt).contiguous()
    args, keep = _args(sources, inv_rms, qg, heads, score, key_norm, lse)
    args.g_out, args.g_lse, args.d_src = _ptrs(g_outs), _ptr(g_lse), _ptrs(d_src)
    args.d_qg, args.d_norm_w = _ptr(d_qg), _ptr(d_norm_w)
    if norm_rr is not None:
        args.norm_w, args.norm_rr, args.norm_eps = _ptr(weight), norm_rr.data_ptr(), norm_eps
    args.threads = threads
    ds = g0 = None
    if for_ledger:
        ds = torch.empty(len(sources), *lse.shape, dtype=dt)
        args.ds_out = ds.data_ptr()
        if norm_rr is not None and g_outs[0] is not None:  # query 0's gradient before its norm
            g0 = torch.empty(*lead, D, dtype=dt)
            args.g0_out = g0.data_ptr()
    _call("depth_backward", dt, args)
    del keep
    return AttendGrads(None if d_qg is None else d_qg.sum(0), d_src,
                       None if d_norm_w is None else d_norm_w.sum(0), ds, g0)


def _merge_args(o1, lse1, partial, qg, heads, eps, score, key_norm, weight, norm_eps) -> _MergeArgs:
    D = partial.shape[-1]
    return _MergeArgs(
        tokens=partial.numel() // D, dim=D, heads=heads, o1=_ptr(o1), lse1=_ptr(lse1),
        partial=_ptr(partial), qg=_ptr(qg), eps=eps, norm_w=_ptr(weight),
        norm_eps=0.0 if norm_eps is None else norm_eps,
        key_norm=int(key_norm), sigmoid=int(score != "softmax"), threads=torch.get_num_threads(),
    )


def _merge_inputs(o1, lse1, partial, query, gain, norm_weight):
    """The merge's inputs, contiguous, in the dtype the kernels compute in: the partial's
    (fp32 for a half-precision partial, as the ``torch`` backend computes it)."""
    dt = compute_dtype(partial.dtype)
    return (o1.to(dt).contiguous(), lse1.to(dt).contiguous(), partial.to(dt).contiguous(),
            fold_gain(query, gain, dt).contiguous(),
            None if norm_weight is None else norm_weight.to(dt).contiguous())


class MergeSaved(NamedTuple):
    """What the merge's forward kernel writes besides its result, for backward (per token:
    ``s2``, ``w`` ``[..., H]``, ``r`` and ``rr`` ``[...]``; ``h`` ``[..., D]`` before the norm)."""

    h: Tensor
    s2: Tensor
    w: Tensor
    r: Tensor | None  # the partial's inverse RMS (None without the key norm)
    rr: Tensor | None  # the inverse RMS of h (None without the fused norm)


def merge_forward(o1, lse1, partial, qg, weight, *, heads, eps, score, key_norm, norm_eps, keep):
    """The merge kernel on inputs of one dtype (``_merge_inputs``): ``(out, saved)``, ``out``
    ``h`` or with ``norm_eps`` set ``rms_norm(h, weight, norm_eps)`` ``[..., D]``; ``keep``:
    also what backward needs (``MergeSaved``; else None, and with the norm ``h`` is never
    written to memory)."""
    lead, D, dt = partial.shape[:-1], partial.shape[-1], partial.dtype
    args = _merge_args(o1, lse1, partial, qg, heads, eps, score, key_norm, weight, norm_eps)
    out = torch.empty(*lead, D, dtype=dt)
    saved = None
    if keep:
        h = out if norm_eps is None else torch.empty(*lead, D, dtype=dt)
        saved = MergeSaved(h, torch.empty(*lead, heads, dtype=dt),
                           torch.empty(*lead, heads, dtype=dt),
                           torch.empty(*lead, dtype=dt) if key_norm else None,
                           None if norm_eps is None else torch.empty(*lead, dtype=dt))
        args.norm_rr, args.s2 = _ptr(saved.rr), _ptr(saved.s2)
        args.w, args.r = _ptr(saved.w), _ptr(saved.r)
        args.h = saved.h.data_ptr()
    if norm_eps is None:
        args.h = out.data_ptr()
    else:
        args.y = out.data_ptr()
    _call("merge_forward", dt, args)
    return out, saved


class MergeGrads(NamedTuple):
    """What ``merge_backward`` computes (the kernels' dtype; None where not asked for)."""

    d_o1: Tensor | None
    d_lse1: Tensor | None
    d_partial: Tensor | None
    d_qg: Tensor | None  # [D]
    d_weight: Tensor | None  # [D]


def merge_backward(grad, partial, qg, weight, saved: MergeSaved, *, heads, eps, score, key_norm,
                   norm_eps, o1_needs, lse1_needs, partial_needs, qg_needs,
                   weight_needs) -> MergeGrads:
    """The backward kernel of ``merge_forward`` from ``grad`` ``[..., D]`` (dL/d its output)."""
    dt, lead, D = partial.dtype, partial.shape[:-1], partial.shape[-1]
    threads = torch.get_num_threads()
    weight_needs = weight_needs and saved.rr is not None and weight is not None
    d_o1 = torch.empty(*lead, D, dtype=dt) if o1_needs else None
    d_lse1 = torch.empty(*lead, heads, dtype=dt) if lse1_needs and score == "softmax" else None
    d_partial = torch.empty(*lead, D, dtype=dt) if partial_needs else None
    d_qg = torch.zeros(threads, D, dtype=dt) if qg_needs else None
    d_norm_w = torch.zeros(threads, D, dtype=dt) if weight_needs else None
    g = grad.to(dt).contiguous()
    args = _merge_args(None, None, partial, qg, heads, eps, score, key_norm, weight, norm_eps)
    args.h, args.norm_rr, args.g = _ptr(saved.h), _ptr(saved.rr), _ptr(g)
    args.s2, args.w, args.r = _ptr(saved.s2), _ptr(saved.w), _ptr(saved.r)
    args.d_o1, args.d_lse1, args.d_partial = _ptr(d_o1), _ptr(d_lse1), _ptr(d_partial)
    args.d_qg, args.d_norm_w, args.threads = _ptr(d_qg), _ptr(d_norm_w), threads
    _call("merge_backward", dt, args)
    return MergeGrads(d_o1, d_lse1, d_partial, None if d_qg is None else d_qg.sum(0),
                      None if d_norm_w is None else d_norm_w.sum(0))


def source_grad_kernel(source, inv_rms, queries, lse, ds, grads, grad, *, heads, score, key_norm):
    """A source's gradient ``[..., D]`` (the reads' dtype) from the records of its reads, one
    pass of the kernels: ``queries[r]`` ``[S_r, D]``, ``lse[r]`` and ``ds[r]`` ``[S_r, ..., H]``
    per read ``r``, and ``grads`` the reads' upstream gradients one after another (``S_r``
    each, None where a query got none); ``grad`` (or None) is added."""
    dt = queries[0].dtype
    D = source.shape[-1]
    v, v_stride = _as_rows(source.to(dt), D)
    rinv, rinv_stride = _as_rows(inv_rms.to(dt), 1) if key_norm else (None, 0)
    queries = [q.to(dt).contiguous() for q in queries]
    lse, ds = [t.to(dt).contiguous() for t in lse], [t.to(dt).contiguous() for t in ds]
    grads = [None if g is None else g.to(dt).contiguous() for g in grads]
    grad_in = None if grad is None else grad.to(dt).contiguous()
    out = torch.empty(source.shape, dtype=dt)
    args = _SourceGradArgs(
        tokens=out.numel() // D, dim=D, heads=heads, n_reads=len(queries), src=v.data_ptr(),
        src_stride=v_stride, rinv=_ptr(rinv), rinv_stride=rinv_stride,
        n_q=_strides([q.shape[0] for q in queries]),
        qg=_ptrs(queries), lse=_ptrs(lse), ds=_ptrs(ds), g=_ptrs(grads), grad_in=_ptr(grad_in),
        d_src=out.data_ptr(), sigmoid=int(score != "softmax"), threads=torch.get_num_threads(),
    )
    _call("source_grad", dt, args)
    return out


def _decode_kernel(dtype: torch.dtype):
    """The decode read's C function for ``dtype``, its argument types declared once (ctypes
    then converts plain numbers without building a structure per call)."""
    fn = _decode_kernels.get(dtype)
    if fn is None:
        fn = getattr(load_library(), "attnres_decode_read_" + _suffix(dtype))
        fn.argtypes, fn.restype = _DECODE_ARGS, None
        _decode_kernels[dtype] = fn
    return fn


def decode_kernel(sources, count, query, heads, eps, score, key_norm, base, gate, norm_weight,
                  norm_eps):
    """The decode read's kernel on checked inputs (``CpuOps.decode_read``); ``norm_eps`` None:
    no norm. The arguments are ``attnres::cpu_decode_read``'s, in its order (a decode read is a
    few microseconds: positional arguments cost least)."""
    dt = sources.dtype
    D = sources.shape[-1]
    out = torch.empty(sources.shape[1:], dtype=dt)
    tokens = out.numel() // D
    query = query if query.dtype == dt and query.is_contiguous() else query.to(dt).contiguous()
    if base is not None and (base.dtype != dt or not base.is_contiguous()):
        base = base.to(dt).contiguous()
    weight = norm_weight
    if weight is not None and weight.dtype != dt:
        weight = weight.to(dt)
    _decode_kernel(dt)(tokens, D, heads, count, sources.data_ptr(), tokens * D, query.data_ptr(),
                       int(key_norm), eps, int(score != "softmax"), _ptr(base), float(gate),
                       int(norm_eps is not None), _ptr(weight),
                       0.0 if norm_eps is None else norm_eps, out.data_ptr(),
                       torch.get_num_threads())
    return out


# -- eager: autograd functions that run the kernels directly --------------------------------------

class ReadOptions(NamedTuple):
    """A read's options as ``CpuDepthAttentionFunction`` takes them."""

    heads: int
    eps: float
    score: str
    key_norm: bool
    norm_eps: float | None  # the first output's fused norm (None: no norm)


class CpuDepthAttentionFunction(torch.autograd.Function):
    """``attend`` on the kernels. Inputs: the queries ``[S, D]``, the gains ``[S, D]`` (or
    None), the norm's gain ``[D]`` (or None), ``ReadOptions``, each source's prepared inverse
    RMS (a tuple, entries may be None: computed here), then the sources. Outputs: one
    ``[..., D]`` tensor per query (so that each gets its own gradient, and one the caller does
    not use costs nothing in backward), then ``lse``."""

    @staticmethod
    def forward(ctx, queries, gains, norm_weight, options: ReadOptions, prepared: tuple, *given):
        dt = given[0].dtype
        ctx.source_dtypes = [v.dtype for v in given]
        sources = in_dtype(given, dt)
        heads, eps, score, key_norm, norm_eps = options
        inv_rms = [key_inverse_rms(v, r, eps) for v, r in zip(sources, prepared) if key_norm]
        qg = fold_gain(queries, gains, dt).contiguous()
        norm = None if norm_eps is None else (norm_weight, norm_eps)
        outs, lse, norm_rr = mix_forward(sources, inv_rms, qg, heads, score, key_norm, norm)
        # the logits are not kept: backward computes them again, token by token
        ctx.save_for_backward(queries, gains, norm_weight, norm_rr, lse, *inv_rms, *sources)
        ctx.options = options
        # the sources whose gradient a ledger forms: tracked by one whose reads compute as this one
        keys = dict(heads=heads, eps=eps, score=score, key_norm=key_norm)
        ctx.tracked = [None if t is None or not t[0].takes(keys, dt) else t
                       for t in map(tracked, given)]
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
    options = ctx.options
    queries_need, gains_need, weight_need, _, _, *sources_need = ctx.needs_input_grad
    n = len(sources_need)
    inv_rms, sources = (rest[:n], rest[n:]) if options.key_norm else ([], rest)
    S, dt = queries.shape[0], sources[0].dtype
    g_outs = [None if g is None else g.to(dt).contiguous() for g in grads[:S]]
    # sources a ledger tracks get no gradient here: their terms are left to the ledger
    defer = [may_defer and need and t is not None for need, t in zip(sources_need, ctx.tracked)]
    qg = fold_gain(queries, gains, dt).contiguous()
    out = attend_backward(
        g_outs, grads[S], qg, sources, inv_rms, lse, heads=options.heads, score=options.score,
        key_norm=options.key_norm, norm_weight=norm_weight, norm_rr=norm_rr,
        norm_eps=options.norm_eps,
        sources_need=[need and not d for need, d in zip(sources_need, defer)],
        qg_needs=queries_need or (gains is not None and gains_need), weight_needs=weight_need,
        for_ledger=any(defer))
    if any(defer):
        reads_grads = (out.g0 if out.g0 is not None else g_outs[0], *g_outs[1:])
        for j in (j for j, d in enumerate(defer) if d):
            ledger, index = ctx.tracked[j]
            ledger.defer(index, DeferredRead(qg, lse, out.ds[j], reads_grads))
    d_queries = d_gains = None
    if out.d_qg is not None:
        d_queries, d_gains = split_query_grad(out.d_qg, queries, gains, queries_need, gains_need)
    d_weight = None if out.d_weight is None else out.d_weight.to(norm_weight.dtype)
    d_sources = [None if d is None else d.to(t) for d, t in zip(out.d_sources, ctx.source_dtypes)]
    return (d_queries, d_gains, d_weight, None, None, *d_sources)


class CpuMergeFunction(torch.autograd.Function):
    """``merge`` on the kernels, with autograd: the inputs of the ``torch`` backend's
    ``MergeFunction``."""

    @staticmethod
    def forward(ctx, o1, lse1, partial, query, gain, norm_weight, options: ReadOptions):
        partial_dtype = partial.dtype
        o1c, lse1c, partial, qg, weight = _merge_inputs(o1, lse1, partial, query, gain, norm_weight)
        out, saved = merge_forward(o1c, lse1c, partial, qg, weight, keep=True, **options._asdict())
        ctx.save_for_backward(partial, query, gain, norm_weight, *saved)
        ctx.options, ctx.dtypes = options, (o1.dtype, lse1.dtype, partial_dtype)
        return out.to(_out_dtype(partial_dtype, norm_weight, options.norm_eps))

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        partial, query, gain, norm_weight, *saved = ctx.saved_tensors
        options, (o1_dtype, lse1_dtype, partial_dtype) = ctx.options, ctx.dtypes
        o1_need, lse1_need, partial_need, query_need, gain_need, weight_need, _ = \
            ctx.needs_input_grad
        dt = partial.dtype
        qg = fold_gain(query, gain, dt).contiguous()
        weight = None if norm_weight is None else norm_weight.to(dt).contiguous()
        out = merge_backward(g, partial, qg, weight, MergeSaved(*saved), o1_needs=o1_need,
                             lse1_needs=lse1_need, partial_needs=partial_need,
                             qg_needs=query_need or (gain is not None and gain_need),
                             weight_needs=weight_need, **options._asdict())
        d_query = d_gain = None
        if out.d_qg is not None:
            d_query, d_gain = split_query_grad(out.d_qg[None], query[None], gain, query_need,
                                               gain_need)
            d_query = None if d_query is None else d_query[0]
            d_gain = None if d_gain is None else d_gain[0]
        d_weight = None if norm_weight is None else _cast(out.d_weight, norm_weight.dtype)
        return (_cast(out.d_o1, o1_dtype), _cast(out.d_lse1, lse1_dtype),
                _cast(out.d_partial, partial_dtype), d_query, d_gain, d_weight, None)


def _cast(t: Tensor | None, dtype) -> Tensor | None:
    return None if t is None else t.to(dtype)


# -- the custom ops: what a compiled graph calls -------------------------------------------------

def _none_if_empty(t: Tensor | None) -> Tensor | None:
    """An op's placeholder for an absent tensor (an op returns tensors, never None) as None."""
    return None if t is None or t.numel() == 0 else t


def _or_empty(t: Tensor | None, like: Tensor) -> Tensor:
    """``t``, or for None a fresh empty placeholder (an op's outputs must not alias each other)."""
    return like.new_empty(0) if t is None else t


@torch.library.custom_op("attnres::cpu_attend", mutates_args=())
def attend_op(qg: Tensor | None, sources: list[Tensor], inv_rms: list[Tensor],
              logits: Tensor | None, norm_weight: Tensor | None, norm_eps: float | None, heads: int,
              score: str, key_norm: bool) -> tuple[list[Tensor], Tensor, Tensor]:
    """``mix_forward`` as an op: ``(outs, lse, norm_rr)``, ``norm_rr`` ``[..., 1]`` with the
    fused norm (``norm_eps`` set) and empty without. Every tensor in the sources' dtype."""
    norm = None if norm_eps is None else (norm_weight, norm_eps)
    outs, lse, norm_rr = mix_forward(sources, inv_rms, qg, heads, score, key_norm, norm, logits=logits)
    return list(outs), lse, lse.new_empty(0) if norm_rr is None else norm_rr


@attend_op.register_fake
def _(qg, sources, inv_rms, logits, norm_weight, norm_eps, heads, score, key_norm):
    v = sources[0]
    S = qg.shape[0] if logits is None else logits.shape[1]
    norm_rr = v.new_empty((0,) if norm_eps is None else (*v.shape[:-1], 1))
    return [v.new_empty(v.shape) for _ in range(S)], v.new_empty((S, *v.shape[:-1], heads)), norm_rr


@torch.library.custom_op("attnres::cpu_attend_backward", mutates_args=())
def attend_backward_op(grad_outs: list[Tensor | None], grad_lse: Tensor | None, qg: Tensor,
                       sources: list[Tensor], inv_rms: list[Tensor], lse: Tensor,
                       norm_weight: Tensor | None, norm_rr: Tensor, norm_eps: float | None,
                       heads: int, score: str, key_norm: bool, sources_need: list[bool],
                       qg_needs: bool, weight_needs: bool) -> tuple[Tensor, list[Tensor], Tensor]:
    """``attend_backward`` as an op: ``(d_qg, d_sources, d_weight)``, empty where not needed."""
    out = attend_backward(grad_outs, grad_lse, qg, sources, inv_rms, lse, heads=heads, score=score,
                          key_norm=key_norm, norm_weight=norm_weight,
                          norm_rr=_none_if_empty(norm_rr), norm_eps=norm_eps,
                          sources_need=sources_need, qg_needs=qg_needs, weight_needs=weight_needs)
    return (_or_empty(out.d_qg, qg), [_or_empty(d, qg) for d in out.d_sources],
            _or_empty(out.d_weight, qg))


@attend_backward_op.register_fake
def _(grad_outs, grad_lse, qg, sources, inv_rms, lse, norm_weight, norm_rr, norm_eps, heads, score,
      key_norm, sources_need, qg_needs, weight_needs):
    weight_needs = (weight_needs and norm_rr.numel() > 0 and norm_weight is not None
                    and grad_outs[0] is not None)
    return (qg.new_empty(qg.shape if qg_needs else 0),
            [v.new_empty(v.shape if need else 0) for v, need in zip(sources, sources_need)],
            qg.new_empty(norm_weight.shape if weight_needs else 0))


def _attend_setup(ctx, inputs, output):
    qg, sources, inv_rms, _, norm_weight, norm_eps, heads, score, key_norm = inputs
    _, lse, norm_rr = output
    ctx.save_for_backward(qg, lse, norm_weight, norm_rr, *inv_rms, *sources)
    ctx.options = dict(norm_eps=norm_eps, heads=heads, score=score, key_norm=key_norm)
    ctx.n = len(sources)


def _attend_grads(ctx, grad_outs, grad_lse, _):
    qg, lse, norm_weight, norm_rr, *rest = ctx.saved_tensors
    qg_needs, sources_need, inv_rms_need, _, weight_needs, *_ = ctx.needs_input_grad
    inv_rms, sources = rest[:-ctx.n], rest[-ctx.n:]
    if ctx.options["score"] != "softmax":  # the sigmoid score's lse is zeros, not differentiable
        grad_lse = None
    d_qg, d_sources, d_weight = attend_backward_op(
        list(grad_outs), grad_lse, qg, sources, inv_rms, lse, norm_weight, norm_rr,
        sources_need=list(sources_need), qg_needs=qg_needs, weight_needs=weight_needs,
        **ctx.options)
    return (_none_if_empty(d_qg), [d if need else None for d, need in zip(d_sources, sources_need)],
            [None] * len(inv_rms_need), None, _none_if_empty(d_weight), None, None, None, None)


attend_op.register_autograd(_attend_grads, setup_context=_attend_setup)


@torch.library.custom_op("attnres::cpu_merge", mutates_args=())
def merge_op(o1: Tensor, lse1: Tensor, partial: Tensor, qg: Tensor, norm_weight: Tensor | None,
             norm_eps: float | None, heads: int, eps: float, score: str, key_norm: bool
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``merge_forward`` as an op on inputs of one dtype: ``(out, h, s2, w, r, rr)``, ``h``
    empty when it is ``out`` (no norm), ``r`` and ``rr`` empty where ``MergeSaved`` has None."""
    weight = None if norm_weight is None else norm_weight.contiguous()
    out, saved = merge_forward(o1.contiguous(), lse1.contiguous(), partial.contiguous(),
                               qg.contiguous(), weight, heads=heads, eps=eps, score=score,
                               key_norm=key_norm, norm_eps=norm_eps, keep=True)
    h, s2, w, r, rr = (_or_empty(t, out) for t in saved)
    return out, out.new_empty(0) if norm_eps is None else h, s2, w, r, rr


@merge_op.register_fake
def _(o1, lse1, partial, qg, norm_weight, norm_eps, heads, eps, score, key_norm):
    lead, norm = partial.shape[:-1], norm_eps is not None
    return (partial.new_empty(partial.shape), partial.new_empty(partial.shape if norm else 0),
            partial.new_empty((*lead, heads)), partial.new_empty((*lead, heads)),
            partial.new_empty(lead if key_norm else 0), partial.new_empty(lead if norm else 0))


@torch.library.custom_op("attnres::cpu_merge_backward", mutates_args=())
def merge_backward_op(grad: Tensor, partial: Tensor, qg: Tensor, norm_weight: Tensor | None,
                      h: Tensor, s2: Tensor, w: Tensor, r: Tensor, rr: Tensor,
                      norm_eps: float | None, heads: int, eps: float, score: str, key_norm: bool,
                      o1_needs: bool, lse1_needs: bool,
                      partial_needs: bool, qg_needs: bool, weight_needs: bool
                      ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """``merge_backward`` as an op: ``(d_o1, d_lse1, d_partial, d_qg, d_weight)``, empty where
    not needed; ``h``, ``s2``, ``w``, ``r``, ``rr`` as ``merge_op`` returned them (``h`` the
    output when it returned it empty)."""
    saved = MergeSaved(h, s2, w, _none_if_empty(r), _none_if_empty(rr))
    weight = None if norm_weight is None else norm_weight.contiguous()
    out = merge_backward(grad, partial.contiguous(), qg.contiguous(), weight, saved, heads=heads,
                         eps=eps, score=score, key_norm=key_norm, norm_eps=norm_eps,
                         o1_needs=o1_needs,
                         lse1_needs=lse1_needs, partial_needs=partial_needs, qg_needs=qg_needs,
                         weight_needs=weight_needs)
    return tuple(_or_empty(t, partial) for t in out)


@merge_backward_op.register_fake
def _(grad, partial, qg, norm_weight, h, s2, w, r, rr, norm_eps, heads, eps, score, key_norm,
      o1_needs, lse1_needs, partial_needs, qg_needs, weight_needs):
    weight_needs = weight_needs and rr.numel() > 0 and norm_weight is not None
    return (partial.new_empty(partial.shape if o1_needs else 0),
            s2.new_empty(s2.shape if lse1_needs and score == "softmax" else 0),
            partial.new_empty(partial.shape if partial_needs else 0),
            qg.new_empty(qg.shape if qg_needs else 0),
            qg.new_empty(qg.shape if weight_needs else 0))


def _merge_setup(ctx, inputs, output):
    _, _, partial, qg, norm_weight, norm_eps, heads, eps, score, key_norm = inputs
    out, h, s2, w, r, rr = output
    ctx.save_for_backward(partial, qg, norm_weight, out if norm_eps is None else h, s2, w, r, rr)
    ctx.options = dict(norm_eps=norm_eps, heads=heads, eps=eps, score=score, key_norm=key_norm)


def _merge_grads(ctx, grad, *_):
    partial, qg, norm_weight, h, s2, w, r, rr = ctx.saved_tensors
    o1_needs, lse1_needs, partial_needs, qg_needs, weight_needs, *_ = ctx.needs_input_grad
    grads = merge_backward_op(grad, partial, qg, norm_weight, h, s2, w, r, rr, o1_needs=o1_needs,
                              lse1_needs=lse1_needs, partial_needs=partial_needs, qg_needs=qg_needs,
                              weight_needs=weight_needs, **ctx.options)
    return (*(_none_if_empty(d) for d in grads), None, None, None, None, None)


merge_op.register_autograd(_merge_grads, setup_context=_merge_setup)


@torch.library.custom_op("attnres::cpu_source_grad", mutates_args=())
def source_grad_op(source: Tensor, inv_rms: Tensor | None, queries: list[Tensor],
                   lse: list[Tensor], ds: list[Tensor], grads: list[Tensor | None],
                   grad: Tensor | None, heads: int, score: str, key_norm: bool) -> Tensor:
    """``source_grad_kernel`` as an op (not differentiable)."""
    return source_grad_kernel(source, inv_rms, queries, lse, ds, grads, grad, heads=heads,
                              score=score, key_norm=key_norm)


@source_grad_op.register_fake
def _(source, inv_rms, queries, lse, ds, grads, grad, heads, score, key_norm):
    return source.new_empty(source.shape, dtype=queries[0].dtype)


@torch.library.custom_op("attnres::cpu_decode_read", mutates_args=())
def decode_read_op(sources: Tensor, count: int, query: Tensor, heads: int, eps: float, score: str,
                   key_norm: bool, base: Tensor | None, gate: float, norm_weight: Tensor | None,
                   norm_eps: float | None) -> Tensor:
    """``decode_kernel`` as an op (autograd off)."""
    return decode_kernel(sources, count, query, heads, eps, score, key_norm, base, gate,
                         norm_weight, norm_eps)


@decode_read_op.register_fake
def _(sources, count, query, heads, eps, score, key_norm, base, gate, norm_weight, norm_eps):
    return sources.new_empty(sources.shape[1:])


def attend_via_ops(queries, sources, gains=None, *, heads=1, eps=1e-6, score="softmax",
                   key_norm=True, norm=None, prepared=None):
    """``CpuOps.attend`` through ``attnres::cpu_attend``, what a compiled graph runs: the gain
    folded into the queries, the dtypes converted and the keys' inverse RMS computed around the
    op, by autograd and the compiler (the same numbers as the eager path). No ledger."""
    cached = _prepared(prepared, len(sources), key_norm)
    dt = sources[0].dtype
    sources = in_dtype(sources, dt)
    inv_rms = [key_inverse_rms(v, r, eps) for v, r in zip(sources, cached)] if key_norm else []
    weight, norm_eps = (None, None) if norm is None else (norm.weight, norm.eps)
    outs, lse, _ = attend_op(fold_gain(queries, gains, dt).contiguous(), sources, inv_rms, None,
                             None if weight is None else weight.to(dt), norm_eps, heads, score,
                             key_norm)
    if norm is not None:
        outs = (outs[0].to(_out_dtype(dt, weight, norm_eps)), *outs[1:])
    return tuple(outs), lse


def merge_via_ops(o1, lse, partial, query, gain=None, *, heads=1, eps=1e-6, score="softmax",
                  key_norm=True, norm=None):
    """``CpuOps.merge`` through ``attnres::cpu_merge``, what a compiled graph runs (the inputs
    converted to the kernels' dtype around the op, by autograd and the compiler)."""
    dt = compute_dtype(partial.dtype)
    weight, norm_eps = (None, None) if norm is None else (norm.weight, norm.eps)
    out = merge_op(o1.to(dt), lse.to(dt), partial.to(dt), fold_gain(query, gain, dt),
                   None if weight is None else weight.to(dt), norm_eps, heads, eps, score,
                   key_norm)[0]
    return out.to(_out_dtype(partial.dtype, weight, norm_eps))


def _prepared(prepared, n: int, key_norm: bool) -> tuple:
    """Each source's prepared inverse RMS (None where not given), checked against ``n`` sources."""
    cached = tuple(prepared) if prepared is not None and key_norm else (None,) * n
    if len(cached) != n:
        raise ValueError(f"prepared has {len(cached)} entries for {n} sources")
    return cached


# -- the backend ---------------------------------------------------------------------------------

class CpuOps(KeyStatisticsOps):
    """The ``cpu`` backend's operations (``ops.backends.BackendOps``): the kernels run directly
    in eager mode, and through the ``attnres::`` custom ops while ``torch.compile`` traces."""

    name = "cpu"

    def attend(self, queries, sources, gains=None, *, heads=1, eps=1e-6, score="softmax",
               key_norm=True, norm=None, prepared=None):
        """The ``torch`` backend's ``attend`` on the kernels: the same arguments and results (the
        first output through a norm with a gain in the dtype ``rms_norm`` promotes to)."""
        if torch.compiler.is_compiling():
            return attend_via_ops(queries, sources, gains, heads=heads, eps=eps, score=score,
                                  key_norm=key_norm, norm=norm, prepared=prepared)
        cached = _prepared(prepared, len(sources), key_norm)
        weight, norm_eps = (None, None) if norm is None else (norm.weight, norm.eps)
        options = ReadOptions(heads, eps, score, key_norm, norm_eps)
        *outs, lse = CpuDepthAttentionFunction.apply(queries, gains, weight, options, cached,
                                                     *sources)
        if norm is not None:
            outs[0] = outs[0].to(_out_dtype(outs[0].dtype, weight, norm_eps))
        return tuple(outs), lse

    def merge(self, o1, lse, partial, query, gain=None, *, heads=1, eps=1e-6, score="softmax",
              key_norm=True, norm=None):
        """The ``torch`` backend's ``merge`` on the kernels: ``h`` ``[..., D]``, or
        ``rms_norm(h, norm.weight, norm.eps)``. Without autograd nothing is kept, and with the norm
        ``h`` is never written to memory."""
        if torch.compiler.is_compiling():
            return merge_via_ops(o1, lse, partial, query, gain, heads=heads, eps=eps, score=score,
                                 key_norm=key_norm, norm=norm)
        weight, norm_eps = (None, None) if norm is None else (norm.weight, norm.eps)
        options = ReadOptions(heads, eps, score, key_norm, norm_eps)
        if torch.is_grad_enabled():
            return CpuMergeFunction.apply(o1, lse, partial, query, gain, weight, options)
        partial_dtype = partial.dtype
        o1, lse, partial, qg, weight_dt = _merge_inputs(o1, lse, partial, query, gain, weight)
        out, _ = merge_forward(o1, lse, partial, qg, weight_dt, heads=heads, eps=eps, score=score,
                               key_norm=key_norm, norm_eps=norm_eps, keep=False)
        return out.to(_out_dtype(partial_dtype, weight, norm_eps))

    @torch.no_grad()
    def attend_scored(self, scores, sources, *, score="softmax", norm=None):
        """``attend``'s ``(outs, lse)`` from precomputed logits (inference): the softmax, the sums
        and the norm in one pass of the kernels."""
        logits = stack_scores(scores, sources)
        weight, norm_eps = (None, None) if norm is None else (norm.weight, norm.eps)
        if torch.compiler.is_compiling():
            dt = sources[0].dtype
            outs, lse, _ = attend_op(None, in_dtype(sources, dt), [], logits.to(dt), weight,
                                     norm_eps, logits.shape[-1], score, False)
            return tuple(outs), lse
        norm = None if norm is None else (weight, norm_eps)
        outs, lse, _ = mix_forward(sources, None, None, logits.shape[-1], score, False, norm, logits=logits)
        return outs, lse

    def source_grad(self, source, inv_rms, reads, grad=None, *, heads=1, eps=1e-6, score="softmax",
                    key_norm=True):
        """A source's gradient from the reads that deferred it (``ops.source_ledger``), in one pass
        of the kernels: ``grad`` (or zeros) plus every read's terms. ``source`` ``[..., D]``,
        ``inv_rms`` ``[...]`` its inverse RMS (None without the key norm; ``eps`` is not read),
        ``reads`` a list of ``DeferredRead`` in the kernels' dtype. Returns ``[..., D]`` in the
        source's dtype. Its twin is the naive backend's ``source_grad``."""
        records = ([r.queries for r in reads], [r.lse for r in reads], [r.ds for r in reads],
                   [g for r in reads for g in r.grads])
        call = source_grad_op if torch.compiler.is_compiling() else source_grad_kernel
        out = call(source, inv_rms, *records, grad, heads=heads, score=score, key_norm=key_norm)
        return out.to(source.dtype)

    def decode_read(self, sources, count, query, *, heads=1, eps=1e-6, score="softmax",
                    key_norm=True, base=None, gate=0.0, norm=None):
        """One read of a decode pass in one kernel call (the naive backend's ``decode_read``: the
        same arguments and result), with autograd off: nothing here is differentiable.
        ``sources`` must be contiguous; ``query``, ``base`` and the norm's gain are read in the
        sources' dtype."""
        _check_decode(sources, count, query, heads, base, norm)
        weight, norm_eps = (None, None) if norm is None else (norm.weight, norm.eps)
        call = decode_read_op if torch.compiler.is_compiling() else decode_kernel
        return call(sources, count, query, heads, eps, score, key_norm, base, gate, weight, norm_eps)

    # The multi-stream operations on their kernels (``cpu_streams``); while ``torch.compile``
    # traces, the reference's PyTorch forms, which inductor fuses.

    def stream_mix(self, H, w):
        if torch.compiler.is_compiling():
            return stream_mix_naive(H, w)
        return cpu_streams.stream_mix(H, w)

    def stream_update(self, H, A, b, v, *, transposed=False):
        if torch.compiler.is_compiling():
            return stream_update_naive(H, A, b, v, transposed)
        return cpu_streams.stream_update(H, A, b, v, transposed)

    def gated_mix(self, R, z):
        if torch.compiler.is_compiling():
            return gated_mix_naive(R, z)
        return cpu_streams.gated_mix(R, z)

    def gated_mix_lowrank(self, R, h, up):
        if torch.compiler.is_compiling() or up.numel() * up.element_size() > cpu_streams.LOWRANK_KERNEL_BYTES:
            return super().gated_mix_lowrank(R, h, up)  # the product, then gated_mix's kernel
        return cpu_streams.gated_mix_lowrank(R, h, up)

    def rms_norm(self, x, weight, eps=1e-6):
        if torch.compiler.is_compiling():
            return RMSNormFunction.apply(x, weight, eps)
        return cpu_streams.rms_norm(x, weight, eps)

    def sinkhorn(self, logits, iterations=20):
        if torch.compiler.is_compiling():
            return sinkhorn(logits, iterations)
        return cpu_streams.sinkhorn(logits, iterations)


def _check_decode(sources, count, query, heads, base, norm) -> None:
    """``ValueError``/``RuntimeError`` for a decode read the kernel cannot take, before any work."""
    if torch.is_grad_enabled():
        raise RuntimeError("decode_read is for a decode pass, with autograd off (torch.no_grad()): "
                           "the kernel keeps nothing for a backward")
    if not sources.is_contiguous() or not 1 <= count <= sources.shape[0]:
        raise ValueError(f"decode_read reads the first count sources of a contiguous buffer "
                         f"[capacity, ..., D]: given count={count} of {tuple(sources.shape)}, "
                         f"contiguous={sources.is_contiguous()}")
    D = sources.shape[-1]
    gain = None if norm is None else norm.weight
    if query.shape != (D,) or D % heads or (gain is not None and gain.shape != (D,)):
        raise ValueError(f"decode_read: query {tuple(query.shape)} and the norm's gain must be "
                         f"[{D}], and heads={heads} must divide {D}")
    if base is not None and base.shape != sources.shape[1:]:
        raise ValueError(f"decode_read: base must be one source's shape "
                         f"{tuple(sources.shape[1:])}, given {tuple(base.shape)}")


OPS = CpuOps()
