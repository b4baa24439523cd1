"""Memory-efficient depth attention in PyTorch ops (the ``torch`` backend).

``attend``: one ``autograd.Function`` serves every AttnRes read, ``S`` queries (one for an
ordinary read; all queries of a block for the two-phase Block computation, docs/METHOD.md section 3)
against a list of sources that is never stacked. What it keeps for backward:

- references to the sources (they live in the residual state anyway, so this costs nothing);
- the first query's output (its consumer, the sublayer's pre-norm, keeps it too); the other
  queries' outputs feed two-phase merges and are not kept (backward recovers what it needs
  from the sources);
- per-token fp32 statistics: the logits ``[N, S, ..., H]``, the log-sum-exp ``[S, ..., H]`` and
  the inverse RMS ``[N, ...]``; all of size ``O(N S H)`` per token instead of the ``O(N D)``
  stacked, normalized keys of the reference path.

The key-norm gain is folded into the query, so the logits of all queries and heads come out of
one matmul per source (``common.scoring_weights``). Forward sweeps the sources twice (logits,
then the weighted sum); backward once, plus one sweep when an output was not kept (to
recompute ``out_0`` or recover ``g . out``).

``merge``: phase 2 of the two-phase Block computation. Phase 1 (``attend``) scores all queries of
a block against its completed sources once, keeping each query's mix ``o1`` and log-sum-exp
``lse1``. Phase 2 adds the one partial source ``P_i`` of sublayer ``i`` exactly::

    s2 = w_i . RMSNorm_{k_i}(P_i)                      (per head)
    h  = (exp(lse1) o1 + exp(s2) P) / (exp(lse1) + exp(s2)) = lerp(P, o1, sigmoid(lse1 - s2))

The ``lerp`` form needs no max-shift. Backward needs neither ``o1`` nor its normalizer: with
``w = sigmoid(lse1 - s2)``, ``d(lse1 - s2) = w (1 - w) g . (o1 - P) = (1 - w) g . (h - P)``, so the
merge keeps ``h`` (which its consumer keeps anyway), a reference to ``P`` and three numbers per
token and head, and phase 1's ``o1`` is freed as soon as the merge has run. With the read's
pre-norm fused, it keeps ``h`` and recomputes the normalized ``h`` in backward, as ``RMSNorm``
does, so a merged read keeps one ``[..., D]`` tensor.

``score_source``/``attend_scored`` (inference): each completed source scored once against every
later site, a read then gathers its rows (``ops.routing``).

Shapes: queries ``[S, D]``, gains ``[S, D]`` or None, sources ``N x [..., D]``, prepared inverse
RMS ``N x [...]``; ``attend`` returns ``S x [..., D]`` (sources' dtype) and ``lse`` ``[S, ..., H]``
(fp32, or fp64 for fp64 sources).
"""

from __future__ import annotations

import torch

from ..rmsnorm import RMSNormFunction, rms_norm_backward, rms_norm_forward
from .common import (
    KeyStatisticsOps,
    apply_depth_function,
    compute_dtype,
    depth_outputs,
    fold_gain,
    inverse_rms,
    key_inverse_rms,
    scoring_weights,
    source_logits,
    split_query_grad,
    stack_scores,
)
from .naive import ReferenceStreamOps

__all__ = ["OPS", "DepthAttentionFunction", "MergeFunction", "TorchOps"]

#: at most this many tokens (decoding), the inference path's weighted sums run over stacked
#: sources: a few ops instead of one per source and query, whose dispatch is then the whole cost
FEW_TOKENS = 64


def query_grads(d_qg, query, gain, needs_query, needs_gain):
    """Split ``d(query * gain)`` ``[S, H, H', Dh]`` (the block-diagonal ``c^T v`` of every
    head against every slice) into ``(d_query, d_gain)`` ``[S, D]``, keeping each head's own
    slice (the diagonal over ``(H, H')``); None where not needed."""
    S, H, _, dh = d_qg.shape
    d_qg = d_qg.diagonal(dim1=1, dim2=2).permute(0, 2, 1).reshape(S, H * dh)
    return split_query_grad(d_qg, query, gain, needs_query, needs_gain)


def head_dots(a: torch.Tensor, b: torch.Tensor, scratch: torch.Tensor) -> torch.Tensor:
    """Per-head dot products ``a . b`` over the last dim, ``[..., H, Dh] -> [..., H]``, with the
    elementwise product written into ``scratch`` (same shape as ``a``), a buffer reused across
    calls: a fresh ``[..., D]`` temporary per call (what ``linalg.vecdot`` makes) costs more
    than the product itself, as its pages are touched anew (docs/BENCHMARKS.md, "Tuning")."""
    return torch.mul(a, b, out=scratch).sum(-1)


