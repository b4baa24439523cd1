"""Phase 2 of the two-phase Block computation (SPEC section 3).

Phase 1 (``depth_attention_multi``) scores all queries of a block against its completed sources
once, keeping each query's normalized mix ``o1`` and log-sum-exp ``lse1``. Phase 2 adds the one
partial source ``P_i`` of sublayer ``i`` exactly::

    s2 = w_i . RMSNorm_{k_i}(P_i)                      (per head)
    h  = (exp(lse1) o1 + exp(s2) P) / (exp(lse1) + exp(s2)) = lerp(P, o1, sigmoid(lse1 - s2))

The ``lerp`` form needs no max-shift. Backward needs neither ``o1`` nor its normalizer: with
``w = sigmoid(lse1 - s2)``, ``d(lse1 - s2) = w (1 - w) g . (o1 - P) = (1 - w) g . (h - P)``, so the
merge keeps ``h`` (which its consumer keeps anyway), a reference to ``P`` and three numbers per
token and head, and phase 1's ``o1`` is freed as soon as the merge has run.

``merge_norm`` fuses the merge with the next sublayer's pre-norm (``rms_norm``, the HF order):
it keeps ``h`` and recomputes the normalized ``h`` in backward, as ``RMSNorm`` does, so a merged
read keeps one ``[..., D]`` tensor.
"""

from __future__ import annotations

import torch

from .fused import compute_dtype, fold_gain, head_dots, inverse_rms, query_grads, scoring_weights, source_logits
from .rmsnorm import rms_norm_backward, rms_norm_forward


def _merge_forward(o1, lse1, partial, query, gain, heads, eps, score, key_norm):
    """``h`` ``[..., D]`` (partial's dtype) and the per-head statistics ``s2, w, r``."""
    dt = compute_dtype(partial.dtype)
    lead, D = partial.shape[:-1], partial.shape[-1]
    H, dh = heads, D // heads
    P = partial.to(dt)
    r = inverse_rms(P, eps) if key_norm else None  # [...]
    s2 = source_logits(P, scoring_weights(fold_gain(query, gain, dt)[None], H), H, r)[..., 0, :]  # [..., H]
    Ph = partial.view(*lead, H, dh)
    o1h = o1.view(*lead, H, dh)
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
    # (fresh [..., D] temporaries cost more than these ops; see fused.head_dots)
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
    @staticmethod
    def forward(ctx, o1, lse1, partial, query, gain, heads, eps, score, key_norm):
        h, s2, w, r = _merge_forward(o1, lse1, partial, query, gain, heads, eps, score, key_norm)
        ctx.save_for_backward(h, partial, query, gain, s2, w, r)
        ctx.config = (heads, score, key_norm, (o1.dtype, lse1.dtype, partial.dtype, query.dtype,
                                               None if gain is None else gain.dtype))
        return h

    @staticmethod
    def backward(ctx, g):
        h, partial, query, gain, s2, w, r = ctx.saved_tensors
        heads, score, key_norm, dtypes = ctx.config
        grads = _merge_backward(g.to(w.dtype), h, partial, query, gain, s2, w, r, heads, score,
                                key_norm, ctx.needs_input_grad)
        return (*_cast(grads, dtypes), None, None, None, None)


class MergeNormFunction(torch.autograd.Function):
    """``rms_norm(merge_partial(...), weight, norm_eps)`` keeping ``h`` but not its normalized copy."""

    @staticmethod
    def forward(ctx, o1, lse1, partial, query, gain, weight, heads, eps, norm_eps, score, key_norm):
        h, s2, w, r = _merge_forward(o1, lse1, partial, query, gain, heads, eps, score, key_norm)
        y, rr = rms_norm_forward(h, weight, norm_eps)
        ctx.save_for_backward(h, rr, weight, partial, query, gain, s2, w, r)
        ctx.config = (heads, score, key_norm, (o1.dtype, lse1.dtype, partial.dtype, query.dtype,
                                               None if gain is None else gain.dtype))
        return y

    @staticmethod
    def backward(ctx, dy):
        h, rr, weight, partial, query, gain, s2, w, r = ctx.saved_tensors
        heads, score, key_norm, dtypes = ctx.config
        g, d_weight = rms_norm_backward(dy, h, weight, rr, ctx.needs_input_grad[5])
        grads = _merge_backward(g, h, partial, query, gain, s2, w, r, heads, score, key_norm,
                                ctx.needs_input_grad, g_owned=not torch.is_grad_enabled())
        return (*_cast(grads, dtypes), d_weight, None, None, None, None, None)


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
    if not torch.is_grad_enabled():  # inference: no autograd node, nothing kept
        return _merge_forward(o1, lse1, partial, query, gain, heads, eps, score, key_norm)[0]
    return MergeFunction.apply(o1, lse1, partial, query, gain, heads, eps, score, key_norm)


def merge_norm(
    o1: torch.Tensor,
    lse1: torch.Tensor,
    partial: torch.Tensor,
    query: torch.Tensor,
    gain: torch.Tensor | None,
    norm_weight: torch.Tensor | None,
    norm_eps: float,
    *,
    heads: int = 1,
    eps: float = 1e-6,
    score: str = "softmax",
    key_norm: bool = True,
) -> torch.Tensor:
    """``rms_norm(merge_partial(o1, lse1, partial, query, gain, ...), norm_weight, norm_eps)``
    as one op: the read of a merged sublayer including its pre-norm, ``[..., D]``."""
    if not torch.is_grad_enabled():
        h = _merge_forward(o1, lse1, partial, query, gain, heads, eps, score, key_norm)[0]
        return rms_norm_forward(h, norm_weight, norm_eps, in_place=True)[0]  # h is not kept
    return MergeNormFunction.apply(o1, lse1, partial, query, gain, norm_weight, heads, eps, norm_eps,
                                   score, key_norm)
