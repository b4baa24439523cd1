"""Deferred source gradients: each completed source's gradient formed once, at its own backward.

A completed source ``v_k`` (Full: a sublayer's output; Block: a block sum) is read by every later
routing point. With plain reverse-mode accumulation each read's backward writes a ``[..., D]``
term for every source it read, and autograd holds each source's running sum from the first of
those backwards (the output routing's, at the start of backward) until the source's own: one
``[..., D]`` per completed source, all at once, while the sublayers' activations are still held.

With a ledger, a read's backward computes its query and norm gradients and ``dL/d logit``
(numbers per token) but no source gradient; it leaves, per source, a ``DeferredRead`` holding
its upstream gradients and those numbers. When every read of ``v_k`` has run its backward,
autograd reaches ``v_k``'s ``_TrackedSource`` node, which forms the gradient from the reads'
records in one pass (the backend's ``source_grad``)::

    dv_k = sum_{reads, s, h} (p[k,s,h] g_s[h] + r_k ds[k,s,h] qg_s[h]) + coef v_k,
    coef = -(r_k^2 / D) sum_{reads, s, h} ds[k,s,h] logit[k,s,h]

with ``logit[k,s,h] = r_k (qg_s[h] . v_k[h])`` (``qg`` the gain-folded queries, ``r_k`` the
source's inverse RMS), ``p = exp(logit - lse)`` the depth weights (the sigmoid ablation:
``sigmoid(logit)``), ``g_s`` the upstream gradient of query ``s``'s mix and ``ds = dL/d logit``:
the terms the read's own backward would have added, in another order. What is held is one
``[..., D]`` upstream gradient per query of each read whose backward has run, until the end of
backward (every read also reads the first source), instead of one sum per source from the
start; it grows while the sublayers' activations are freed, so the peak at the start of
backward drops by the sources' gradients.

A record belongs to the backward call (autograd's graph task) that made it, and the records
a call leaves unused (it stopped before the source: ``torch.autograd.grad`` for the queries
alone) are dropped when it ends; calls running at once on one graph each use their own. The
stream's state keeps the sources themselves (``ops.routing`` hands the reads the tracked
tensors), so a hook or ``autograd.grad`` on a state's tensor sees the whole gradient. A backward
that builds a graph (``create_graph=True``) does not defer: the kernels' backward is not itself
differentiable, which it then says when differentiated, as without a ledger.

Nor does a pass that ``torch.compile`` traces have a ledger (``DepthRouter.start`` makes none):
a record finds its source by tensor identity and autograd node, which fake tensors and a
compiled graph do not keep; there the sources' gradients accumulate as autograd sums them.
"""

from __future__ import annotations

import threading
from typing import NamedTuple

import torch
from torch.autograd import Variable
from torch.autograd.function import once_differentiable


class DeferredRead(NamedTuple):
    """What one read leaves for one source it read (compute dtype; ``H`` heads, ``S`` queries).

    ``queries``: ``[S, D]``, the queries with the key-norm gain folded in; ``lse``:
    ``[S, ..., H]``, the read's log-sum-exp (ignored for the sigmoid score); ``ds``:
    ``[S, ..., H]``, ``dL/d logit`` of this source; ``grads``: ``S`` upstream gradients
    ``[..., D]`` of the read's mixes (before any fused norm), None where a query got none;
    ``logits``: ``[S, ..., H]``, the source's logits as the read had them (scored when the
    source was written), or None: they and the weights are computed again from the source
    (numbers per token)."""

    queries: torch.Tensor
    lse: torch.Tensor
    ds: torch.Tensor
    grads: tuple[torch.Tensor | None, ...]
    logits: torch.Tensor | None = None


def current_backward() -> int:
    """The id of the running backward call (autograd's graph task), -1 outside one."""
    return torch._C._current_graph_task_id()


class SourceLedger:
    """The deferred reads of one forward pass's completed sources, by backward call and source
    index (the order ``track`` saw them). ``source_grad``: the backend's method that forms a
    source's gradient from its reads (``CpuOps.source_grad``); ``options``: the routing's
    ``heads``, ``eps``, ``score`` and ``key_norm``, which a read must share to defer;
    ``dtype``: the dtype the reads compute in, which a tracked source must have."""

    def __init__(self, source_grad, options: dict, dtype: torch.dtype):
        self.source_grad = source_grad
        self.options = options
        self.dtype = dtype
        self.count = 0
        self.pending: dict[int, dict[int, list[DeferredRead]]] = {}  # backward call -> index -> reads
        self._lock = threading.Lock()

    def track(self, source: torch.Tensor, inv_rms: torch.Tensor | None) -> torch.Tensor:
        """``source`` as the tensor later reads take, whose backward forms its gradient from
        their records (``source`` itself when it takes no gradient or is not in ``dtype``)."""
        index = self.count
        self.count += 1
        if not source.requires_grad or source.dtype != self.dtype:
            return source
        return _TrackedSource.apply(source, inv_rms, self, index)

    def takes(self, options: dict, dtype: torch.dtype) -> bool:
        """Whether a read with these routing ``options`` computing in ``dtype`` may defer to it."""
        return dtype == self.dtype and options == self.options

    def defer(self, index: int, read: DeferredRead) -> None:
        """Record ``read`` for source ``index`` (called from a read's backward)."""
        task = current_backward()
        with self._lock:
            by_source = self.pending.get(task)
            if by_source is None:
                by_source = self.pending[task] = {}
                # what this call leaves unused goes when it ends
                Variable._execution_engine.queue_callback(lambda: self._end(task))
            by_source.setdefault(index, []).append(read)

    def _end(self, task: int) -> None:
        with self._lock:
            self.pending.pop(task, None)

    def gradient(self, index: int, source: torch.Tensor, inv_rms: torch.Tensor | None,
                 grad: torch.Tensor | None) -> torch.Tensor | None:
        """Source ``index``'s gradient: ``grad`` (what reached it directly, or None) plus the
        terms of the reads this backward call recorded for it, which are dropped."""
        with self._lock:
            reads = self.pending.get(current_backward(), {}).pop(index, None)
        if not reads:
            return grad
        return self.source_grad(source, inv_rms, reads, grad, **self.options)


def tracked(source: torch.Tensor) -> tuple[SourceLedger, int] | None:
    """``(ledger, index)`` when ``source`` is a tensor ``SourceLedger.track`` returned, else None:
    a read defers the gradient of exactly the tensors it was handed that a ledger tracks."""
    node = source.grad_fn
    if type(node) is _TrackedSource._backward_cls:
        return node.ledger, node.index
    return None


class _TrackedSource(torch.autograd.Function):
    """Identity on a completed source; its backward runs once every read of the source has run
    its own, and adds the terms they deferred (``SourceLedger.gradient``)."""

    @staticmethod
    def forward(ctx, source, inv_rms, ledger, index):
        ctx.save_for_backward(source, inv_rms)
        ctx.ledger, ctx.index = ledger, index
        ctx.set_materialize_grads(False)
        return source.view_as(source)

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        source, inv_rms = ctx.saved_tensors
        return ctx.ledger.gradient(ctx.index, source, inv_rms, grad), None, None, None
