"""The ``cpu`` backend: the operations of the ``torch`` backend on fused C++/OpenMP kernels for
fp32 and fp64 CPU tensors (the math runs in their dtype; other dtypes run on the ``torch``
backend).

A kernel does the per-token work of a pass in one sweep over the tokens (``csrc/``): a token's
rows of every source stay in cache while its logits, softmax, weighted sums and every gradient
term are computed, so forward reads each source once and backward once, where the PyTorch path
makes a pass over ``[tokens, D]`` memory per product and sum. The merge (phase 2 of the Block
computation), a deferred source's gradient, a decode read and the multi-stream designs' work
(``cpu_streams``) are one pass per direction too, with the next sublayer's pre-norm fused where
a read feeds it.

The kernels are PyTorch operators, ``attnres::cpu_*``, of a C++ extension built on first use
(``cpu_build``; their Python parts in ``cpu_ops``). In eager mode ``attend`` and ``merge`` call
them from autograd functions of their own (``cpu_autograd``), whose backward defers the
gradients of the sources an ``ops.source_ledger`` tracks; while ``torch.compile`` traces they
call them through the operators' own autograd formulas (``cpu_ops.attend_via_ops``,
``merge_via_ops``: the same numbers, no ledger), and the multi-stream operations run the
reference's PyTorch forms, which inductor fuses.

Shapes: queries and gains ``[S, D]``, sources ``N x [..., D]``, inverse RMS ``N x [...]``.
"""

from __future__ import annotations

import torch

from ..rmsnorm import RMSNormFunction
from . import cpu_streams
from .common import KeyStatisticsOps, checked_prepared, stack_scores
from .cpu_autograd import CpuDepthAttentionFunction, CpuMergeFunction, ReadOptions, merge_inputs
from .cpu_ops import attend_via_ops, in_dtype, kernels, merge_via_ops, out_dtype
from .naive import KernelStreamOps

__all__ = ["OPS", "CpuOps"]


class CpuOps(KeyStatisticsOps, KernelStreamOps):
    """The ``cpu`` backend's operations (``ops.backends.BackendOps``) on the kernels' operators."""

    name = "cpu"
    stream_kernels = cpu_streams

    def attend(self, queries, sources, gains=None, *, heads=1, eps=1e-6, score="softmax",
               key_norm=True, norm=None, prepared=None, logits=None):
        """The ``torch`` backend's ``attend`` on the kernels: the same arguments and results (the
        first output through a norm with a gain in the dtype ``rms_norm`` promotes to); given
        ``logits`` (scored when the sources were written), forward, backward and the sources'
        deferred gradients read them instead of scoring each token."""
        if torch.compiler.is_compiling():
            return attend_via_ops(queries, sources, gains, heads=heads, eps=eps, score=score,
                                  key_norm=key_norm, norm=norm, prepared=prepared)
        cached = checked_prepared(prepared, len(sources), key_norm)
        weight, norm_eps = (None, None) if norm is None else (norm.weight, norm.eps)
        options = ReadOptions(heads, eps, score, key_norm, norm_eps)
        *outs, lse = CpuDepthAttentionFunction.apply(queries, gains, weight, options, cached,
                                                     None if logits is None else logits.detach(), *sources)
        if norm is not None:
            outs[0] = outs[0].to(out_dtype(outs[0].dtype, weight, norm_eps))
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
        if torch.is_grad_enabled():
            options = ReadOptions(heads, eps, score, key_norm, norm_eps)
            return CpuMergeFunction.apply(o1, lse, partial, query, gain, weight, options)
        out = kernels().cpu_merge(*merge_inputs(o1, lse, partial, query, gain, weight), norm_eps, heads, eps,
                                  score, key_norm, False)[0]
        return out.to(out_dtype(partial.dtype, weight, norm_eps))

    @torch.no_grad()
    def attend_scored(self, scores, sources, *, score="softmax", norm=None):
        """``attend``'s ``(outs, lse)`` from precomputed logits (inference): the softmax, the sums
        and the norm in one pass of the kernels (the first output in the sources' dtype)."""
        logits = stack_scores(scores, sources)
        weight, norm_eps = (None, None) if norm is None else (norm.weight, norm.eps)
        dt = sources[0].dtype
        outs, lse, _ = kernels().cpu_attend(None, in_dtype(sources, dt), [], logits.to(dt), weight, norm_eps,
                                            logits.shape[-1], score, False)
        return tuple(outs), lse

    def source_grad(self, source, inv_rms, reads, grad=None, *, heads=1, eps=1e-6, score="softmax",
                    key_norm=True):
        """A source's gradient from the reads that deferred it (``ops.source_ledger``), in one pass
        of the kernels: ``grad`` (or zeros) plus every read's terms. ``source`` ``[..., D]``,
        ``inv_rms`` ``[...]`` its inverse RMS (None without the key norm; ``eps`` is not read),
        ``reads`` a list of ``DeferredRead`` in the kernels' dtype. Returns ``[..., D]`` in the
        source's dtype. Its twin is the naive backend's ``source_grad``."""
        out = kernels().cpu_source_grad(source, inv_rms, [r.queries for r in reads], [r.lse for r in reads],
                                        [r.ds for r in reads], [g for r in reads for g in r.grads], grad,
                                        heads, score, key_norm, [r.logits for r in reads])
        return out.to(source.dtype)

    def decode_read(self, sources, count, query, *, heads=1, eps=1e-6, score="softmax",
                    key_norm=True, base=None, gate=0.0, norm=None):
        """One read of a decode pass in one kernel call (the naive backend's ``decode_read``: the
        same arguments and result), with autograd off: nothing here is differentiable.
        ``sources`` must be contiguous; ``query``, ``base`` and the norm's gain are read in the
        sources' dtype."""
        check_decode(sources, count, query, heads, base, norm)
        weight, norm_eps = (None, None) if norm is None else (norm.weight, norm.eps)
        return kernels().cpu_decode_read(sources, count, query, heads, eps, score, key_norm, base, gate, weight,
                                         norm_eps)

    # The multi-stream operations on their kernels (KernelStreamOps: ``cpu_streams``; while
    # ``torch.compile`` traces, the reference's PyTorch forms, which inductor fuses).

    def gated_mix_lowrank(self, R, h, up):
        if torch.compiler.is_compiling() or up.numel() * up.element_size() > cpu_streams.LOWRANK_KERNEL_BYTES:
            return super().gated_mix_lowrank(R, h, up)  # the product, then gated_mix's kernel
        return cpu_streams.gated_mix_lowrank(R, h, up)

    def rms_norm(self, x, weight, eps=1e-6):
        if torch.compiler.is_compiling():
            return RMSNormFunction.apply(x, weight, eps)
        return cpu_streams.rms_norm(x, weight, eps)


def check_decode(sources, count, query, heads, base, norm) -> None:
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
