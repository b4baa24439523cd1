"""Depth attention as one function: one learned pseudo-query mixes the outputs of earlier sublayers.

``depth_attention`` validates its inputs (shapes only, nothing that costs a device sync), picks a
backend (``ops.registry.pick``) and routes one query; streams route through ``ops.routing``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .backends.naive import depth_attention_naive
from .registry import SCORES, Request, pick


def check_depth_inputs(
    query: torch.Tensor,
    sources: Sequence[torch.Tensor],
    gain: torch.Tensor | None,
    heads: int,
    score: str = "softmax",
) -> None:
    """Raise ``ValueError`` naming the bad value when the inputs do not fit together."""
    if isinstance(sources, torch.Tensor) or not isinstance(sources, Sequence):
        raise ValueError(
            f"sources must be a list or tuple of [..., D] tensors, got {type(sources).__name__}"
        )
    if len(sources) == 0:
        raise ValueError("sources is empty: depth attention needs at least one source")
    shape = sources[0].shape
    for j, s in enumerate(sources):
        if s.shape != shape:
            raise ValueError(
                f"sources[{j}] has shape {tuple(s.shape)} but sources[0] has {tuple(shape)}: "
                "all sources must share one shape [..., D]"
            )
    dim = shape[-1] if len(shape) else 0
    if len(shape) == 0 or dim == 0:
        raise ValueError(f"sources must have a non-empty last dim D, got shape {tuple(shape)}")
    if query.shape[-1:] != (dim,):
        raise ValueError(f"query has shape {tuple(query.shape)}; its last dim must be D={dim}")
    if gain is not None and gain.shape != (dim,):
        raise ValueError(f"gain has shape {tuple(gain.shape)}; expected [D]=[{dim}]")
    if not isinstance(heads, int) or heads < 1 or dim % heads:
        raise ValueError(f"heads={heads} must be a positive integer dividing D={dim}")
    if score not in SCORES:
        raise ValueError(f"score={score!r} is not one of {SCORES}")


def depth_attention(
    query: torch.Tensor,
    sources: Sequence[torch.Tensor],
    gain: torch.Tensor | None = None,
    *,
    heads: int = 1,
    eps: float = 1e-6,
    return_weights: bool = False,
    score: str = "softmax",
    key_norm: bool = True,
    backend: str = "auto",
    prepared: Sequence[torch.Tensor | None] | None = None,
):
    """Route over depth (docs/METHOD.md sections 2 and 4).

    Args:
        query: pseudo-query ``[D]`` (or per-token ``[..., D]`` for the input-dependent ablation).
        sources: non-empty list of ``[..., D]`` tensors, the raw values to mix; never stacked by
            the caller.
        gain: key-norm gain ``[D]`` or None.
        heads: number of depth-attention heads (MHAR); ``heads=1`` is plain AttnRes.
        eps: RMSNorm epsilon for the keys.
        return_weights: also return the weights ``[N, ..., heads]``; they are materialized, so
            they come from the reference (``naive``) computation.
        score: ``"softmax"`` (the method) or ``"sigmoid"`` (the ablation of METHOD.md section 9).
        key_norm: normalize keys with RMSNorm (``False`` is an ablation, docs/METHOD.md section 9).
        backend: a name from ``ops.registry.NAMES``: ``"naive"`` (the reference: stacks and
            normalizes every source), ``"torch"`` (memory-efficient autograd in PyTorch ops),
            ``"cpu"`` (the same op as fused C++ kernels), ``"triton"`` (fused GPU kernels) or
            ``"auto"`` (``ops.registry.pick``; it alone falls back, warning once).
        prepared: optional per-source values of the chosen backend's ``prepare`` (entries may be
            None), so that a source read by many sublayers is prepared once.

    Returns:
        ``[..., D]`` in the sources' dtype (math in fp32), and the weights if requested.
    """
    check_depth_inputs(query, sources, gain, heads, score)
    chosen = pick(backend, Request(sources[0].device.type, sources[0].dtype, score, key_norm, query.ndim > 1))
    if return_weights:
        return depth_attention_naive(query, sources, gain, heads=heads, eps=eps, score=score, key_norm=key_norm,
                                     return_weights=True)
    outs, _ = chosen.ops.attend(query.unsqueeze(0), sources,
                                None if gain is None else gain.unsqueeze(0), heads=heads, eps=eps,
                                score=score, key_norm=key_norm, prepared=prepared)
    return outs[0]
