"""The CPU kernels' operators, ``attnres::cpu_*``, and what they have in Python.

The library that ``cpu_build`` builds and loads defines them (``csrc/cpu_ops.cpp``: a schema with
every argument named, and a CPU implementation that brings the tensors to the kernel's layout,
allocates the outputs and calls the kernel). Here: ``kernels()``, the operators with the library
loaded on first use; each depth-attention operator's fake (meta) implementation and, for the two
forward ones, its autograd formula (``register_autograd``: the backward operator), registered
once the library is loaded, so that ``torch.compile`` captures them in its graph as opaque ops;
and the ``cpu`` backend's ``attend`` and ``merge`` as a compiled graph calls them
(``attend_via_ops``, ``merge_via_ops``: the gain folded into the queries, the dtypes converted and
the keys' inverse RMS computed around the operator, where autograd and the compiler see it).

The operators (queries and gains ``[S, D]``, sources ``N x [..., D]`` and their inverse RMS
``N x [...]``, ``H`` heads; the tensors of one call in one dtype, fp32 or fp64, the sources in the
first one's):

- ``cpu_attend(qg, sources, inv_rms, logits, norm_weight, norm_eps, heads, score, key_norm)``:
  ``(outs, lse, norm_rr)``, ``S`` outputs ``[..., D]`` of the queries ``qg`` (the key-norm gain
  folded in) and ``lse`` ``[S, ..., H]``; with ``norm_eps`` the first output through the next
  sublayer's RMSNorm, ``norm_rr`` ``[..., 1]`` its inverse RMS. Given ``logits``
  ``[N, S, ..., H]`` (inference, or scored when each source was written), ``qg`` and ``inv_rms``
  are not read.
- ``cpu_attend_backward``: ``(d_qg, d_sources, d_weight, ds, g0)``; ``for_ledger``: also ``ds``
  ``[N, S, ..., H]``, dL/d logit per source, and ``g0`` ``[..., D]``, query 0's gradient before
  its fused norm (``cpu_autograd``); given ``logits``, the ones forward read, instead of scoring
  each token again.
- ``cpu_source_grad``: a source's gradient from the reads that deferred it to a ledger (given
  each read's ``logits`` of the source, ``[S, ..., H]``, those instead of scoring again).
- ``cpu_decode_read``: one read of a decode pass (``BackendOps.decode_read``).
- ``cpu_merge(o1, lse1, partial, qg, norm_weight, norm_eps, heads, eps, score, key_norm, keep)``:
  ``(out, h, s2, w, r, rr)``, phase 2 of the Block computation, ``h`` ``[..., D]`` or its norm, and
  with ``keep`` what backward reads (``h`` when ``out`` is its norm; ``s2``, ``w`` ``[..., H]``;
  the partial's inverse RMS ``r`` and ``h``'s ``rr`` ``[...]``).
- ``cpu_merge_backward``: ``(d_o1, d_lse1, d_partial, d_qg, d_weight)``.
- ``cpu_stream_mix``, ``cpu_stream_update``, ``cpu_gated_mix``, ``cpu_gated_mix_lowrank``,
  ``cpu_rms_norm``, ``cpu_sinkhorn`` and their ``_backward``: the multi-stream designs' work
  (``cpu_streams``). Eager only (while ``torch.compile`` traces, ``CpuOps`` runs the reference's
  PyTorch forms, which inductor fuses): they have no fake implementation.

An operator returns tensors, never None: an output not asked for, or absent, is empty
(``none_if_empty`` turns it back into None), and so are the inputs that come from such outputs.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch
from torch import Tensor

from . import cpu_build
from .common import checked_prepared, compute_dtype, fold_gain, key_inverse_rms
from .cpu_build import BuildError


@torch.compiler.assume_constant_result
def build_problem() -> str | None:
    """Why the CPU kernels cannot run here (``cpu_build.build_problem``), or None once their
    library is loaded and its operators' Python parts registered. While ``torch.compile`` traces,
    it runs outside the graph and its answer is a constant of the graph."""
    problem = cpu_build.build_problem()
    if problem is None:
        register()
    return problem


def kernels():
    """``torch.ops.attnres``, holding the kernels' operators: the library is built and loaded on
    the first call (``BuildError`` saying why it cannot be)."""
    problem = build_problem()
    if problem is not None:
        raise BuildError(problem)
    return torch.ops.attnres


_FAKES = {}


def fake(name: str):
    """Records the decorated function as operator ``attnres::<name>``'s fake implementation."""
    def record(fn):
        _FAKES[name] = fn
        return fn
    return record


