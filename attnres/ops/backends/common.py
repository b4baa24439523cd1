"""Math shared by the ``torch`` and ``cpu`` backends: the gain folded into the query, a source's
inverse RMS, the logits of one source against many queries, and the glue of their autograd ops.

The key-norm gain is folded into the query (``w . (k * RMSNorm(v)) = (w * k) . RMSNorm(v)``), so
a source is normalized by one scalar per token, its inverse RMS ``r = rsqrt(mean(v^2) + eps)``,
shared by every query and head that reads it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F

from . import BackendOps

#: up to this many query-head rows, logits come from one block-diagonal matrix (the fast thin
#: GEMM there); beyond, per head without the H-fold zeros (timings: docs/BENCHMARKS.md, "Tuning")
BLOCK_DIAGONAL_ROWS = 16


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the routing math runs in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def fold_gain(query: torch.Tensor, gain: torch.Tensor | None, dt: torch.dtype) -> torch.Tensor:
    """``query * gain`` in ``dt`` (the key-norm gain folded into the query, ``[..., D]``)."""
    return query.to(dt) if gain is None else query.to(dt) * gain.to(dt)


def inverse_rms(v: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Inverse RMS of the keys, ``[..., D] -> [...]`` in the compute dtype:
    ``rsqrt(mean(v^2) + eps)``, what the key norm multiplies a source by.

    A cache of values, not a differentiable input: computed once per source and passed to every
    read of it; each read's backward differentiates through the norm itself (in the same pass
    that reads ``v`` for the other terms)."""
    with torch.no_grad():
        vf = v.to(compute_dtype(v.dtype))
        return torch.rsqrt(torch.linalg.vector_norm(vf, dim=-1).square() / v.shape[-1] + eps)


def prepare(source: torch.Tensor, *, eps: float = 1e-6, key_norm: bool = True) -> torch.Tensor | None:
    """What a source keeps between reads: its inverse RMS ``[...]`` (None without the key norm)."""
    return inverse_rms(source, eps) if key_norm else None


