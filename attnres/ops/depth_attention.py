"""Depth attention: one learned pseudo-query mixes the outputs of earlier sublayers.

``depth_attention`` is the single entry point every AttnRes-family stream calls. It validates its
inputs once (shapes only, nothing that costs a device sync) and dispatches to a backend.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Sequence

import torch

from .cpu_build import build_problem
from .cpu_kernels import DTYPES as CPU_DTYPES
from .cpu_kernels import depth_attention_multi_cpu, merge_cpu
from .fused import depth_attention_multi
from .naive import depth_attention_naive
from .rmsnorm import RMSNormFunction
from .two_phase import merge_norm, merge_partial

SCORES = ("softmax", "sigmoid")
BACKENDS = ("auto", "torch", "naive", "triton", "cpu")
_warned: set[str] = set()


def warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)


def _triton_problem(device_type: str, score: str, key_norm: bool) -> str | None:
    """Why the Triton kernels cannot run here, or None when they can."""
    if score != "softmax" or not key_norm:
        return "the Triton kernels implement the method (softmax over RMS-normalized keys), not the score/key-norm ablations"
    if device_type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        return f"the Triton kernels run on CUDA tensors (or on the CPU under TRITON_INTERPRET=1), got {device_type} tensors"
    try:
        import triton  # noqa: F401
    except ImportError:
        return "triton is not installed (pip install 'attnres[triton]')"
    return None


def _cpu_problem(device_type: str, dtype: torch.dtype | None) -> str | None:
    """Why the CPU kernels cannot run here, or None when they can."""
    if device_type != "cpu":
        return f"the CPU kernels run on CPU tensors, got {device_type} tensors"
    if dtype is not None and dtype not in CPU_DTYPES:
        return f"the CPU kernels take float32 or float64 sources, got {dtype}"
    return build_problem()


def resolve_backend(backend: str, *, device_type: str = "cpu", per_token_query: bool = False,
                    score: str = "softmax", key_norm: bool = True, dtype: torch.dtype | None = None) -> str:
    """The backend that will run: ``naive``, ``torch``, ``triton`` or ``cpu``.

    ``auto`` picks Triton for CUDA tensors, the CPU kernels for fp32/fp64 CPU tensors (``torch``
    while ``torch.compile`` traces, which cannot see into them; ``torch`` for other dtypes) and
    ``torch`` elsewhere; it alone may fall back, warning once when a backend it would pick
    cannot run. An explicit backend that cannot run raises ``RuntimeError`` saying why.
    ``dtype`` is the sources' dtype (None: not checked).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
    if backend == "naive":
        return "naive"
    if per_token_query:
        if backend != "auto":
            raise RuntimeError(
                f"backend={backend!r} takes one query [D] shared by all tokens; per-token queries "
                "[..., D] (the input-dependent ablation) run on backend='naive'"
            )
        warn_once("depth_attention: per-token queries use the reference (naive) path")
        return "naive"
    if backend == "triton":
        problem = _triton_problem(device_type, score, key_norm)
        if problem:
            raise RuntimeError(f"backend='triton' cannot run: {problem}")
        return "triton"
    if backend == "cpu":
        problem = _cpu_problem(device_type, dtype)
        if problem:
            raise RuntimeError(f"backend='cpu' cannot run: {problem}")
        return "cpu"
    if backend == "auto" and device_type == "cuda":
        problem = _triton_problem(device_type, score, key_norm)
        if problem is None:
            return "triton"
        warn_once(f"depth_attention: using the torch backend on CUDA because {problem}")
    if backend == "auto" and device_type == "cpu" and dtype in CPU_DTYPES and not torch.compiler.is_compiling():
        problem = build_problem()
        if problem is None:
            return "cpu"
        warn_once(f"depth_attention: using the torch backend on CPU because {problem}")
    return "torch"


def multi_query_attention(queries, sources, gains=None, *, heads=1, eps=1e-6, score="softmax",
                          key_norm=True, backend="auto", inv_rms=None, norm=None):
    """``S`` queries ``[S, D]`` against ``sources``: ``(outs, lse)``, one ``[..., D]`` per query
    and ``[S, ..., H]``, on the chosen backend (``naive`` is not offered: the reference routes
    one query at a time).
    ``inv_rms``: each source's cached ``inverse_rms`` (or None); the Triton kernels normalize
    inside and do not need it. ``norm = (weight, eps)``: return the first output through
    ``rms_norm`` (fused into the op on the ``torch`` and ``cpu`` backends, applied after it on
    Triton)."""
    chosen = resolve_backend(backend, device_type=sources[0].device.type, score=score, key_norm=key_norm,
                             dtype=sources[0].dtype)
    if chosen == "triton":
        from .triton_kernels import depth_attention_multi_triton

        outs, lse = depth_attention_multi_triton(queries, sources, gains, heads=heads, eps=eps)
        if norm is not None:
            outs = (RMSNormFunction.apply(outs[0], *norm), *outs[1:])
        return outs, lse
    multi = depth_attention_multi_cpu if chosen == "cpu" else depth_attention_multi
    return multi(queries, sources, gains, heads=heads, eps=eps, score=score, key_norm=key_norm,
                 inv_rms=inv_rms, norm=norm)


