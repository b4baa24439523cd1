"""Phase 2 of the two-phase Block computation (SPEC section 3).

Phase 1 (``depth_attention_multi``) scores all queries of a block against its completed sources
once, keeping each query's normalized mix ``o1`` and log-sum-exp ``lse1``. Phase 2 adds the one
partial source ``P_i`` of sublayer ``i`` exactly::

    s2 = w_i . RMSNorm_{k_i}(P_i)                      (per head)
    h  = (exp(lse1) o1 + exp(s2) P) / (exp(lse1) + exp(s2)) = lerp(P, o1, sigmoid(lse1 - s2))

The ``lerp`` form needs no max-shift. ``MergeFunction`` keeps nothing for backward beyond
references to ``o1`` and ``P`` (which exist anyway) and three numbers per token and head.
"""

from __future__ import annotations

import torch
from torch.nn import functional as F

from .fused import compute_dtype, head_matrix


class MergeFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, o1, lse1, partial, query, gain, heads, eps, score, key_norm):
        dt = compute_dtype(partial.dtype)
        lead, D = partial.shape[:-1], partial.shape[-1]
        H, dh = heads, D // heads
        P = partial.to(dt)
        qg = query.to(dt) if gain is None else query.to(dt) * gain.to(dt)
        s2 = F.linear(P, head_matrix(qg.unsqueeze(0), H))  # [..., H]
        r = None
        if key_norm:
            r = torch.rsqrt(torch.linalg.vector_norm(P, dim=-1).square() / D + eps)  # [...]
            s2 = s2 * r.unsqueeze(-1)
        Ph = partial.view(*lead, H, dh)
        o1h = o1.view(*lead, H, dh)
        if score == "softmax":
            w = torch.sigmoid(lse1.to(dt) - s2)  # weight of the completed sources, a / (a + b)
            h = torch.lerp(Ph, o1h, w.unsqueeze(-1).to(partial.dtype))
        else:  # unnormalized weights: the plain sum
            w = torch.sigmoid(s2)  # weight of the partial
            h = o1h + w.unsqueeze(-1).to(partial.dtype) * Ph
        ctx.save_for_backward(o1, partial, query, gain, s2, w, r)
        ctx.config = (H, score, key_norm)
        return h.view(*lead, D)

    @staticmethod
    def backward(ctx, g):
        o1, partial, query, gain, s2, w, r = ctx.saved_tensors
        H, score, key_norm = ctx.config
        lead, D = partial.shape[:-1], partial.shape[-1]
        dh = D // H
        dt = w.dtype
        gh = g.to(dt).view(*lead, H, dh)
        Ph = partial.to(dt).view(*lead, H, dh)
        wd = w.unsqueeze(-1)
        d_o1 = d_lse1 = None
        if score == "softmax":
            if ctx.needs_input_grad[0]:
                d_o1 = (gh * wd).view(*lead, D).to(o1.dtype)
            # d w = g . (o1 - P) per head; w = sigmoid(lse1 - s2)
            dw = torch.linalg.vecdot(gh, o1.to(dt).view(*lead, H, dh)) - torch.linalg.vecdot(gh, Ph)
            dz = dw * w * (1 - w)
            if ctx.needs_input_grad[1]:
                d_lse1 = dz
            ds2 = -dz
            dP = gh * (1 - wd)
        else:
            if ctx.needs_input_grad[0]:
                d_o1 = g
            ds2 = torch.linalg.vecdot(gh, Ph) * w * (1 - w)
            dP = gh * wd
        qg = query.to(dt) if gain is None else query.to(dt) * gain.to(dt)
        c = ds2 * r.unsqueeze(-1) if key_norm else ds2  # d(raw logit), [..., H]
        d_partial = d_query = d_gain = None
        if ctx.needs_input_grad[2]:
            dP.addcmul_(c.unsqueeze(-1), qg.view(H, dh))
            if key_norm:  # through the inverse RMS: d r / d P = -r^3 P / D
                coef = (ds2 * s2).sum(-1) * r.square() / D  # [...]
                dP.addcmul_(Ph, coef.view(*lead, 1, 1), value=-1.0)
            d_partial = dP.view(*lead, D).to(partial.dtype)
        if ctx.needs_input_grad[3] or (gain is not None and ctx.needs_input_grad[4]):
            d_qg = c.reshape(-1, H).T @ Ph.reshape(-1, D)  # [H, D]; keep each head's own slice
            d_qg = d_qg.view(H, H, dh).diagonal().T.reshape(D)
            if ctx.needs_input_grad[3]:
                d_query = (d_qg if gain is None else d_qg * gain.to(dt)).to(query.dtype)
            if gain is not None and ctx.needs_input_grad[4]:
                d_gain = (d_qg * query.to(dt)).to(gain.dtype)
        return d_o1, d_lse1, d_partial, d_query, d_gain, None, None, None, None


def merge_partial(
    o1: torch.Tensor,
    lse1: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    gain: torch.Tensor | None = None,
    *,
    heads: int = 1,
    eps: float = 1e-6,
    score: str = "softmax",
    key_norm: bool = True,
) -> torch.Tensor:
    """Merge the partial source into phase 1's result.

    Shapes: ``o1`` ``[..., D]``, ``lse1`` ``[..., H]``, ``partial`` ``[..., D]``, ``query`` and
    ``gain`` ``[D]``. Returns ``h`` ``[..., D]`` in ``partial``'s dtype. With the sigmoid score the
    weights are not normalized, so the merge is the plain sum ``o1 + sigmoid(s2) P``.
    """
    return MergeFunction.apply(o1, lse1, partial, query, gain, heads, eps, score, key_norm)
