"""The ``cpu`` backend's ``attend`` and ``merge`` in eager mode: autograd functions that call the
kernels' operators (``cpu_ops``) themselves, so that ``attend``'s backward can leave the gradients
of the sources an ``ops.source_ledger`` tracks to the ledger. (The ledger follows tensors by
identity, which ``torch.compile``'s tracing does not keep: a compiled graph calls the operators
through their own autograd formulas and defers nothing.)

What ``attend`` keeps for backward: references to the sources, their inverse RMS, ``lse``
``[S, ..., H]`` and, with the fused norm, one inverse RMS per token; no ``[..., D]`` tensor of its
own (backward recomputes the first output, to rounding, when its norm needs it). The logits
``[N, S, ..., H]`` it keeps only when it was given them (scored when each source was written,
``ops.routing``): then forward, backward and the sources' deferred gradients read them; otherwise
each computes them again from the rows it reads anyway. A source
that a ledger tracks gets no gradient from ``attend``'s backward: the kernel writes ``dL/d logit``
and leaves the source a ``DeferredRead``, and ``CpuOps.source_grad`` forms the source's gradient
once every read of it has run its backward.

The merge (phase 2 of the Block computation) keeps ``h``, a reference to the partial sum and
numbers per token, as the PyTorch merge does.

Shapes: queries and gains ``[S, D]``, sources ``N x [..., D]``, inverse RMS ``N x [...]``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.autograd.function import once_differentiable

from ..source_ledger import DeferredRead, tracked
from .common import compute_dtype, depth_outputs, fold_gain, key_inverse_rms, split_query_grad
from .cpu_ops import in_dtype, kernels, none_if_empty, out_dtype


class ReadOptions(NamedTuple):
    """A read's options as ``CpuDepthAttentionFunction`` and ``CpuMergeFunction`` take them."""

    heads: int
    eps: float
    score: str
    key_norm: bool
    norm_eps: float | None  # the output's fused norm (None: no norm)


class CpuDepthAttentionFunction(torch.autograd.Function):
    """``attend`` on the kernels. Inputs: the queries ``[S, D]``, the gains ``[S, D]`` (or
    None), the norm's gain ``[D]`` (or None), ``ReadOptions``, each source's prepared inverse
    RMS (a tuple, entries may be None: computed here), the logits ``[N, S, ..., H]`` scored when
    the sources were written (or None: scored here, token by token), then the sources. Outputs:
    one ``[..., D]`` tensor per query (so that each gets its own gradient, and one the caller
    does not use costs nothing in backward), then ``lse``."""

    @staticmethod
    def forward(ctx, queries, gains, norm_weight, options: ReadOptions, prepared: tuple, logits, *given):
        dt = given[0].dtype
        ctx.source_dtypes = [v.dtype for v in given]
        sources = in_dtype(given, dt)
        heads, eps, score, key_norm, norm_eps = options
        inv_rms = [key_inverse_rms(v, r, eps) for v, r in zip(sources, prepared) if key_norm]
        qg = fold_gain(queries, gains, dt).contiguous()
        weight = None if norm_eps is None or norm_weight is None else norm_weight.to(dt)
        logits = None if logits is None else logits.to(dt).contiguous()
        outs, lse, norm_rr = kernels().cpu_attend(qg, sources, inv_rms, logits, weight, norm_eps, heads, score,
                                                  key_norm)
        # without given logits none are kept: backward computes them again, token by token
        ctx.save_for_backward(queries, gains, norm_weight, norm_rr, lse, logits, *inv_rms, *sources)
        ctx.options = options
        # the sources whose gradient a ledger forms: tracked by one whose reads compute as this one
        keys = dict(heads=heads, eps=eps, score=score, key_norm=key_norm)
        ctx.tracked = [None if t is None or not t[0].takes(keys, dt) else t
                       for t in map(tracked, given)]
        return depth_outputs(ctx, outs, lse, score)

    @staticmethod
    def backward(ctx, *grads):
        # a backward that builds a graph (create_graph) does not defer: the sources' gradients
        # come from here, marked as once differentiable, as every other gradient of the kernels
        return _depth_backward(ctx, not torch.is_grad_enabled(), *grads)


