"""The reference backend (``naive``): the specification written as plainly as possible.

The oracle every other backend is tested against (METHOD.md sections 2-4). It stacks the sources,
normalizes every one of them and materializes all logits; memory grows with the number of
sources, which is exactly what the other backends avoid. Autograd differentiates it as written.
It is the one backend that takes per-token queries ``[..., D]`` (the input-dependent ablation).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..rmsnorm import rms_norm
from ..sinkhorn import sinkhorn
from . import BackendOps


def _math_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)  # fp32, or fp64 for fp64


def depth_logits(query, sources, gain=None, *, heads=1, eps=1e-6, key_norm=True) -> tuple[torch.Tensor, torch.Tensor]:
    """``(logits, values)``: ``s[j, ..., h] = query[h] . K[j, ..., h]`` ``[N, ..., H]`` with
    ``K = RMSNorm_gain(V)`` (normalized over the full D, then split into ``heads`` contiguous
    slices of width ``D / heads``), and ``V = stack(sources)`` ``[N, ..., D]``, both in the math
    dtype (fp32, or fp64 for fp64 sources)."""
    dt = _math_dtype(sources[0].dtype)
    values = torch.stack(list(sources)).to(dt)  # [N, ..., D]
    keys = rms_norm(values, eps=eps) if key_norm else values
    if gain is not None:
        keys = keys * gain.to(dt)
    head_dim = values.shape[-1] // heads
    q = query.to(dt).unflatten(-1, (heads, head_dim))  # [H, Dh] or [..., H, Dh]
    return (keys.unflatten(-1, (heads, head_dim)) * q).sum(-1), values


def depth_attention_naive(
    query: torch.Tensor,
    sources: Sequence[torch.Tensor],
    gain: torch.Tensor | None = None,
    *,
    heads: int = 1,
    eps: float = 1e-6,
    score: str = "softmax",
    key_norm: bool = True,
    return_weights: bool = False,
):
    """Mix ``sources`` over depth with weights from one pseudo-query.

    Shapes: ``query`` ``[D]`` (or per token ``[..., D]``), each source ``[..., D]``, ``gain``
    ``[D]``. With the logits ``s`` of ``depth_logits``::

        alpha[j, ..., h] = softmax_j(s)             (or sigmoid(s) without normalization)
        out[..., h]      = sum_j alpha[j, ..., h] * V[j, ..., h]

    The output ``[..., D]`` is in the sources' dtype. With ``return_weights`` also returns
    ``alpha`` ``[N, ..., heads]`` (math dtype).
    """
    out, weights, _ = _route(query, sources, gain, heads, eps, score, key_norm)
    return (out, weights) if return_weights else out


def _route(query, sources, gain, heads, eps, score, key_norm):
    """``(out, weights, logits)`` of ``depth_attention_naive``."""
    logits, values = depth_logits(query, sources, gain, heads=heads, eps=eps, key_norm=key_norm)
    weights = torch.softmax(logits, dim=0) if score == "softmax" else torch.sigmoid(logits)
    mixed = (weights.unsqueeze(-1) * values.unflatten(-1, (heads, -1))).sum(0)  # [..., H, Dh]
    return mixed.flatten(-2).to(sources[0].dtype), weights, logits


def stream_mix_naive(H: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """``sum_k w[..., k] H[..., k, :]``: ``[..., n, D] x [..., n] -> [..., D]``."""
    return (w.unsqueeze(-1) * H).sum(-2)


def stream_update_naive(H: torch.Tensor, A: torch.Tensor | None, b: torch.Tensor, v: torch.Tensor,
                        transposed: bool = False) -> torch.Tensor:
    """``A @ H + b v`` per token (``A^T @ H`` when ``transposed``, ``H`` without ``A``):
    ``[..., n, D]``."""
    mixed = H if A is None else (A.transpose(-1, -2) if transposed else A) @ H
    return mixed + b.unsqueeze(-1) * v.unsqueeze(-2)


def gated_mix_naive(R: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
    """``mean_k(sigmoid(z_k) * R_k)``: ``[..., n, D] x [..., n, D] -> [..., D]``."""
    return (torch.sigmoid(z) * R).mean(-2)


class ReferenceStreamOps(BackendOps):
    """The multi-stream operations in the reference's PyTorch forms, which autograd
    differentiates as written and inductor fuses: the ``naive`` and ``torch`` backends' own."""

    def stream_mix(self, H, w):
        return stream_mix_naive(H, w)

    def stream_update(self, H, A, b, v, *, transposed=False):
        return stream_update_naive(H, A, b, v, transposed)

    def gated_mix(self, R, z):
        return gated_mix_naive(R, z)

    def sinkhorn(self, logits, iterations=20):
        return sinkhorn(logits, iterations)