@functools.cache
def register() -> None:
    """Gives the loaded operators their fake implementations and autograd formulas (once)."""
    for name, fn in _FAKES.items():
        torch.library.register_fake(f"attnres::{name}", fn)
    torch.library.register_autograd("attnres::cpu_attend", _attend_grads, setup_context=_attend_setup)
    torch.library.register_autograd("attnres::cpu_merge", _merge_grads, setup_context=_merge_setup)


def none_if_empty(t: Tensor | None) -> Tensor | None:
    """An operator's placeholder for an absent tensor (an empty one) as None."""
    return None if t is None or t.numel() == 0 else t


def in_dtype(sources: Sequence[Tensor], dt: torch.dtype) -> list[Tensor]:
    """The sources in one dtype, the first one's (the kernels read them through one pointer type)."""
    return [v if v.dtype == dt else v.to(dt) for v in sources]


def out_dtype(dtype: torch.dtype, norm_weight: Tensor | None, norm_eps: float | None) -> torch.dtype:
    """The dtype of a kernel's output computed in ``dtype``: that, or through a norm with a gain
    the dtype ``rms_norm`` promotes to."""
    if norm_eps is None or norm_weight is None:
        return dtype
    return torch.promote_types(dtype, norm_weight.dtype)


# -- the fake implementations: the outputs' shapes and dtypes ------------------------------------

@fake("cpu_attend")
def _(qg, sources, inv_rms, logits, norm_weight, norm_eps, heads, score, key_norm):
    v = sources[0]
    S = qg.shape[0] if logits is None else logits.shape[1]
    norm_rr = v.new_empty((0,) if norm_eps is None else (*v.shape[:-1], 1))
    return [v.new_empty(v.shape) for _ in range(S)], v.new_empty((S, *v.shape[:-1], heads)), norm_rr


@fake("cpu_attend_backward")
def _(grad_outs, grad_lse, qg, sources, inv_rms, lse, norm_weight, norm_rr, norm_eps, heads, score,
      key_norm, sources_need, qg_needs, weight_needs, for_ledger=False, logits=None):
    norm = norm_rr is not None and norm_rr.numel() > 0
    weight_needs = weight_needs and norm and norm_weight is not None and grad_outs[0] is not None
    g0 = for_ledger and norm and grad_outs[0] is not None
    return (qg.new_empty(qg.shape if qg_needs else 0),
            [v.new_empty(v.shape if need else 0) for v, need in zip(sources, sources_need)],
            qg.new_empty(norm_weight.shape if weight_needs else 0),
            qg.new_empty((len(sources), *lse.shape) if for_ledger else 0),
            qg.new_empty(sources[0].shape if g0 else 0))


@fake("cpu_source_grad")
def _(source, inv_rms, queries, lse, ds, grads, grad, heads, score, key_norm, logits):
    return source.new_empty(source.shape, dtype=queries[0].dtype)


@fake("cpu_decode_read")
def _(sources, count, query, heads, eps, score, key_norm, base, gate, norm_weight, norm_eps):
    return sources.new_empty(sources.shape[1:])


@fake("cpu_merge")
def _(o1, lse1, partial, qg, norm_weight, norm_eps, heads, eps, score, key_norm, keep=True):
    lead, norm = partial.shape[:-1], norm_eps is not None
    return (partial.new_empty(partial.shape), partial.new_empty(partial.shape if keep and norm else 0),
            partial.new_empty((*lead, heads) if keep else 0), partial.new_empty((*lead, heads) if keep else 0),
            partial.new_empty(lead if keep and key_norm else 0), partial.new_empty(lead if keep and norm else 0))


