"""How a stream routes over depth: one backend per forward pass, each completed source prepared
once, and the two-phase Block computation (docs/METHOD.md section 3) on whichever backend runs.

A stream keeps one ``RoutingMemo`` in its state: ``start`` makes it, every call takes it and
returns the next one. It holds the operations of the backend chosen for the pass
(``ops.backends.BackendOps``), whose methods every call runs, and what belongs to them (each
completed source's ``prepare`` value, the open block's phase-1 results, the scores of the
inference path, in training the ledger that forms each completed source's gradient,
``ops.source_ledger``); the stream never looks inside. Sites are the rows of a stream's
pseudo-queries ``[M + 1, D]`` and key-norm gains (sublayer ``i``, and ``M`` for the output
routing)::

    memo = router.start(e, two_phase=True)
    e, memo = router.add_source(memo, e, queries, gains, first_site=0)
    memo = router.open_block(memo, [e], queries, gains, first=0, last=S, norm=norms[0])
    x_0 = router.read(memo, 0, None, queries, gains, norm=norms[0])
    x_1 = router.read(memo, 1, v_0, queries, gains, norm=norms[1])   # merges the partial P_1 = v_0

Phase 1 scores every query of a block against its completed sources once, when the block opens;
a read then only merges its partial sum (``merge``). On the inference path (autograd off, a
backend with ``scores_ahead``) each completed source is scored once against every later site the
moment it is added, and phase 1 only gathers rows of those scores. In training on a backend with
``scores_in_training`` (eager, with the ledger of deferred source gradients) every stream's
sources are scored the same way, in one matrix product each, and every read of completed sources
takes its rows as a cache of values (``attend``'s ``logits``): the read's forward only mixes, and
its backward and the source's deferred gradient read the logits instead of scoring each token
again; the gradients flow through the queries and sources as before (the logits hold no graph).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from .backends import BackendOps
from .backends.common import stack_scores
from .backends.naive import depth_attention_naive
from .registry import Request, pick, validate
from .source_ledger import SourceLedger


class PhaseOne(NamedTuple):
    """Phase 1 of the open block: the queries of sites ``first_site ..`` against its completed
    sources. ``outs``: one ``[..., D]`` per site, the first through its read's norm when one was
    given; ``lse``: ``[S', ..., H]``."""

    outs: tuple[torch.Tensor, ...]
    lse: torch.Tensor
    first_site: int


class RoutingMemo(NamedTuple):
    """What the chosen backend keeps between the calls of one forward pass."""

    backend: BackendOps  # the operations of the backend chosen for this pass
    prepared: tuple  # each completed source's ``prepare`` value (or None)
    #: each completed source's logits ``[..., K, H]`` for every site from its first reader to the
    #: last (inference, or training on a backend with ``scores_in_training``), or None
    scores: tuple | None
    phase_one: PhaseOne | None  # the open block's phase 1 (two-phase path)
    #: eager training on a backend that defers the sources' gradients
    ledger: SourceLedger | None = None
    tracked: tuple = ()  # with a ledger: per completed source, (the source, the tensor its reads take)


class DepthRouter:
    """The routing options of one stream (METHOD.md sections 2-4 and 9) and the calls that route.

    Args:
        heads: depth-attention heads ``H``; 1 is single-head AttnRes.
        eps: RMSNorm epsilon of the keys.
        score: ``"softmax"`` or the ``"sigmoid"`` ablation.
        key_norm: RMSNorm on the keys (``False`` is an ablation).
        backend: a name from ``ops.registry.NAMES``; one that can never serve these options
            raises ``ValueError`` here, before any work.
        per_token_query: the queries are ``[..., D]`` per token (the input-dependent ablation).
        defer_source_grads: on a backend that ``defers_source_grads``, form each completed
            source's gradient once, at its own backward (``ops.source_ledger``), instead of
            accumulating one term per read; ``False`` accumulates (the same gradients, summed
            in another order). Not while ``torch.compile`` traces: a ledger follows tensors by
            identity, which a traced graph does not keep; there the gradients accumulate.
    """

    def __init__(self, *, heads: int = 1, eps: float = 1e-6, score: str = "softmax", key_norm: bool = True,
                 backend: str = "auto", per_token_query: bool = False, defer_source_grads: bool = True):
        validate(backend, score=score, key_norm=key_norm, per_token_query=per_token_query)
        self.defer_source_grads = bool(defer_source_grads)
        self.heads, self.eps, self.score, self.key_norm = heads, eps, score, key_norm
        self.backend, self.per_token_query = backend, per_token_query
        self.options = dict(heads=heads, eps=eps, score=score, key_norm=key_norm)  # what every backend call takes

    def start(self, like: torch.Tensor, *, two_phase: bool = False) -> RoutingMemo:
        """The memo of a new pass over sources like ``like`` (the backend is chosen from its
        device and dtype). ``two_phase``: the stream opens blocks, so that with autograd off a
        backend with ``scores_ahead`` scores each source once (the inference path)."""
        backend = pick(self.backend, Request(like.device.type, like.dtype, self.score, self.key_norm,
                                             self.per_token_query))
        ledger = None
        if (backend.defers_source_grads and self.defer_source_grads and torch.is_grad_enabled()
                and not torch.compiler.is_compiling()):
            ledger = SourceLedger(backend.ops.source_grad, self.options, like.dtype)
        if torch.is_grad_enabled():  # training: the sources scored as written, where the backend reads the logits
            scoring = ledger is not None and backend.scores_in_training and not self.per_token_query
        else:
            scoring = two_phase and backend.scores_ahead
        return RoutingMemo(backend.ops, (), () if scoring else None, None, ledger)

    def decode_backend(self, like: torch.Tensor) -> BackendOps | None:
        """The backend that runs a decode pass over sources like ``like`` (``decode_read``),
        or None: a decode pass runs with autograd off and static queries on a backend that
        ``decodes`` (the one ``start`` would pick)."""
        if torch.is_grad_enabled() or self.per_token_query:
            return None
        backend = pick(self.backend, Request(like.device.type, like.dtype, self.score, self.key_norm, False))
        return backend.ops if backend.decodes else None

    def add_source(self, memo: RoutingMemo, source: torch.Tensor, queries: torch.Tensor,
                   gains: torch.Tensor | None, first_site: int, tokens: torch.Size | None = None):
        """``(source, memo)`` with ``source`` ``[..., D]`` completed: prepared once for every
        read of it, and on the inference path scored against every site from ``first_site`` on.
        ``tokens``: for a source ``[D]`` shared by every token (Delta's null), the token shape it
        stands for; it is prepared and scored once, then expanded. The open block is closed."""
        ops = memo.backend
        prepared = ops.prepare(source, eps=self.eps, key_norm=self.key_norm)
        scores = memo.scores
        if scores is not None:
            site_gains = None if gains is None else gains[first_site:]
            scores = scores + (ops.score_source(source, queries[first_site:], site_gains,
                                                heads=self.heads, eps=self.eps, key_norm=self.key_norm,
                                                prepared=prepared),)
        if tokens is not None:
            source = source.expand(*tokens, source.shape[-1])
            prepared = None if prepared is None else prepared.expand(tokens)
        tracked = memo.tracked
        if memo.ledger is not None:
            tracked = tracked + ((source, memo.ledger.track(source, prepared)),)
        memo = RoutingMemo(memo.backend, memo.prepared + (prepared,), scores, None, memo.ledger, tracked)
        return source, memo

    def open_block(self, memo: RoutingMemo, sources: Sequence[torch.Tensor], queries: torch.Tensor,
                   gains: torch.Tensor | None, first: int, last: int, norm=None) -> RoutingMemo:
        """Phase 1 of the block of sites ``first .. last - 1``: their queries against the
        completed ``sources`` (all of them added with ``add_source``), the first through ``norm``
        (that site's pre-norm, or None)."""
        ops = memo.backend
        if memo.scores is not None and not torch.is_grad_enabled():
            outs, lse = ops.attend_scored(_score_rows(memo, queries, first, last), list(sources), score=self.score,
                                          norm=norm)
        else:
            logits = None if memo.scores is None else stack_scores(_score_rows(memo, queries, first, last), sources)
            outs, lse = ops.attend(queries[first:last], _read_sources(memo, sources),
                                   None if gains is None else gains[first:last], norm=norm, prepared=memo.prepared,
                                   logits=logits, **self.options)
        return memo._replace(phase_one=PhaseOne(outs, lse, first))

    def read(self, memo: RoutingMemo, site: int, partial: torch.Tensor | None, queries: torch.Tensor,
             gains: torch.Tensor | None, norm=None) -> torch.Tensor:
        """The read of ``site`` in the open block: ``sum_j alpha_j v_j`` over the completed
        sources and ``partial`` (``P_i``, None when empty), through ``norm`` when given (the
        same norm the block's first site gave ``open_block``, or None)."""
        ph = memo.phase_one
        o1 = ph.outs[site - ph.first_site]
        if partial is None:  # the block's first read: phase 1 alone, normalized there
            return o1
        return memo.backend.merge(
            o1, ph.lse[site - ph.first_site], partial, queries[site], None if gains is None else gains[site],
            norm=norm, **self.options)

    def route(self, memo: RoutingMemo, sources: Sequence[torch.Tensor], query: torch.Tensor,
              gain: torch.Tensor | None, norm=None, among: Sequence[int] | None = None,
              site: tuple[int, int] | None = None) -> torch.Tensor:
        """One read on its own: ``sum_j alpha_j v_j`` over ``sources`` (the completed ones first,
        in the order they were added, then any not added, such as a partial sum) with ``query``
        ``[D]`` (or ``[..., D]`` per token) and ``gain``, through ``norm`` (the read's pre-norm,
        fused where the backend can) when given. ``among``: for a read of some of the completed
        sources (Full's window), the index each of ``sources`` was added at. ``site``: ``(i,
        sites)``, the read's site among the stream's ``sites``, so that a read of completed
        sources alone takes their logits from the memo's scores when it has them."""
        among = range(len(sources)) if among is None else among
        prepared = tuple(memo.prepared[j] if j < len(memo.prepared) else None for j in among)
        logits = None
        if memo.scores is not None and site is not None and all(j < len(memo.scores) for j in among):
            i, end = site
            rows = [memo.scores[j][..., i - end:i - end + 1 or None, :] for j in among]
            logits = stack_scores(rows, sources)
        outs, _ = memo.backend.attend(
            query[None], _read_sources(memo, sources, among), None if gain is None else gain[None], norm=norm,
            prepared=prepared, logits=logits, **self.options)
        return outs[0]

    def route_with_weights(self, sources: Sequence[torch.Tensor], query: torch.Tensor,
                           gain: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """``(mixed, weights)`` on the reference path: the read and its depth weights
        ``[N, ..., H]``, for analysis (a traced pass)."""
        return depth_attention_naive(query, list(sources), gain, return_weights=True, **self.options)

    def __repr__(self) -> str:
        return (f"DepthRouter(heads={self.heads}, score={self.score}, key_norm={self.key_norm}, "
                f"backend={self.backend}, defer_source_grads={self.defer_source_grads})")


def _score_rows(memo: RoutingMemo, queries: torch.Tensor, first: int, last: int) -> list[torch.Tensor]:
    """Each completed source's logits ``[..., last - first, H]`` for the sites ``first .. last -
    1``: its scores run from the first site that reads it to the last row of ``queries``, so
    those sites are the same rows counted from the end."""
    end = queries.shape[0]
    return [s[..., first - end:last - end or None, :] for s in memo.scores]


def _read_sources(memo: RoutingMemo, sources: Sequence[torch.Tensor],
                  among: Sequence[int] | None = None) -> list[torch.Tensor]:
    """``sources`` as a read takes them: each completed source a ledger tracks replaced by the
    tensor ``track`` returned for it (``among``: the index each was added at, by default its
    position). The state keeps the sources themselves, so that a hook or ``autograd.grad`` on one
    sees its whole gradient, the ledger's terms included."""
    sources = list(sources)
    among = range(len(sources)) if among is None else among
    for position, j in enumerate(among):
        if j < len(memo.tracked) and sources[position] is memo.tracked[j][0]:
            sources[position] = memo.tracked[j][1]
    return sources