def key_inverse_rms(v: torch.Tensor, prepared: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``v``'s inverse RMS in the compute dtype: the ``prepared`` one when given, else computed."""
    return inverse_rms(v, eps) if prepared is None else prepared.to(compute_dtype(v.dtype))


def head_matrix(qg: torch.Tensor, heads: int) -> torch.Tensor:
    """Block-diagonal ``[S*H, D]``: row ``(s, h)`` holds ``qg[s]``'s slice ``h`` in columns
    ``h*Dh:(h+1)*Dh`` and zeros elsewhere, so ``F.linear(v, head_matrix)`` gives every query's
    per-head logit at once (a contiguous ``[out, in]`` weight: the fast layout for a thin GEMM)."""
    S, D = qg.shape
    dh = D // heads
    eye = torch.eye(heads, dtype=qg.dtype, device=qg.device)
    blocks = qg.view(S, 1, heads, dh) * eye.view(1, heads, heads, 1)  # [S, H, H', Dh]
    return blocks.reshape(S * heads, D)


def scoring_weights(qg: torch.Tensor, heads: int) -> torch.Tensor:
    """What ``source_logits`` multiplies a source by, from the gain-folded queries ``qg``
    ``[S, D]``: ``qg`` itself for one head; the block-diagonal ``head_matrix`` for at most
    ``BLOCK_DIAGONAL_ROWS`` query-head rows; else ``qg`` per head ``[S, H, Dh]``."""
    S, D = qg.shape
    if heads == 1:
        return qg
    if S * heads <= BLOCK_DIAGONAL_ROWS:
        return head_matrix(qg, heads)
    return qg.view(S, heads, D // heads)


def source_logits(v: torch.Tensor, weights: torch.Tensor, heads: int,
                  inv_rms: torch.Tensor | None = None) -> torch.Tensor:
    """Per-head logits ``[..., S, H]`` of one source ``v`` ``[..., D]`` (compute dtype) against
    ``scoring_weights``, times the source's inverse RMS ``[...]`` when given (the key norm)."""
    if weights.ndim == 2:
        raw = F.linear(v, weights).unflatten(-1, (-1, heads))
    else:
        raw = torch.einsum("...hd,shd->...sh", v.unflatten(-1, (heads, v.shape[-1] // heads)), weights)
    return raw if inv_rms is None else raw * inv_rms[..., None, None]


@torch.no_grad()
def score_source(source, queries, gains=None, *, heads=1, eps=1e-6, key_norm=True, prepared=None) -> torch.Tensor:
    """Logits ``[..., K, H]`` (compute dtype) of one source ``[..., D]`` for ``K`` queries
    ``[K, D]`` with key-norm gains ``[K, D]`` (or None), per head:
    ``s[k, h] = (q_k * g_k)[h] . (v * rsqrt(mean(v^2) + eps))[h]``. Inference only.

    A source's logit for a query does not depend on the other sources, so each source can be
    scored once, in one matmul, against every site that will read it; ``prepared`` is its
    inverse RMS (computed here when None)."""
    dt = compute_dtype(source.dtype)
    inv_rms = key_inverse_rms(source, prepared, eps) if key_norm else None
    weights = scoring_weights(fold_gain(queries, gains, dt), heads)
    return source_logits(source.to(dt), weights, heads, inv_rms)


def stack_scores(scores: Sequence[torch.Tensor], sources: Sequence[torch.Tensor]) -> torch.Tensor:
    """The logits ``[N, S, ..., H]`` of ``S`` queries from each source's ``[..., S, H]`` scores
    (a score row shared by every token, Delta's null source, is expanded)."""
    if len(scores) != len(sources):
        raise ValueError(f"{len(scores)} score tensors for {len(sources)} sources")
    lead = sources[0].shape[:-1]
    S, H = scores[0].shape[-2:]
    return torch.stack([s.expand(*lead, S, H) for s in scores]).movedim(-2, 1)


def split_query_grad(d_qg, query, gain, needs_query, needs_gain):
    """``(d_query, d_gain)`` ``[S, D]`` from ``d(query * gain)`` ``[S, D]``; None where not needed."""
    d_query = d_gain = None
    if needs_query:
        d_query = (d_qg if gain is None else d_qg * gain.to(d_qg.dtype)).to(query.dtype)
    if gain is not None and needs_gain:
        d_gain = (d_qg * query.to(d_qg.dtype)).to(gain.dtype)
    return d_query, d_gain


def checked_prepared(prepared, n: int, key_norm: bool) -> tuple:
    """Each source's prepared inverse RMS (None where not given, and all None without the key
    norm), checked against ``n`` sources."""
    cached = tuple(prepared) if prepared is not None and key_norm else (None,) * n
    if len(cached) != n:
        raise ValueError(f"prepared has {len(cached)} entries for {n} sources")
    return cached


def depth_outputs(ctx, outs, lse: torch.Tensor, score: str) -> tuple:
    """What a depth-attention autograd function returns, ``(*outs, lse)``: an output that gets no
    gradient gets None in backward, not zeros, and the sigmoid score's ``lse`` (zeros) is not
    differentiable."""
    ctx.set_materialize_grads(False)
    if score != "softmax":
        ctx.mark_non_differentiable(lse)
    return (*outs, lse)


def apply_depth_function(function, queries, sources, gains, heads, eps, score, key_norm, prepared, norm):
    """``attend``'s arguments passed to ``function`` (an ``autograd.Function`` taking the queries,
    gains, norm weight, options, ``n``, then ``n`` sources and ``n`` prepared inverse RMS), and
    ``(outs, lse)`` taken from its flat outputs."""
    n = len(sources)
    cached = checked_prepared(prepared, n, key_norm)
    norm_weight, norm_eps = (norm.weight, norm.eps) if norm is not None else (None, None)
    *outs, lse = function.apply(queries, gains, norm_weight, heads, eps, score, key_norm, norm_eps, n, *sources, *cached)
    return tuple(outs), lse


class KeyStatisticsOps(BackendOps):
    """What the ``torch`` and ``cpu`` backends share: a source prepared as its inverse RMS, and
    on the inference path scored once against every later site."""

    def prepare(self, source, *, eps=1e-6, key_norm=True):
        """The source's inverse RMS ``[...]`` (None without the key norm)."""
        return prepare(source, eps=eps, key_norm=key_norm)

    def score_source(self, source, queries, gains=None, *, heads=1, eps=1e-6, key_norm=True,
                     prepared=None):
        """The source's logits ``[..., K, H]`` for ``K`` queries (``common.score_source``)."""
        return score_source(source, queries, gains, heads=heads, eps=eps, key_norm=key_norm,
                            prepared=prepared)