def _weighted_sums(weights, sources, lead, H, dh):
    """``out_s = sum_j weights[j, s] * sources[j]`` for every query ``s``: weights ``[N, S, ..., H]``
    -> ``S x [..., H, Dh]`` in the weights' dtype.

    One accumulator per query, visited source by source (each source is converted once), rather
    than a single ``[S, ..., D]`` accumulator: neither form is faster within the measured spread
    (docs/BENCHMARKS.md, "Tuning choices in the code"). Per query the products and their order
    are the same either way. The first product allocates each accumulator."""
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
        return depth_outputs(ctx, outs, lse, score)

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


# -- phase 2: the merge ------------------------------------------------------------------------

def _merge_forward(o1, lse1, partial, query, gain, heads, eps, score, key_norm):
    """``h`` ``[..., D]`` (partial's dtype) and the per-head statistics ``s2, w, r``."""
    dt = compute_dtype(partial.dtype)
    lead, D = partial.shape[:-1], partial.shape[-1]
    H, dh = heads, D // heads
    P = partial.to(dt)
    r = inverse_rms(P, eps) if key_norm else None  # [...]
    s2 = source_logits(P, scoring_weights(fold_gain(query, gain, dt)[None], H), H, r)[..., 0, :]  # [..., H]
    Ph = partial.view(*lead, H, dh)
    o1h = o1.to(partial.dtype).view(*lead, H, dh)  # a phase-1 output of another dtype (autocast)
    if score == "softmax":
        w = torch.sigmoid(lse1.to(dt) - s2)  # weight of the completed sources, a / (a + b)
        h = torch.lerp(Ph, o1h, w.unsqueeze(-1).to(partial.dtype))
    else:  # unnormalized weights: the plain sum
        w = torch.sigmoid(s2)  # weight of the partial
        h = o1h + w.unsqueeze(-1).to(partial.dtype) * Ph
    return h.view(*lead, D), s2, w, r


def _merge_backward(g, h, partial, query, gain, s2, w, r, heads, score, key_norm, needs, g_owned=False):
    """Gradients for ``(o1, lse1, partial, query, gain)`` from ``g = dL/dh`` (compute dtype; the
    query and gain gradients come in their own dtypes); ``needs`` says which are required.
    ``g_owned``: ``g`` is this backward's own temporary, so ``d_o1`` may be built in its buffer."""
    lead, D = partial.shape[:-1], partial.shape[-1]
    H, dh = heads, D // heads
    dt = w.dtype
    gh = g.view(*lead, H, dh)
    Ph = partial.to(dt).view(*lead, H, dh)
    wd = w.unsqueeze(-1)
    d_o1 = d_lse1 = d_partial = d_query = d_gain = None
    # the products that are only reduced are written into one buffer, which then becomes dP
    # (fresh [..., D] temporaries cost more than these ops; see head_dots)
    buf = torch.empty_like(gh)
    if score == "softmax":
        # w = sigmoid(z), z = lse1 - s2: dz = w (1 - w) g . (o1 - P) = (1 - w) g . (h - P)
        gdiff = head_dots(gh, h.to(dt).view(*lead, H, dh), buf) - head_dots(gh, Ph, buf)
        dz = gdiff * (1 - w)
        if needs[1]:
            d_lse1 = dz
        ds2 = -dz
        dP = torch.mul(gh, 1 - wd, out=buf) if needs[2] else None
        if needs[0]:  # last use of gh
            d_o1 = gh.mul_(wd) if g_owned else gh * wd
    else:
        if needs[0]:
            d_o1 = gh
        ds2 = head_dots(gh, Ph, buf) * w * (1 - w)
        dP = torch.mul(gh, wd, out=buf) if needs[2] else None
    qg = fold_gain(query, gain, dt)
    c = ds2 * r.unsqueeze(-1) if key_norm else ds2  # d(raw logit), [..., H]
    if dP is not None:
        dP.addcmul_(c.unsqueeze(-1), qg.view(H, dh))
        if key_norm:  # through the inverse RMS: d r / d P = -r^3 P / D
            coef = (ds2 * s2).sum(-1) * r.square() / D  # [...]
            dP.addcmul_(Ph, coef.view(*lead, 1, 1), value=-1.0)
        d_partial = dP.view(*lead, D)
    if needs[3] or (gain is not None and needs[4]):
        d_qg = c.reshape(-1, H).T @ Ph.reshape(-1, D)  # [H, D]: every head against every slice
        d_query, d_gain = query_grads(d_qg.view(1, H, H, dh), query[None], gain, needs[3], needs[4])
        d_query = None if d_query is None else d_query[0]
        d_gain = None if d_gain is None else d_gain[0]
    return None if d_o1 is None else d_o1.reshape(*lead, D), d_lse1, d_partial, d_query, d_gain


def _cast(grads, dtypes):
    return tuple(None if g is None else g.to(d) for g, d in zip(grads, dtypes))


