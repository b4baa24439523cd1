"""Attention Residuals: what every depth routing shares, and Full AttnRes, single- or multi-head
(docs/METHOD.md sections 2-4; Block AttnRes builds on it in streams/block.py).

Full  stores: every new output ``[e, v_0, ..., v_{i-1}]``.
      reads:  ``RMSNorm_{g_i}(sum_j alpha_j v_j)`` with ``alpha = softmax_j(w_i . RMSNorm_{k_i}(v_j))``.
      writes: appends ``v_i``.

Every routing site (sublayer ``i``, and ``M`` for the output) has its own pseudo-query, the row
``pseudo_queries[i]`` (zero-init: uniform weights), and key-norm gain ``key_gains[i]`` (init 1).
``heads > 1`` is Multi-Head AttnRes: the query and keys are split into ``heads`` slices, each with
its own depth softmax.

The streams hold the math; ``ops.DepthRouter`` runs it on a backend, keeping what that backend
needs between calls in the state's ``memo``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from ..ops import BACKENDS, DepthRouter, RoutingMemo, get, static_depth_weights, weighted_depth_sum
from .base import KeepsEverySource, Stream, Trace
from .decode import FullDecoder

QUERIES = ("static", "input")
#: how the input-dependent term of a query is scaled: not at all, or by ``1/sqrt(D/H)``
QUERY_SCALES = ("off", "rsqrt")
#: what a windowed Full's output routing reads: the window, or every source
WINDOW_OUTPUTS = ("window", "all")


class DepthRoutingStream(Stream):
    """Parameters and the routing call shared by the AttnRes family.

    Args:
        heads: depth-attention heads ``H`` (must divide ``dim``); 1 is single-head AttnRes.
        query: ``"static"`` (a learned pseudo-query, the method) or ``"input"`` (METHOD.md section 9
            ablation: ``w_i + W_i @ latest_source`` with ``W_i`` ``[D, D]`` zero-initialized;
            per-token queries, which only the reference backend takes).
        query_scale: with ``query="input"``, ``"off"`` or ``"rsqrt"``: the input-dependent term
            ``W_i v`` times ``1/sqrt(D/H)`` (the static pseudo-query is not scaled).
        query_gate: with ``query="input"``, a learned scalar ``g_i`` per site, initialized to 0,
            multiplying the input-dependent term: ``w_i + g_i W_i v``; ``W_i`` is then drawn as
            the model's other projections (``normal_init_weights``), so that both learn (a zero
            gate times a zero matrix would take no gradient).
        score: ``"softmax"`` or the ``"sigmoid"`` ablation.
        key_norm: RMSNorm on the keys (``False`` is an ablation; then there are no key gains).
        backend: the routing backend, a name from ``ops.NAMES`` (``"auto"`` by default); an
            explicit one that cannot serve these options raises ``ValueError``.
    """

    def __init__(
        self,
        dim: int,
        num_sublayers: int,
        eps: float = 1e-6,
        *,
        heads: int = 1,
        query: str = "static",
        query_scale: str = "off",
        query_gate: bool = False,
        score: str = "softmax",
        key_norm: bool = True,
        backend: str = "auto",
    ):
        super().__init__(dim, num_sublayers, eps)
        if not isinstance(heads, int) or heads < 1 or dim % heads:
            raise ValueError(f"heads={heads!r} must be a positive integer dividing dim={dim}")
        if query not in QUERIES:
            raise ValueError(f"query={query!r} is not one of {QUERIES}")
        if query_scale not in QUERY_SCALES:
            raise ValueError(f"query_scale={query_scale!r} is not one of {QUERY_SCALES}")
        if type(query_gate) is not bool:
            raise ValueError(f"query_gate={query_gate!r} must be True or False")
        if query != "input" and (query_scale != "off" or query_gate):
            given = "query_scale=" + repr(query_scale) if query_scale != "off" else "query_gate=True"
            raise ValueError(f"{given} applies to the input-dependent query (query='input'), not query={query!r}")
        self.router = DepthRouter(heads=heads, eps=eps, score=score, key_norm=bool(key_norm), backend=backend,
                                  per_token_query=query == "input")
        self.query = query
        sites = num_sublayers + 1  # one per sublayer, plus the output routing
        self.pseudo_queries = nn.Parameter(torch.zeros(sites, dim))
        self.key_gains = nn.Parameter(torch.ones(sites, dim)) if self.key_norm else None
        self.query_proj = nn.Parameter(torch.zeros(sites, dim, dim)) if query == "input" else None
        self.query_scale = query_scale
        self.query_gates = nn.Parameter(torch.zeros(sites)) if query_gate else None

    # the routing options live in the router; read-only here
    heads = property(lambda self: self.router.heads)
    score = property(lambda self: self.router.score)
    key_norm = property(lambda self: self.router.key_norm)
    backend = property(lambda self: self.router.backend)

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.zeros_(self.pseudo_queries)
        if self.key_gains is not None:
            nn.init.ones_(self.key_gains)
        if self.query_proj is not None:
            nn.init.zeros_(self.query_proj)
        if self.query_gates is not None:
            nn.init.zeros_(self.query_gates)

    def normal_init_weights(self) -> list[nn.Parameter]:
        # a gated input query's projection starts as the model's projections do (its gate at 0)
        return [self.query_proj] if self.query_gates is not None else []

    def no_weight_decay(self) -> set[str]:
        names = super().no_weight_decay() | {"pseudo_queries"}
        if self.key_gains is not None:
            names.add("key_gains")
        return names

    def _add_source(self, memo: RoutingMemo, source: torch.Tensor, first_site: int, tokens=None):
        """``(source, memo)`` with ``source`` completed before sublayer ``first_site``."""
        return self.router.add_source(memo, source, self.pseudo_queries, self.key_gains, first_site, tokens)

    def _site_query(self, site: int, sources: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(query, gain)`` of ``site``: its pseudo-query ``[D]`` (input-dependent queries: plus
        ``W_site`` times the latest source, per token ``[..., D]``, times ``1/sqrt(D/H)`` with
        ``query_scale="rsqrt"`` and the site's gate with ``query_gate``) and its key-norm gain."""
        query = self.pseudo_queries[site]
        if self.query_proj is not None:
            term = sources[-1].to(query.dtype) @ self.query_proj[site].T
            if self.query_scale == "rsqrt":
                term = term * (self.dim // self.heads) ** -0.5
            if self.query_gates is not None:
                term = self.query_gates[site] * term
            query = query + term
        return query, None if self.key_gains is None else self.key_gains[site]

    def _route_sources(self, site: int, sources: Sequence[torch.Tensor], memo: RoutingMemo,
                       norm=None) -> torch.Tensor:
        """``sum_j alpha_j v_j`` of ``site`` over ``sources`` in one routing call on the pass's
        backend, through ``norm`` (the site's norm, fused where the backend can) when given."""
        return self.router.route(memo, sources, *self._site_query(site, sources), norm,
                                 site=(site, self.num_sublayers + 1))

    def _route_traced(self, site: int, sources: Sequence[torch.Tensor], trace: Trace) -> torch.Tensor:
        """``sum_j alpha_j v_j`` of ``site`` over ``sources`` on the reference path, before the
        site's norm; its depth weights recorded in ``trace`` (and the sources, when it keeps them)."""
        mixed, weights = self.router.route_with_weights(sources, *self._site_query(site, sources))
        trace.depth_weights[site] = weights.detach()
        if trace.keep_sources:
            trace.sources[site] = [s.detach() for s in sources]
        return mixed

    def _read_traced(self, site: int, sources: Sequence[torch.Tensor], trace: Trace) -> torch.Tensor:
        """The traced read of ``site`` over ``sources`` through its norm, its RMS recorded."""
        return self._finish_read(site, self._route_traced(site, sources, trace), trace)

    #: the design's decoder (``streams/decode.py``), made for a decode pass on a backend that decodes
    decoder_class: type | None = None

    def _decoder(self, like: torch.Tensor):
        fns = None if self.decoder_class is None else self.router.decode_backend(like)
        return None if fns is None else self.decoder_class(self, like, fns)

    def extra_repr(self) -> str:
        query = f"query={self.query}"
        if self.query_proj is not None:
            query += f", query_scale={self.query_scale}, query_gate={self.query_gates is not None}"
        return (f"{super().extra_repr()}, heads={self.heads}, {query}, score={self.score}, key_norm={self.key_norm}, "
                f"backend={self.backend}")


class FullState(NamedTuple):
    """``sources``: ``(e, v_0, ..., v_{i-1})``; ``memo``: what the routing backend keeps."""

    sources: tuple[torch.Tensor, ...]
    memo: RoutingMemo


MIXINGS = ("attention", "learned")


class FullAttnResStream(KeepsEverySource, DepthRoutingStream):
    """Full AttnRes: the state holds every source ``(e, v_0, ..., v_{i-1})``.

    Two ablations of the read (METHOD.md section 9), for which a read runs on its own (no
    decoder):

    - ``mixing="learned"``: input-independent weights, ``alpha_{i,j} = softmax_j(l_{i,j})`` with
      learned logits ``mixing_logits[i, j, h]`` ``[M + 1, M + 1, H]`` (row ``i``: site ``i``;
      column ``j``: source ``j``, ``e`` first; the entries past a site's sources are never read),
      initialized to 0 (uniform weights, so that the first forward is Full's at its init); no
      keys, queries or key gains. It mixes with plain PyTorch ops (``ops.weighted_depth_sum``) on
      any device: ``backend`` ``"auto"`` or one that runs on any device; it cannot combine with
      ``query="input"``, ``score="sigmoid"`` or ``key_norm=False``, which only attention has.
    - ``window=W``: site ``i`` reads ``e`` and the last ``W`` outputs ``v_{i-W} .. v_{i-1}``
      (all of them while ``i <= W``). The output routing reads the last ``W`` of all with
      ``window_output="window"``, or every source with ``"all"``. ``W >= M`` is Full. Every
      backend serves it (a read over fewer sources), with either mixing.
    """

    kind = "full"
    decoder_class = FullDecoder

    def __init__(self, dim: int, num_sublayers: int, eps: float = 1e-6, *, mixing: str = "attention",
                 window: int | None = None, window_output: str = "window", **options):
        if mixing not in MIXINGS:
            raise ValueError(f"mixing={mixing!r} is not one of {MIXINGS}")
        if window is not None and (type(window) is not int or window < 1):
            raise ValueError(f"window={window!r} must be None (every source) or an integer >= 1")
        if window_output not in WINDOW_OUTPUTS:
            raise ValueError(f"window_output={window_output!r} is not one of {WINDOW_OUTPUTS}")
        if window is None and window_output != "window":
            raise ValueError(f"window_output={window_output!r} says what a window's output routing reads: it "
                             f"applies with window=W, and without a window the output reads every source")
        if mixing == "learned":
            _check_learned_mixing(options)
        super().__init__(dim, num_sublayers, eps, **options)
        self.mixing, self.window, self.window_output = mixing, window, window_output
        self._make_norms()
        if mixing == "learned":  # no attention: its parameters would take no gradient
            sites = num_sublayers + 1
            self.pseudo_queries = self.key_gains = None
            self.mixing_logits = nn.Parameter(torch.zeros(sites, sites, self.heads))
        else:
            self.mixing_logits = None

    def reset_parameters(self) -> None:
        if self.mixing_logits is None:
            super().reset_parameters()
            return
        Stream.reset_parameters(self)
        nn.init.zeros_(self.mixing_logits)

    def no_weight_decay(self) -> set[str]:
        if self.mixing_logits is None:
            return super().no_weight_decay()
        return Stream.no_weight_decay(self) | {"mixing_logits"}

    def sources_read(self, site: int) -> list[int]:
        """The indices into ``(e, v_0, ..., v_{M-1})`` that site ``site`` (``M``: the output)
        reads: all ``site + 1``, or with a window ``e`` and the last ``W`` outputs (the output
        routing all of them with ``window_output="all"``)."""
        if self.window is None or site <= self.window or (site == self.num_sublayers and self.window_output == "all"):
            return list(range(site + 1))
        return [0, *range(site + 1 - self.window, site + 1)]

    def _init(self, e: torch.Tensor) -> FullState:
        if self.mixing_logits is not None:
            return FullState((e,), None)
        e, memo = self._add_source(self.router.start(e), e, 0)
        return FullState((e,), memo)

    def _read(self, state: FullState, i: int, trace: Trace | None) -> torch.Tensor:
        among = self.sources_read(i)
        sources = [state.sources[j] for j in among]
        if self.mixing_logits is not None:
            weights = static_depth_weights(self.mixing_logits[i, among])  # [n, H]
            if trace is not None:  # the same weights for every token
                tokens = sources[0].shape[:-1]
                per_token = weights.view(len(among), *(1,) * len(tokens), self.heads).expand(-1, *tokens, -1)
                self._record_weights(trace, i, per_token, among)
            return self._finish_read(i, weighted_depth_sum(weights, sources), trace)
        if trace is not None:
            mixed = self._route_traced(i, sources, trace)
            self._record_weights(trace, i, trace.depth_weights[i], among)
            return self._finish_read(i, mixed, trace)
        # the norm fused: backward recomputes the mix instead of keeping it
        return self.router.route(state.memo, sources, *self._site_query(i, sources), self._site_norm(i), among,
                                 site=(i, self.num_sublayers + 1))

    @staticmethod
    def _record_weights(trace: Trace, site: int, weights: torch.Tensor, among: list[int]) -> None:
        """A traced read's weights ``[n, ..., H]`` as ``[site + 1, ..., H]``, one row per source
        of Full (zero for a source outside the window), so that columns mean the same sources at
        every site."""
        full = weights.new_zeros(site + 1, *weights.shape[1:])
        full[among] = weights.detach()
        trace.depth_weights[site] = full

    def _write(self, state: FullState, i: int, v: torch.Tensor) -> FullState:
        if self.mixing_logits is not None:
            return FullState(state.sources + (v,), None)
        v, memo = self._add_source(state.memo, v, i + 1)
        return FullState(state.sources + (v,), memo)

    def _output(self, state: FullState, trace: Trace | None) -> torch.Tensor:
        return self._read(state, self.num_sublayers, trace)

    def _decoder(self, like: torch.Tensor):
        if self.mixing_logits is not None or self.window is not None:
            return None  # the decoder reads every source by attention
        return super()._decoder(like)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, mixing={self.mixing}, window={self.window}, window_output={self.window_output}"


def _check_learned_mixing(options: dict) -> None:
    """``mixing="learned"`` has no attention: refuse the options only attention has, naming them,
    and a routing backend it would not use."""
    clash = [f"{name}={options[name]!r}" for name, default in (("query", "static"), ("score", "softmax"),
                                                               ("key_norm", True))
             if name in options and options[name] != default]
    if clash:
        raise ValueError(f"mixing='learned' has input-independent weights and no keys; it cannot combine with "
                         f"{', '.join(clash)} (options of mixing='attention')")
    backend = options.get("backend", "auto")
    plain = ["auto", *(name for name, b in BACKENDS.items() if b.devices is None)]  # PyTorch ops, any device
    if backend not in plain:
        get(backend)  # ValueError naming the accepted ones
        raise ValueError(f"mixing='learned' mixes with plain PyTorch ops, on no routing backend: backend={backend!r} "
                         f"cannot serve it; give one of {plain}")
