"""The routing backends: one module each, each with one object implementing ``BackendOps``.

``BackendOps`` is the interface: every backend implements ``attend``, ``merge`` and ``prepare``;
the other methods belong to the capabilities its ``ops.registry`` line declares (``scores_ahead``,
``scores_in_training``, ``decodes``, ``defers_source_grads``) and raise ``NotImplementedError`` elsewhere. The registry
holds each backend's object (``Backend.ops``); the router keeps the one it picked for a pass
and calls its methods. What each backend accepts (devices, dtypes, ablations) is declared in
``ops.registry``.

Shapes: ``S`` queries ``[S, D]`` with key-norm gains ``[S, D]`` (or None) against a list of
sources ``N x [..., D]`` (never stacked by the caller), ``H`` heads. ``norm``, anything with
``weight`` (``[D]`` or None) and ``eps`` (an ``ops.RMSNorm``), puts a result through the read's
pre-norm, ``rms_norm(x, norm.weight, norm.eps)``, fused where the backend can.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

#: what ``attend`` and ``attend_scored`` return: ``S`` outputs ``[..., D]``, ``lse`` ``[S, ..., H]``
Outputs = tuple[tuple[torch.Tensor, ...], torch.Tensor]


class BackendOps:
    """The operations of one routing backend (docs/METHOD.md sections 2-4 for the math)."""

    #: the backend's name in ``ops.registry.BACKENDS``
    name: str = ""

    def attend(self, queries: torch.Tensor, sources: Sequence[torch.Tensor],
               gains: torch.Tensor | None = None, *, heads: int = 1, eps: float = 1e-6,
               score: str = "softmax", key_norm: bool = True, norm=None,
               prepared: Sequence[torch.Tensor | None] | None = None,
               logits: torch.Tensor | None = None) -> Outputs:
        """``(outs, lse)``: ``S`` queries ``[S, D]`` against ``sources``, one output ``[..., D]``
        per query in the sources' dtype (the first through ``norm`` when given) and the
        log-sum-exp of each query's logits ``[S, ..., H]`` (zeros for the sigmoid score), what
        ``merge`` needs. ``prepared``: each source's ``prepare`` value (entries may be None), so
        that a source read by many sublayers is prepared once. ``logits``: the logits ``[N, S,
        ..., H]`` of these queries against the sources, computed when each source was written
        (``scores_in_training``), a cache of values that a backend with that capability reads
        instead of scoring each token (the others ignore it: they compute the same numbers).
        Gradients flow to queries, gains, sources and the norm's gain."""
        raise NotImplementedError

    def merge(self, o1: torch.Tensor, lse: torch.Tensor, partial: torch.Tensor,
              query: torch.Tensor, gain: torch.Tensor | None = None, *, heads: int = 1,
              eps: float = 1e-6, score: str = "softmax", key_norm: bool = True,
              norm=None) -> torch.Tensor:
        """Phase 2 of the two-phase Block computation (docs/METHOD.md section 3): the partial source
        ``partial`` ``[..., D]`` folded into one phase-1 result ``o1`` ``[..., D]`` with its
        ``lse`` ``[..., H]``, for the site's ``query`` and ``gain`` ``[D]``. Returns ``h``
        ``[..., D]`` in ``partial``'s dtype, through ``norm`` when given."""
        raise NotImplementedError

    def prepare(self, source: torch.Tensor, *, eps: float = 1e-6,
                key_norm: bool = True) -> torch.Tensor | None:
        """What a completed source keeps between its reads: None, or one value per token
        ``[...]`` (a source shared by every token is prepared once and the value expanded with
        it)."""
        raise NotImplementedError

    def score_source(self, source: torch.Tensor, queries: torch.Tensor,
                     gains: torch.Tensor | None = None, *, heads: int = 1, eps: float = 1e-6,
                     key_norm: bool = True, prepared: torch.Tensor | None = None) -> torch.Tensor:
        """``scores_ahead`` (inference) and ``scores_in_training``: the logits ``[..., K, H]``
        of one source ``[..., D]`` for ``K`` queries ``[K, D]`` with gains ``[K, D]`` (or None),
        with autograd off (a cache of values); ``prepared`` its ``prepare`` value."""
        raise NotImplementedError(f"backend {self.name!r} does not score sources ahead")

    def attend_scored(self, scores: Sequence[torch.Tensor], sources: Sequence[torch.Tensor], *,
                      score: str = "softmax", norm=None) -> Outputs:
        """``scores_ahead`` (inference): ``attend``'s ``(outs, lse)`` from precomputed logits,
        ``scores[j]`` ``[..., S, H]`` source ``j``'s (``score_source``)."""
        raise NotImplementedError(f"backend {self.name!r} does not score sources ahead")

    def decode_read(self, sources: torch.Tensor, count: int, query: torch.Tensor, *,
                    heads: int = 1, eps: float = 1e-6, score: str = "softmax",
                    key_norm: bool = True, base: torch.Tensor | None = None, gate: float = 0.0,
                    norm=None) -> torch.Tensor:
        """``decodes``: one read of a decode pass (autograd off, one position per sequence).
        ``sources`` ``[capacity, ..., D]`` holds the pass's sources one after another and the
        first ``count`` are read (the open block's partial sum last, when there is one);
        ``query`` ``[D]`` is the site's pseudo-query with its key-norm gain folded in. Returns
        ``sum_j alpha_j v_j`` ``[..., D]``, or ``base + gate * sum_j alpha_j v_j`` (Delta:
        ``base`` ``[..., D]``, ``gate`` a number), through ``norm`` when given."""
        raise NotImplementedError(f"backend {self.name!r} has no decode pass")

    def source_grad(self, source: torch.Tensor, inv_rms: torch.Tensor | None, reads: Sequence,
                    grad: torch.Tensor | None = None, *, heads: int = 1, eps: float = 1e-6,
                    score: str = "softmax", key_norm: bool = True) -> torch.Tensor:
        """``defers_source_grads`` (training): the gradient ``[..., D]`` (the source's dtype) of
        a completed source ``[..., D]`` from the reads that left it to an ``ops.source_ledger``
        (a list of ``DeferredRead``), plus ``grad`` when given; ``inv_rms`` ``[...]`` is its
        ``prepare`` value (None without the key norm). Such a backend's ``attend`` leaves, in
        its backward, the gradients of the sources a ledger tracks to the ledger."""
        raise NotImplementedError(f"backend {self.name!r} does not defer source gradients")

    # -- the multi-stream designs' per-token work (HC, mHC, GR; docs/METHOD.md sections 6-8) ----

    def stream_mix(self, H: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A multi-stream read: ``y = sum_k w[..., k] H[..., k, :]``, streams ``H`` ``[..., n, D]``
        mixed by weights ``w`` ``[..., n]`` (in ``H``'s dtype) into ``[..., D]``. Gradients flow
        to both."""
        raise NotImplementedError

    def stream_update(self, H: torch.Tensor, A: torch.Tensor | None, b: torch.Tensor, v: torch.Tensor, *,
                      transposed: bool = False) -> torch.Tensor:
        """A multi-stream write: ``H'[..., j, :] = sum_k A[..., j, k] H[..., k, :] + b[..., j] v``
        ``[..., n, D]`` from ``H`` ``[..., n, D]``, ``A`` ``[..., n, n]`` (indexed ``[..., k, j]``
        when ``transposed``; None: the identity, ``H' = H + b v``), ``b`` ``[..., n]`` and ``v``
        ``[..., D]``, all in ``H``'s dtype. Gradients flow to every tensor."""
        raise NotImplementedError

    def gated_mix(self, R: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """GR's read: ``mean_k(sigmoid(z[..., k, :]) * R[..., k, :])`` ``[..., D]``, branches
        ``R`` ``[..., n, D]`` gated elementwise by the logits ``z`` ``[..., n, D]`` (same dtype).
        Gradients flow to both."""
        raise NotImplementedError

    def gated_mix_lowrank(self, R: torch.Tensor, h: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """``gated_mix(R, z)`` with the logits from GR's low-rank layer: ``z = h @ up^T``
        unflattened to ``[..., n, D]``, ``h`` ``[..., r]`` (``R``'s leading dims), ``up``
        ``[n D, r]``, all in ``R``'s dtype. Here the two ops one after the other; a backend may
        form ``z`` inside its kernel. Gradients flow to all three."""
        return self.gated_mix(R, (h @ up.T).unflatten(-1, R.shape[-2:]))

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        """``ops.rms_norm``: each row ``[..., D]`` of ``x`` over its ``D`` numbers, times the gain
        ``weight`` ``[D]`` (same dtype), in ``x``'s dtype (GR's per-branch norm, over
        ``[..., n, D]``). Gradients flow to both."""
        raise NotImplementedError

    def sinkhorn(self, logits: torch.Tensor, iterations: int = 20) -> torch.Tensor:
        """``ops.sinkhorn``: ``exp(logits)`` ``[..., n, n]`` made (nearly) doubly stochastic by
        ``iterations`` row-then-column normalizations, in the logits' dtype (computed in fp32,
        fp64 for fp64). The gradient runs back through every iteration, as autograd
        differentiates ``ops.sinkhorn``."""
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"<{self.name} backend>"