class MergeFunction(torch.autograd.Function):
    """Phase 2, and with ``norm_eps`` set the read's pre-norm after it,
    ``rms_norm(h, norm_weight, norm_eps)``, keeping ``h`` but not its normalized copy."""

    @staticmethod
    def forward(ctx, o1, lse1, partial, query, gain, norm_weight, heads, eps, norm_eps, score, key_norm):
        h, s2, w, r = _merge_forward(o1, lse1, partial, query, gain, heads, eps, score, key_norm)
        y, rr = (h, None) if norm_eps is None else rms_norm_forward(h, norm_weight, norm_eps)
        ctx.save_for_backward(h, rr, norm_weight, partial, query, gain, s2, w, r)
        ctx.config = (heads, score, key_norm, norm_eps, (o1.dtype, lse1.dtype, partial.dtype, query.dtype,
                                                         None if gain is None else gain.dtype))
        return y

    @staticmethod
    def backward(ctx, dy):
        h, rr, norm_weight, partial, query, gain, s2, w, r = ctx.saved_tensors
        heads, score, key_norm, norm_eps, dtypes = ctx.config
        if norm_eps is None:
            g, d_weight, owned = dy.to(w.dtype), None, False
        else:  # the norm's backward makes g this backward's own temporary
            g, d_weight = rms_norm_backward(dy, h, norm_weight, rr, ctx.needs_input_grad[5])
            owned = not torch.is_grad_enabled()
        grads = _merge_backward(g, h, partial, query, gain, s2, w, r, heads, score, key_norm,
                                ctx.needs_input_grad, g_owned=owned)
        return (*_cast(grads, dtypes), d_weight, None, None, None, None, None)



class TorchOps(KeyStatisticsOps, ReferenceStreamOps):
    """The ``torch`` backend's operations (``ops.backends.BackendOps``)."""

    name = "torch"

    def attend(self, queries, sources, gains=None, *, heads=1, eps=1e-6, score="softmax",
               key_norm=True, norm=None, prepared=None, logits=None):
        """``S`` queries ``[S, D]`` against ``sources``: ``(outs, lse)``, ``outs`` one ``[..., D]``
        per query, ``lse`` ``[S, ..., H]`` (zeros for the sigmoid score), what the merge needs.
        ``prepared``: each source's inverse RMS (entries may be None; those are computed here).
        ``norm`` (``weight``, ``eps``): the first output through ``rms_norm`` (the pre-norm of the
        sublayer that reads it), fused so that nothing of it is kept for backward. Gradients flow to
        queries, gains and sources (None where not required, so frozen parameters cost nothing)."""
        return apply_depth_function(DepthAttentionFunction, queries, sources, gains, heads, eps,
                                    score, key_norm, prepared, norm)

    def merge(self, o1, lse, partial, query, gain=None, *, heads=1, eps=1e-6, score="softmax",
              key_norm=True, norm=None):
        """Merge the partial source into phase 1's result: ``h`` ``[..., D]`` in ``partial``'s
        dtype, through ``norm`` when given. Shapes: ``o1`` ``[..., D]``, ``lse`` ``[..., H]``,
        ``partial`` ``[..., D]``, ``query`` and ``gain`` ``[D]``. With the sigmoid score the weights
        are not normalized, so the merge is the plain sum ``o1 + sigmoid(s2) P``."""
        if not torch.is_grad_enabled():  # inference: no autograd node, nothing kept
            h = _merge_forward(o1, lse, partial, query, gain, heads, eps, score, key_norm)[0]
            if norm is None:
                return h
            return rms_norm_forward(h, norm.weight, norm.eps, in_place=True)[0]
        norm_weight, norm_eps = (norm.weight, norm.eps) if norm is not None else (None, None)
        return MergeFunction.apply(o1, lse, partial, query, gain, norm_weight, heads, eps, norm_eps,
                                   score, key_norm)

    @torch.no_grad()
    def attend_scored(self, scores, sources, *, score="softmax", norm=None):
        """``attend``'s ``(outs, lse)`` from precomputed logits (inference): ``scores[j]``
        ``[..., S, H]`` holds source ``j``'s logits for the ``S`` queries (``score_source``)."""
        logits = stack_scores(scores, sources)  # [N, S, ..., H]
        lead, D, H = sources[0].shape[:-1], sources[0].shape[-1], logits.shape[-1]
        outs, lse = mix_logits(logits, sources, score, lead, H, D // H,
                               stacked=lead.numel() <= FEW_TOKENS)
        if norm is not None:  # outs[0] is a fresh sum: normalized in place
            outs = (rms_norm_forward(outs[0], norm.weight, norm.eps, in_place=True)[0], *outs[1:])
        return outs, lse

    # The multi-stream operations: the reference's PyTorch forms (ReferenceStreamOps), GR's
    # per-branch norm with RMSNormFunction's one-pass backward.

    def rms_norm(self, x, weight, eps=1e-6):
        return RMSNormFunction.apply(x, weight, eps)


OPS = TorchOps()