@fake("cpu_merge_backward")
def _(grad, partial, qg, norm_weight, h, s2, w, r, rr, norm_eps, heads, eps, score, key_norm,
      o1_needs, lse1_needs, partial_needs, qg_needs, weight_needs):
    weight_needs = weight_needs and rr.numel() > 0 and norm_weight is not None
    return (partial.new_empty(partial.shape if o1_needs else 0),
            s2.new_empty(s2.shape if lse1_needs and score == "softmax" else 0),
            partial.new_empty(partial.shape if partial_needs else 0),
            qg.new_empty(qg.shape if qg_needs else 0),
            qg.new_empty(qg.shape if weight_needs else 0))


# -- the autograd formulas of the forward operators ----------------------------------------------

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
    d_qg, d_sources, d_weight, _, _ = kernels().cpu_attend_backward(
        list(grad_outs), grad_lse, qg, sources, inv_rms, lse, norm_weight, norm_rr,
        sources_need=list(sources_need), qg_needs=qg_needs, weight_needs=weight_needs, **ctx.options)
    return (none_if_empty(d_qg), [d if need else None for d, need in zip(d_sources, sources_need)],
            [None] * len(inv_rms_need), None, none_if_empty(d_weight), None, None, None, None)


def _merge_setup(ctx, inputs, output):
    _, _, partial, qg, norm_weight, norm_eps, heads, eps, score, key_norm, keep = inputs
    if not keep:
        raise RuntimeError("attnres::cpu_merge with keep=False keeps nothing for a backward")
    out, h, s2, w, r, rr = output
    ctx.save_for_backward(partial, qg, norm_weight, out if norm_eps is None else h, s2, w, r, rr)
    ctx.options = dict(norm_eps=norm_eps, heads=heads, eps=eps, score=score, key_norm=key_norm)


def _merge_grads(ctx, grad, *_):
    partial, qg, norm_weight, h, s2, w, r, rr = ctx.saved_tensors
    o1_needs, lse1_needs, partial_needs, qg_needs, weight_needs, *_ = ctx.needs_input_grad
    grads = kernels().cpu_merge_backward(grad, partial, qg, norm_weight, h, s2, w, r, rr, o1_needs=o1_needs,
                                         lse1_needs=lse1_needs, partial_needs=partial_needs, qg_needs=qg_needs,
                                         weight_needs=weight_needs, **ctx.options)
    return (*(none_if_empty(d) for d in grads), None, None, None, None, None, None)


# -- what a compiled graph runs ------------------------------------------------------------------

def attend_via_ops(queries, sources, gains=None, *, heads=1, eps=1e-6, score="softmax",
                   key_norm=True, norm=None, prepared=None):
    """``CpuOps.attend`` through ``attnres::cpu_attend``, what a compiled graph runs: the gain
    folded into the queries, the dtypes converted and the keys' inverse RMS computed around the
    op, by autograd and the compiler (the same numbers as the eager path). No ledger."""
    cached = checked_prepared(prepared, len(sources), key_norm)
    dt = sources[0].dtype
    sources = in_dtype(sources, dt)
    inv_rms = [key_inverse_rms(v, r, eps) for v, r in zip(sources, cached)] if key_norm else []
    weight, norm_eps = (None, None) if norm is None else (norm.weight, norm.eps)
    outs, lse, _ = kernels().cpu_attend(fold_gain(queries, gains, dt).contiguous(), sources, inv_rms, None,
                                        None if weight is None else weight.to(dt), norm_eps, heads, score,
                                        key_norm)
    if norm is not None:
        outs = (outs[0].to(out_dtype(dt, weight, norm_eps)), *outs[1:])
    return tuple(outs), lse


def merge_via_ops(o1, lse, partial, query, gain=None, *, heads=1, eps=1e-6, score="softmax",
                  key_norm=True, norm=None):
    """``CpuOps.merge`` through ``attnres::cpu_merge``, what a compiled graph runs (the inputs
    converted to the kernels' dtype around the op, by autograd and the compiler)."""
    dt = compute_dtype(partial.dtype)
    weight, norm_eps = (None, None) if norm is None else (norm.weight, norm.eps)
    out = kernels().cpu_merge(o1.to(dt), lse.to(dt), partial.to(dt), fold_gain(query, gain, dt),
                              None if weight is None else weight.to(dt), norm_eps, heads, eps, score,
                              key_norm)[0]
    return out.to(out_dtype(partial.dtype, weight, norm_eps))
