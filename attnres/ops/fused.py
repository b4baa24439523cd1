"""Memory-efficient depth attention in PyTorch (the ``torch`` backend).

One ``autograd.Function`` serves every AttnRes read: ``S`` queries (one for an ordinary read; all
queries of a block for the two-phase Block computation, SPEC section 3) against a list of sources
that is never stacked. What it keeps for backward:

- references to the sources (they live in the residual state anyway, so this costs nothing);
- the output (the next op, the sublayer's pre-norm, keeps it too);
- per-token fp32 statistics: the inverse RMS of every source ``[N, ...]``, the logits
  ``[N, S, ..., H]`` and the log-sum-exp ``[S, ..., H]``; all of size ``O(N S H)`` per token
  instead of the ``O(N D)`` stacked, normalized keys of the reference path.

The key-norm gain is folded into the query (``w . (k * RMSNorm(v)) = (w * k) . RMSNorm(v)``), so a
source is normalized by one scalar per token, shared by all ``S`` queries and ``H`` heads, and
the logits of all queries and heads come out of one matmul against a block-diagonal
query matrix ``[S H, D]``. Forward sweeps the sources twice (logits, then the weighted sum); backward once.

Shapes: queries ``[S, D]``, gains ``[S, D]`` or None, sources ``N x [..., D]``; returns
``out`` ``[S, ..., D]`` (sources' dtype) and ``lse`` ``[S, ..., H]`` (fp32).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn import functional as F


def head_matrix(qg: torch.Tensor, heads: int) -> torch.Tensor:
    """Block-diagonal ``[S*H, D]``: row ``(s, h)`` holds ``qg[s]``'s slice ``h`` in columns
    ``h*Dh:(h+1)*Dh`` and zeros elsewhere, so ``F.linear(v, head_matrix)`` gives every query's
    per-head logit at once (a contiguous ``[out, in]`` weight: the fast layout for a thin GEMM)."""
    S, D = qg.shape
    dh = D // heads
    eye = torch.eye(heads, dtype=qg.dtype, device=qg.device)
    blocks = qg.view(S, 1, heads, dh) * eye.view(1, heads, heads, 1)  # [S, H, H', Dh]
    return blocks.reshape(S * heads, D)


def _logits(v, Qm, eps, key_norm, S, H):
    """Logits ``[S, ..., H]`` and inverse RMS ``[...]`` (or None) of one source ``v`` ``[..., D]``."""
    raw = F.linear(v, Qm).unflatten(-1, (S, H)).movedim(-2, 0)  # [S, ..., H]
    if not key_norm:
        return raw, None
    d = v.shape[-1]
    inv_rms = torch.rsqrt(torch.linalg.vector_norm(v, dim=-1).square() / d + eps)  # [...]
    return raw * inv_rms.unsqueeze(-1), inv_rms


class DepthAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, queries, gains, heads, eps, score, key_norm, *sources):
        S, D = queries.shape
        H, dh = heads, D // heads
        dt = torch.promote_types(sources[0].dtype, torch.float32)
        qg = queries.to(dt) if gains is None else queries.to(dt) * gains.to(dt)
        Qm = head_matrix(qg, H)
        logits, inv_rms = [], []
        for v in sources:
            s, r = _logits(v.to(dt), Qm, eps, key_norm, S, H)
            logits.append(s)
            inv_rms.append(r)
        logits = torch.stack(logits)  # [N, S, ..., H]: small, O(N S H) per token
        if score == "softmax":
            lse = torch.logsumexp(logits, dim=0)  # [S, ..., H]
            weights = (logits - lse).exp_()
        else:
            lse = torch.zeros_like(logits[0])
            weights = torch.sigmoid(logits)
        lead = sources[0].shape[:-1]
        acc = torch.zeros((S, *lead, H, dh), dtype=dt, device=sources[0].device)
        for w, v in zip(weights, sources):
            acc.addcmul_(w.unsqueeze(-1), v.to(dt).view(*lead, H, dh))
        out = acc.view(S, *lead, D).to(sources[0].dtype)
        ctx.save_for_backward(queries, gains, out, lse, logits,
                              torch.stack(inv_rms) if key_norm else None, *sources)
        ctx.config = (H, eps, score, key_norm)
        if score != "softmax":
            ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, g_out, g_lse):
        queries, gains, out, lse, logits, inv_rms, *sources = ctx.saved_tensors
        H, eps, score, key_norm = ctx.config
        S, D = queries.shape
        dh = D // H
        dt = logits.dtype
        lead = sources[0].shape[:-1]
        qg = queries.to(dt) if gains is None else queries.to(dt) * gains.to(dt)
        Qm = head_matrix(qg, H)
        g = torch.zeros((S, *lead, D), dtype=dt, device=out.device) if g_out is None else g_out.to(dt)
        gh = g.view(S, *lead, H, dh)
        if score == "softmax":
            # d logit_j = p_j * (g . v_j - g . out + g_lse), per query and head (softmax Jacobian)
            centre = (gh * out.to(dt).view(S, *lead, H, dh)).sum(-1)  # [S, ..., H]
            if g_lse is not None:
                centre = centre - g_lse
        need_src = ctx.needs_input_grad[6:]
        need_q = ctx.needs_input_grad[0] or (gains is not None and ctx.needs_input_grad[1])
        d_qg = torch.zeros(S * H, D, dtype=dt, device=out.device) if need_q else None
        grads = []
        for j, v in enumerate(sources):
            if not (need_src[j] or need_q):
                grads.append(None)
                continue
            vf = v.to(dt)
            s = logits[j]
            if score == "softmax":
                p = (s - lse).exp()
            else:
                p = torch.sigmoid(s)
            gv = (gh * vf.view(*lead, H, dh)).sum(-1)  # [S, ..., H]
            ds = p * (gv - centre) if score == "softmax" else p * (1 - p) * gv
            c = ds * inv_rms[j].unsqueeze(-1) if key_norm else ds  # d(raw logit), [S, ..., H]
            c_flat = c.movedim(0, -2).flatten(-2)  # [..., S*H]
            if need_q:
                # d qg[s, h-slice] = sum_tokens c[s, h] * v[h-slice]: the block diagonal of c^T v, [S*H, D]
                d_qg += c_flat.reshape(-1, S * H).T @ vf.reshape(-1, D)
            if need_src[j]:
                dv = (c_flat @ Qm).view(*lead, H, dh)  # logit path through the raw dot product
                for q in range(S):  # value path, fused multiply-adds
                    dv.addcmul_(p[q].unsqueeze(-1), gh[q])
                dv = dv.view(*lead, D)
                if key_norm:  # logit path through the inverse RMS: d r / d v = -r^3 v / D
                    coef = (ds * s).sum(dim=(0, -1)) * inv_rms[j].square() / D  # [...]
                    dv.addcmul_(coef.unsqueeze(-1), vf, value=-1.0)
                grads.append(dv.to(v.dtype))
            else:
                grads.append(None)
        d_queries = d_gains = None
        if need_q:
            # keep each row's own head slice: [S, H, H', Dh] -> diagonal over (H, H')
            d_qg = d_qg.view(S, H, H, dh).diagonal(dim1=1, dim2=2).permute(0, 2, 1).reshape(S, D)
            if ctx.needs_input_grad[0]:
                d_queries = (d_qg if gains is None else d_qg * gains.to(dt)).to(queries.dtype)
            if gains is not None and ctx.needs_input_grad[1]:
                d_gains = (d_qg * queries.to(dt)).to(gains.dtype)
        return (d_queries, d_gains, None, None, None, None, *grads)


def depth_attention_multi(
    queries: torch.Tensor,
    sources: Sequence[torch.Tensor],
    gains: torch.Tensor | None = None,
    *,
    heads: int = 1,
    eps: float = 1e-6,
    score: str = "softmax",
    key_norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``S`` queries ``[S, D]`` against ``sources``: ``(out [S, ..., D], lse [S, ..., H])``.

    ``lse`` is the log-sum-exp of each query's logits (zeros for the sigmoid score), which the
    two-phase merge needs. Gradients flow to queries, gains and sources (``None`` where not
    required, so frozen parameters cost nothing).
    """
    return DepthAttentionFunction.apply(queries, gains, heads, eps, score, key_norm, *sources)