class KernelStreamOps(ReferenceStreamOps):
    """The multi-stream operations on a fused backend's kernels, the functions of its module
    ``stream_kernels`` (``stream_mix``, ``stream_update``, ``gated_mix``, ``sinkhorn``); while
    ``torch.compile`` traces, the reference's forms, which inductor fuses."""

    stream_kernels = None

    def stream_mix(self, H, w):
        if torch.compiler.is_compiling():
            return super().stream_mix(H, w)
        return self.stream_kernels.stream_mix(H, w)

    def stream_update(self, H, A, b, v, *, transposed=False):
        if torch.compiler.is_compiling():
            return super().stream_update(H, A, b, v, transposed=transposed)
        return self.stream_kernels.stream_update(H, A, b, v, transposed)

    def gated_mix(self, R, z):
        if torch.compiler.is_compiling():
            return super().gated_mix(R, z)
        return self.stream_kernels.gated_mix(R, z)

    def sinkhorn(self, logits, iterations=20):
        if torch.compiler.is_compiling():
            return super().sinkhorn(logits, iterations)
        return self.stream_kernels.sinkhorn(logits, iterations)


def _normed(x: torch.Tensor, norm) -> torch.Tensor:
    return x if norm is None else rms_norm(x, norm.weight, norm.eps)