def merge(o1, lse1, partial, query, gain=None, *, heads=1, eps=1e-6, score="softmax", key_norm=True,
          backend="auto"):
    """Phase 2 of the two-phase Block computation on the chosen backend (``ops.two_phase``)."""
    chosen = resolve_backend(backend, device_type=partial.device.type, score=score, key_norm=key_norm,
                             dtype=partial.dtype)
    if chosen == "triton":
        from .triton_kernels import merge_partial_triton

        return merge_partial_triton(o1, lse1, partial, query, gain, heads=heads, eps=eps)
    if chosen == "cpu":
        return merge_cpu(o1, lse1, partial, query, gain, heads=heads, eps=eps, score=score, key_norm=key_norm)
    return merge_partial(o1, lse1, partial, query, gain, heads=heads, eps=eps, score=score, key_norm=key_norm)


def merge_and_norm(o1, lse1, partial, query, gain, norm_weight, norm_eps, *, heads=1, eps=1e-6,
                   score="softmax", key_norm=True, backend="auto"):
    """Phase 2 followed by the sublayer's pre-norm, ``rms_norm(merge(...), norm_weight, norm_eps)``;
    one fused op on the ``torch`` and ``cpu`` backends (``ops.two_phase.merge_norm``,
    ``ops.cpu_kernels.merge_cpu``)."""
    chosen = resolve_backend(backend, device_type=partial.device.type, score=score, key_norm=key_norm,
                             dtype=partial.dtype)
    if chosen == "triton":
        from .triton_kernels import merge_partial_triton

        h = merge_partial_triton(o1, lse1, partial, query, gain, heads=heads, eps=eps)
        return RMSNormFunction.apply(h, norm_weight, norm_eps)
    if chosen == "cpu":
        return merge_cpu(o1, lse1, partial, query, gain, norm_weight, norm_eps, heads=heads, eps=eps, score=score,
                         key_norm=key_norm)
    return merge_norm(o1, lse1, partial, query, gain, norm_weight, norm_eps, heads=heads, eps=eps,
                      score=score, key_norm=key_norm)


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
    inv_rms: Sequence[torch.Tensor | None] | None = None,
):
    """Route over depth (SPEC sections 2 and 4).

    Args:
        query: pseudo-query ``[D]`` (or per-token ``[..., D]`` for the input-dependent ablation).
        sources: non-empty list of ``[..., D]`` tensors, the raw values to mix; never stacked by
            the caller.
        gain: key-norm gain ``[D]`` or None.
        heads: number of depth-attention heads (MHAR); ``heads=1`` is plain AttnRes.
        eps: RMSNorm epsilon for the keys.
        return_weights: also return the weights ``[N, ..., heads]``.
        score: ``"softmax"`` (the method) or ``"sigmoid"`` (SPEC section 9 ablation).
        key_norm: normalize keys with RMSNorm (``False`` is the SPEC section 9 ablation).
        backend: ``"naive"`` (the reference: stacks and normalizes every source), ``"torch"``
            (memory-efficient autograd, ``ops.fused``), ``"cpu"`` (the same op as fused C++
            kernels, ``ops.cpu_kernels``), ``"triton"`` (fused kernels, ``ops.triton_kernels``)
            or ``"auto"`` (Triton on CUDA, ``cpu`` for fp32/fp64 CPU tensors, else ``torch``;
            it alone falls back, warning once). Returning the weights materializes them, so
            ``return_weights=True`` computes them on the reference path.
        inv_rms: optional per-source ``ops.inverse_rms`` ``[...]`` (entries may be None), so that
            a source read by many sublayers is normalized once; used by ``torch`` and ``cpu``
            (the others normalize inside, with the same result).

    Returns:
        ``[..., D]`` in the sources' dtype (math in fp32), and the weights if requested.
    """
    check_depth_inputs(query, sources, gain, heads, score)
    chosen = resolve_backend(backend, device_type=sources[0].device.type, per_token_query=query.ndim > 1,
                             score=score, key_norm=key_norm, dtype=sources[0].dtype)
    if chosen != "naive" and not return_weights:
        outs, _ = multi_query_attention(
            query.unsqueeze(0), sources, None if gain is None else gain.unsqueeze(0),
            heads=heads, eps=eps, score=score, key_norm=key_norm, backend=chosen, inv_rms=inv_rms,
        )
        return outs[0]
    return depth_attention_naive(
        query, sources, gain, heads=heads, eps=eps, score=score, key_norm=key_norm,
        return_weights=return_weights,
    )
