"""Memory-efficient depth attention in PyTorch (the ``torch`` backend).

One ``autograd.Function`` serves every AttnRes read: ``S`` queries (one for an ordinary read; all
queries of a block for the two-phase Block computation, SPEC section 3) against a list of sources
that is never stacked. What it keeps for backward:

- references to the sources (they live in the residual state anyway, so this costs nothing);
- the first query's output (its consumer, the sublayer's pre-norm, keeps it too); the other
  queries' outputs feed two-phase merges and are not kept (backward recovers what it needs
  from the sources);
- per-token fp32 statistics: the logits ``[N, S, ..., H]``, the log-sum-exp ``[S, ..., H]`` and
  the inverse RMS ``[N, ...]``; all of size ``O(N S H)`` per token instead of the ``O(N D)``
  stacked, normalized keys of the reference path.

The key-norm gain is folded into the query (``w . (k * RMSNorm(v)) = (w * k) . RMSNorm(v)``), so a
source is normalized by one scalar per token, its inverse RMS ``r = rsqrt(mean(v^2) + eps)``,
shared by all ``S`` queries and ``H`` heads, and the logits of all queries and heads come out of
one matmul against a block-diagonal query matrix ``[S H, D]``. A stream computes ``r`` once per
source (``inverse_rms``) and hands it to every read of that source (SPEC section 11: normalize
each source once).

Forward sweeps the sources twice (logits, then the weighted sum); backward once, plus one
sweep when an output was not kept (to recompute ``out_0`` or recover ``g . out``).

Shapes: queries ``[S, D]``, gains ``[S, D]`` or None, sources ``N x [..., D]``, inverse RMS
``N x [...]``; returns ``S x [..., D]`` (sources' dtype) and ``lse`` ``[S, ..., H]`` (fp32).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F

from .rmsnorm import rms_norm_backward, rms_norm_forward


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype the routing math runs in: fp32, or fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


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
    ``[S, D]``: ``qg`` itself for one head; for few rows (``S*H <= 16``) the block-diagonal
    ``head_matrix``, one thin GEMM, the fastest form there; else ``qg`` per head ``[S, H, Dh]``,
    without the ``H``-fold zeros (``[2048, 512]`` against 17 queries x 8 heads: 0.8 ms per head
    against 2.6 ms block-diagonal; against 2 x 8: 0.6 ms against 0.4 ms)."""
    S, D = qg.shape
    if heads == 1:
        return qg
    if S * heads <= 16:
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


def fold_gain(query: torch.Tensor, gain: torch.Tensor | None, dt: torch.dtype) -> torch.Tensor:
    """``query * gain`` in ``dt`` (the key-norm gain folded into the query, ``[..., D]``)."""
    return query.to(dt) if gain is None else query.to(dt) * gain.to(dt)


def query_grads(d_qg, query, gain, needs_query, needs_gain):
    """Split ``d(query * gain)`` ``[S, H, H', Dh]`` (the block-diagonal ``c^T v`` of every
    head against every slice) into ``(d_query, d_gain)`` ``[S, D]``, keeping each head's own
    slice (the diagonal over ``(H, H')``); None where not needed."""
    S, H, _, dh = d_qg.shape
    d_qg = d_qg.diagonal(dim1=1, dim2=2).permute(0, 2, 1).reshape(S, H * dh)
    return split_query_grad(d_qg, query, gain, needs_query, needs_gain)


def split_query_grad(d_qg, query, gain, needs_query, needs_gain):
    """``(d_query, d_gain)`` ``[S, D]`` from ``d(query * gain)`` ``[S, D]``; None where not needed."""
    d_query = d_gain = None
    if needs_query:
        d_query = (d_qg if gain is None else d_qg * gain.to(d_qg.dtype)).to(query.dtype)
    if gain is not None and needs_gain:
        d_gain = (d_qg * query.to(d_qg.dtype)).to(gain.dtype)
    return d_query, d_gain