class NaiveOps(ReferenceStreamOps):
    """The reference backend's operations (``ops.backends.BackendOps``)."""

    name = "naive"

    def attend(self, queries, sources, gains=None, *, heads=1, eps=1e-6, score="softmax",
               key_norm=True, norm=None, prepared=None, logits=None):
        """``S`` queries ``[S, D]`` (or per token ``[S, ..., D]``) against ``sources``:
        ``(outs, lse)``, one ``[..., D]`` per query and the log-sum-exp of each query's logits
        ``[S, ..., H]`` (zeros for the sigmoid score). ``norm`` (``weight``, ``eps``): the first
        output through ``rms_norm``. ``prepared`` is not used (nothing is cached)."""
        outs, lses = [], []
        for s in range(queries.shape[0]):
            gain = None if gains is None else gains[s]
            out, _, logits = _route(queries[s], sources, gain, heads, eps, score, key_norm)
            outs.append(out)
            softmax = score == "softmax"
            lses.append(torch.logsumexp(logits, 0) if softmax else torch.zeros_like(logits[0]))
        outs[0] = _normed(outs[0], norm)
        return tuple(outs), torch.stack(lses)

    def merge(self, o1, lse, partial, query, gain=None, *, heads=1, eps=1e-6, score="softmax",
              key_norm=True, norm=None):
        """Phase 2 of the two-phase Block computation as docs/METHOD.md section 3 writes it: the
        partial source's logit ``s2`` per head, then ``h = (a o1 + b P) / (a + b)`` with
        ``a = exp(lse - m)``, ``b = exp(s2 - m)``, ``m = max(lse, s2)``; with the sigmoid score the
        plain sum ``o1 + sigmoid(s2) P``. Returns ``h`` ``[..., D]`` (partial's dtype), through
        ``norm`` when given."""
        s2, _ = depth_logits(query, [partial], gain, heads=heads, eps=eps, key_norm=key_norm)
        s2 = s2[0].unsqueeze(-1)  # [..., H, 1]
        o1h, ph = (t.to(s2.dtype).unflatten(-1, (heads, -1)) for t in (o1, partial))
        if score == "softmax":
            lse = lse.to(s2.dtype).unsqueeze(-1)
            m = torch.maximum(lse, s2)
            a, b = (lse - m).exp(), (s2 - m).exp()
            h = (a * o1h + b * ph) / (a + b)
        else:
            h = o1h + torch.sigmoid(s2) * ph
        return _normed(h.flatten(-2).to(partial.dtype), norm)

    def prepare(self, source, *, eps=1e-6, key_norm=True):
        """Nothing: every read normalizes its sources itself."""
        return None

    def decode_read(self, sources, count, query, *, heads=1, eps=1e-6, score="softmax",
                    key_norm=True, base=None, gate=0.0, norm=None):
        """One read of a decode pass (autograd off, one position per sequence): ``sources``
        ``[capacity, ..., D]`` holds the pass's sources one after another, and the first ``count``
        are read (the open block's partial sum last, when there is one). ``query`` ``[D]``: the
        site's pseudo-query with its key-norm gain folded in (``query * gain``). Returns
        ``sum_j alpha_j v_j`` ``[..., D]``, or ``base + gate * sum_j alpha_j v_j`` (Delta: ``base``
        ``[..., D]``, ``gate`` a number), through ``norm`` (``weight``, ``eps``) when given."""
        mixed = depth_attention_naive(query, list(sources[:count]), None, heads=heads, eps=eps,
                                      score=score, key_norm=key_norm)
        if base is not None:
            mixed = base + gate * mixed
        return _normed(mixed, norm)

    def source_grad(self, source, inv_rms, reads, grad=None, *, heads=1, eps=1e-6, score="softmax",
                    key_norm=True):
        """A source's gradient from the reads that deferred it (``ops.source_ledger``; the twin of
        the ``cpu`` backend's ``source_grad``), by autograd: each read ``s`` of ``reads`` (a list of
        ``DeferredRead``) adds the gradient of ``sum(ds * logit(v)) + sum(p * (g . v))`` per head,
        the logits recomputed from the source ``v`` (its key norm included), the weights ``p``
        (from those logits and the read's ``lse``) and ``ds = dL/d logit`` held fixed; plus ``grad``
        when given. ``inv_rms`` is not read: the key norm is recomputed with ``eps``. Returns
        ``[..., D]`` in the source's dtype."""
        dt = reads[0].queries.dtype
        with torch.enable_grad():
            v = source.detach().to(dt).requires_grad_()
            keys = (rms_norm(v, eps=eps) if key_norm else v).unflatten(-1, (heads, -1))  # [..H, Dh]
            values = v.unflatten(-1, (heads, -1))
            total = v.new_zeros(())
            for read in reads:
                for s, g in enumerate(read.grads):
                    logit = (keys * read.queries[s].unflatten(-1, (heads, -1))).sum(-1)  # [..., H]
                    total = total + (read.ds[s] * logit).sum()
                    if g is not None:
                        softmax = score == "softmax"
                        p = (logit - read.lse[s]).exp() if softmax else torch.sigmoid(logit)
                        gh = g.to(dt).unflatten(-1, (heads, -1))
                        total = total + (p.detach().unsqueeze(-1) * gh * values).sum()
            dv, = torch.autograd.grad(total, v)
        if grad is not None:
            dv = dv + grad.to(dt)
        return dv.to(source.dtype)

    def rms_norm(self, x, weight, eps=1e-6):
        return rms_norm(x, weight, eps)


OPS = NaiveOps()