@once_differentiable  # the kernels' backward is not itself differentiable: say so, not return zeros
def _depth_backward(ctx, may_defer, *grads):
    """``CpuDepthAttentionFunction``'s backward; ``may_defer``: leave the gradients of the
    sources a ledger tracks to it (not while building a graph)."""
    queries, gains, norm_weight, norm_rr, lse, logits, *rest = ctx.saved_tensors
    options = ctx.options
    queries_need, gains_need, weight_need, _, _, _, *sources_need = ctx.needs_input_grad
    n = len(sources_need)
    inv_rms, sources = (rest[:n], rest[n:]) if options.key_norm else ([], rest)
    S, dt = queries.shape[0], sources[0].dtype
    g_outs = [None if g is None else g.to(dt).contiguous() for g in grads[:S]]
    # sources a ledger tracks get no gradient here: their terms are left to the ledger
    defer = [may_defer and need and t is not None for need, t in zip(sources_need, ctx.tracked)]
    qg = fold_gain(queries, gains, dt).contiguous()
    d_qg, d_sources, d_weight, ds, g0 = kernels().cpu_attend_backward(
        g_outs, grads[S], qg, sources, inv_rms, lse, norm_weight, norm_rr, options.norm_eps, options.heads,
        options.score, options.key_norm, [need and not d for need, d in zip(sources_need, defer)],
        queries_need or (gains is not None and gains_need), weight_need, any(defer), logits)
    if any(defer):
        g0 = none_if_empty(g0)
        reads_grads = (g0 if g0 is not None else g_outs[0], *g_outs[1:])
        for j in (j for j, d in enumerate(defer) if d):
            ledger, index = ctx.tracked[j]
            ledger.defer(index, DeferredRead(qg, lse, ds[j], reads_grads, None if logits is None else logits[j]))
    d_queries = d_gains = None
    if d_qg.numel():
        d_queries, d_gains = split_query_grad(d_qg, queries, gains, queries_need, gains_need)
    d_weight = cast(none_if_empty(d_weight), None if norm_weight is None else norm_weight.dtype)
    d_sources = [cast(none_if_empty(d), t) for d, t in zip(d_sources, ctx.source_dtypes)]
    return (d_queries, d_gains, d_weight, None, None, None, *d_sources)


def merge_inputs(o1, lse1, partial, query, gain, norm_weight):
    """The merge's inputs, contiguous, in the dtype the kernels compute in: the partial's
    (fp32 for a half-precision partial, as the ``torch`` backend computes it)."""
    dt = compute_dtype(partial.dtype)
    return (o1.to(dt).contiguous(), lse1.to(dt).contiguous(), partial.to(dt).contiguous(),
            fold_gain(query, gain, dt).contiguous(),
            None if norm_weight is None else norm_weight.to(dt).contiguous())


class CpuMergeFunction(torch.autograd.Function):
    """``merge`` on the kernels, with autograd: the inputs of the ``torch`` backend's
    ``MergeFunction``, then ``ReadOptions``."""

    @staticmethod
    def forward(ctx, o1, lse1, partial, query, gain, norm_weight, options: ReadOptions):
        partial_dtype = partial.dtype
        o1c, lse1c, partial, qg, weight = merge_inputs(o1, lse1, partial, query, gain, norm_weight)
        heads, eps, score, key_norm, norm_eps = options
        out, h, s2, w, r, rr = kernels().cpu_merge(o1c, lse1c, partial, qg, weight, norm_eps, heads, eps, score,
                                                   key_norm, True)
        ctx.save_for_backward(partial, query, gain, norm_weight, out if norm_eps is None else h, s2, w, r, rr)
        ctx.options, ctx.dtypes = options, (o1.dtype, lse1.dtype, partial_dtype)
        return out.to(out_dtype(partial_dtype, norm_weight, norm_eps))

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        partial, query, gain, norm_weight, *saved = ctx.saved_tensors
        (heads, eps, score, key_norm, norm_eps), (o1_dtype, lse1_dtype, partial_dtype) = ctx.options, ctx.dtypes
        o1_need, lse1_need, partial_need, query_need, gain_need, weight_need, _ = ctx.needs_input_grad
        dt = partial.dtype
        qg = fold_gain(query, gain, dt).contiguous()
        weight = None if norm_weight is None else norm_weight.to(dt).contiguous()
        d_o1, d_lse1, d_partial, d_qg, d_weight = kernels().cpu_merge_backward(
            g, partial, qg, weight, *saved, norm_eps, heads, eps, score, key_norm, o1_need, lse1_need,
            partial_need, query_need or (gain is not None and gain_need), weight_need)
        d_query = d_gain = None
        if d_qg.numel():
            d_query, d_gain = split_query_grad(d_qg[None], query[None], gain, query_need, gain_need)
            d_query = None if d_query is None else d_query[0]
            d_gain = None if d_gain is None else d_gain[0]
        d_weight = None if norm_weight is None else cast(none_if_empty(d_weight), norm_weight.dtype)
        return (cast(none_if_empty(d_o1), o1_dtype), cast(none_if_empty(d_lse1), lse1_dtype),
                cast(none_if_empty(d_partial), partial_dtype), d_query, d_gain, d_weight, None)


def cast(t: Tensor | None, dtype) -> Tensor | None:
    """``t`` in ``dtype``; None stays None."""
    return None if t is None else t.to(dtype)