def inverse_rms(v: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """Inverse RMS of the keys, ``[..., D] -> [...]`` in the compute dtype:
    ``rsqrt(mean(v^2) + eps)``, what the key norm multiplies a source by.

    A cache of values, not a differentiable input: a stream computes it once per source and
    passes it to every read of that source, and each read's backward differentiates through
    the norm itself (in the same pass that reads ``v`` for the other terms)."""
    with torch.no_grad():
        vf = v.to(compute_dtype(v.dtype))
        return torch.rsqrt(torch.linalg.vector_norm(vf, dim=-1).square() / v.shape[-1] + eps)


def key_inverse_rms(v: torch.Tensor, cached: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``v``'s inverse RMS in the compute dtype: the ``cached`` one when given, else computed."""
    return inverse_rms(v, eps) if cached is None else cached.to(compute_dtype(v.dtype))


def head_dots(a: torch.Tensor, b: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Per-head dot products ``a . b`` over the last dim, ``[..., H, Dh] -> [..., H]``, with the
    elementwise product written into ``scratch`` (same shape as ``a``), a buffer reused across
    calls: a fresh ``[..., D]`` temporary per call (what ``linalg.vecdot`` makes) costs more
    than the product itself, as its pages are touched anew (``[2048, 512]`` fp32: 2.1 ms per
    call inside a backward, against 0.3 ms for the in-place ops around it)."""
    return torch.mul(a, b, out=scratch).sum(-1)


def _weighted_sums(weights, sources, lead, H, dh):
    """``out_s = sum_j weights[j, s] * sources[j]`` for every query ``s``: weights ``[N, S, ..., H]``
    -> ``S x [..., H, Dh]`` in the weights' dtype.

    One accumulator per query, visited source by source (each source is converted once): a
    single ``[S, ..., D]`` accumulator is no faster, and slower when the sources sit in cache
    (9 sources, 2 queries, ``[1024, 512]``: 2.7 ms against 1.7 ms). Per query the products and
    their order are the same either way. The first product allocates each accumulator."""
    weights = weights.unsqueeze(-1)
    accs = []
    for j, v in enumerate(sources):
        vh = v.to(weights.dtype).view(*lead, H, dh)
        for s in range(weights.shape[1]):
            if j == 0:
                accs.append(weights[0, s] * vh)
            else:
                accs[s].addcmul_(weights[j, s], vh)
    return accs


def _stacked_weighted_sums(weights, sources, lead, H, dh):
    """``_weighted_sums`` as one product and one sum over the stacked sources: fewer ops for a
    few tokens (decoding), where each op costs its dispatch; it sums in another order."""
    stacked = torch.stack([v.to(weights.dtype) for v in sources]).view(len(sources), 1, *lead, H, dh)
    return (weights.unsqueeze(-1) * stacked).sum(0).unbind(0)


def mix_logits(logits, sources, score, lead, H, dh, stacked=False):
    """``(outs, lse)`` from the logits ``[N, S, ..., H]``: the depth softmax (or the
    sigmoid ablation, with ``lse`` zero) and one ``[..., D]`` output per query in the sources'
    dtype. ``stacked`` sums over stacked sources (``_stacked_weighted_sums``)."""
    if score == "softmax":
        lse = torch.logsumexp(logits, dim=0)  # [S, ..., H]
        weights = (logits - lse).exp_()
    else:
        lse = torch.zeros_like(logits[0])
        weights = torch.sigmoid(logits)
    accs = (_stacked_weighted_sums if stacked else _weighted_sums)(weights, sources, lead, H, dh)
    outs = tuple(acc.view(*lead, H * dh).to(sources[0].dtype) for acc in accs)
    return outs, lse


class DepthAttentionFunction(torch.autograd.Function):
    """Inputs after the options: ``N`` sources, then ``N`` cached inverse RMS (or None, computed
    here; used only when ``key_norm``). Outputs: one ``[..., D]`` tensor per query (so that
    each gets its own gradient, and one the caller does not use costs nothing in backward),
    then ``lse`` ``[S, ..., H]``.

    With ``norm_eps`` set, the first output is returned through the sublayer's pre-norm,
    ``rms_norm(out_0, norm_weight, norm_eps)``: then no output is kept at all, and backward
    recomputes ``out_0`` with one more sweep over the sources.
    """

    @staticmethod
    def forward(ctx, queries, gains, norm_weight, heads, eps, score, key_norm, norm_eps, n, *tensors):
        sources, cached = tensors[:n], tensors[n:]
        S, D = queries.shape
        H, dh = heads, D // heads
        dt = compute_dtype(sources[0].dtype)
        lead = sources[0].shape[:-1]
        weights = scoring_weights(fold_gain(queries, gains, dt), H)
        logits, inv_rms = [], []
        for v, r in zip(sources, cached):
            if key_norm:
                r = key_inverse_rms(v, r, eps)
                inv_rms.append(r)
            logits.append(source_logits(v.to(dt), weights, H, r if key_norm else None))
        logits = torch.stack(logits).movedim(-2, 1)  # [N, S, ..., H]
        outs, lse = mix_logits(logits, sources, score, lead, H, dh)
        inv_rms = torch.stack(inv_rms) if key_norm else None
        # At most the first output is kept, and only when its consumer (the pre-norm) keeps it
        # anyway. The others feed two-phase merges, which do not keep them; backward recovers
        # g . out from the sources.
        kept, norm_rr = outs[0], None
        if norm_eps is not None:
            y0, norm_rr = rms_norm_forward(outs[0], norm_weight, norm_eps, in_place=True)
            outs = (y0, *outs[1:])
            kept = None
        ctx.save_for_backward(queries, gains, norm_weight, norm_rr, lse, logits, inv_rms, kept, *sources)
        ctx.config = (H, score, key_norm, n)
        ctx.set_materialize_grads(False)
        if score != "softmax":
            ctx.mark_non_differentiable(lse)
        return (*outs, lse)

    @staticmethod
    def backward(ctx, *grads):
        queries, gains, norm_weight, norm_rr, lse, logits, inv_rms, out0, *sources = ctx.saved_tensors
        H, score, key_norm, n = ctx.config
        S, D = queries.shape
        g_outs, g_lse = grads[:S], grads[S]
        dh = D // H
        dt = logits.dtype
        lead = sources[0].shape[:-1]
        probs = (logits - lse).exp() if score == "softmax" else torch.sigmoid(logits)  # [N, S, ..., H]
        live = [s for s in range(S) if g_outs[s] is not None]  # queries whose output is used
        gh = {s: g_outs[s].to(dt).view(*lead, H, dh) for s in live if s > 0}
        # Queries whose output was not kept need g . out = sum_j p_j (g . v_j) before the softmax
        # Jacobian can be applied, and a fused first norm needs out_0 itself: one first sweep over
        # the sources computes both.
        recompute = norm_rr is not None
        unkept = list(gh) if score == "softmax" else []
        gv_all = torch.zeros_like(probs) if unkept else None  # g . v_j per source, query and head
        scratch = torch.empty(*lead, H, dh, dtype=dt, device=queries.device)
        acc0 = None
        if recompute or unkept:
            for j, v in enumerate(sources):
                vh = v.to(dt).view(*lead, H, dh)
                if recompute:  # the same products in the same order as forward: the same out_0
                    w0 = probs[j, 0].unsqueeze(-1)
                    acc0 = w0 * vh if acc0 is None else acc0.addcmul_(w0, vh)
                for s in unkept:
                    gv_all[j, s] = head_dots(gh[s], vh, scratch)
        d_norm_weight = None
        if recompute:
            out0 = acc0.view(*lead, D).to(sources[0].dtype)
        if 0 in live:
            g0 = g_outs[0]
            if recompute:  # the pre-norm's backward on the recomputed out_0
                g0, d_norm_weight = rms_norm_backward(g0, out0, norm_weight, norm_rr, ctx.needs_input_grad[2])
            gh[0] = g0.to(dt).view(*lead, H, dh)
        qgh = fold_gain(queries, gains, dt).view(S, H, dh)
        if score == "softmax":
            # d logit_j = p_j * (g . v_j - g . out + g_lse), per query and head (softmax Jacobian)
            centre = torch.zeros_like(lse)
            if 0 in live:
                centre[0] = head_dots(gh[0], out0.to(dt).view(*lead, H, dh), scratch)
            if unkept:
                centre[unkept] = (probs[:, unkept] * gv_all[:, unkept]).sum(0)
            if g_lse is not None:
                centre -= g_lse
        need_src = ctx.needs_input_grad[9:9 + n]
        need_q = ctx.needs_input_grad[0] or (gains is not None and ctx.needs_input_grad[1])
        d_qg = torch.zeros(S * H, D, dtype=dt, device=queries.device) if need_q else None
        src_grads = [None] * n
        for j, v in enumerate(sources):
            if not (need_src[j] or need_q):
                continue
            vf = v.to(dt)
            vh = vf.view(*lead, H, dh)
            s_j, p = logits[j], probs[j]  # [S, ..., H]
            gv = gv_all[j] if unkept else torch.zeros_like(p)  # g . v_j per query and head
            for s in live:
                if s not in unkept:
                    gv[s] = head_dots(gh[s], vh, scratch)
            ds = (gv - centre).mul_(p) if score == "softmax" else gv.mul_(p * (1 - p))
            c = ds * inv_rms[j].unsqueeze(-1) if key_norm else ds  # d(raw logit), [S, ..., H]
            if need_q:
                # d qg[s, h-slice] = sum_tokens c[s, h] * v[h-slice]: the block diagonal of c^T v
                d_qg.addmm_(c.movedim(0, -2).reshape(-1, S * H).T, vf.reshape(-1, D))
            if not need_src[j]:
                continue
            # logit path c[s] (x) qg[s] and value path p[s] g[s], per head: broadcast
            # multiply-adds (a thin [tokens, S*H] @ [S*H, D] matmul is slower on CPU)
            dv = c[0].unsqueeze(-1) * qgh[0]
            for s in range(1, S):
                dv.addcmul_(c[s].unsqueeze(-1), qgh[s])
            for s in live:
                dv.addcmul_(gh[s], p[s].unsqueeze(-1))
            dv = dv.view(*lead, D)
            if key_norm:  # logit = raw * r with d r / d v = -r^3 v / D
                coef = (ds * s_j).sum(dim=(0, -1)).mul_(inv_rms[j].square()).div_(-D)  # [...]
                dv.addcmul_(vf, coef.unsqueeze(-1))
            src_grads[j] = dv.to(v.dtype)
        d_queries = d_gains = None
        if need_q:
            d_queries, d_gains = query_grads(d_qg.view(S, H, H, dh), queries, gains, *ctx.needs_input_grad[:2])
        return (d_queries, d_gains, d_norm_weight, *([None] * 6), *src_grads, *([None] * n))


def depth_attention_multi(
    queries: torch.Tensor,
    sources: Sequence[torch.Tensor],
    gains: torch.Tensor | None = None,
    *,
    heads: int = 1,
    eps: float = 1e-6,
    score: str = "softmax",
    key_norm: bool = True,
    inv_rms: Sequence[torch.Tensor | None] | None = None,
    norm: tuple[torch.Tensor | None, float] | None = None,
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``S`` queries ``[S, D]`` against ``sources``: ``(outs, lse)``, ``outs`` one ``[..., D]``
    per query, ``lse`` ``[S, ..., H]``.

    ``lse`` is the log-sum-exp of each query's logits (zeros for the sigmoid score), which the
    two-phase merge needs. ``inv_rms`` optionally gives each source's ``inverse_rms`` (entries
    may be None; those are computed here), so that a source read many times is normalized once.
    ``norm = (weight, eps)`` returns the first query's output through ``rms_norm`` (the pre-norm
    of the sublayer that reads it), fused so that nothing of it is kept for backward.
    Gradients flow to queries, gains and sources (``None`` where not required, so frozen
    parameters cost nothing).
    """
    return apply_depth_function(DepthAttentionFunction, queries, sources, gains, heads, eps, score, key_norm,
                                inv_rms, norm)


def apply_depth_function(function, queries, sources, gains, heads, eps, score, key_norm, inv_rms, norm):
    """``depth_attention_multi``'s arguments passed to ``function`` (``DepthAttentionFunction`` or
    a twin with the same inputs and outputs), ``(outs, lse)`` taken from its flat outputs."""
    n = len(sources)
    cached = list(inv_rms) if inv_rms is not None and key_norm else [None] * n
    if len(cached) != n:
        raise ValueError(f"inv_rms has {len(cached)} entries for {n} sources")
    norm_weight, norm_eps = norm if norm is not None else (None, None)
    *outs, lse = function.apply(queries, gains, norm_weight, heads, eps, score, key_norm, norm_eps, n, *sources, *cached)
    return tuple(outs), lse
