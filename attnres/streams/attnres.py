"""Attention Residuals: Full and Block AttnRes, single- or multi-head (docs/METHOD.md sections 2-4).

Full  stores: every new output ``[e, v_0, ..., v_{i-1}]``.
      reads:  ``RMSNorm_{g_i}(sum_j alpha_j v_j)`` with ``alpha = softmax_j(w_i . RMSNorm_{k_i}(v_j))``.
      writes: appends ``v_i``.
Block stores: ``e``, the completed block sums ``B_0..B_{n-1}`` and the partial sum ``P_i``.
      reads:  the same routing over ``[e, B_0, ..., B_{n-1}] (+ [P_i] when p > 0)``.
      writes: adds ``v_i`` to the partial; the partial becomes a block at each block's end (every
              ``S`` sublayers, or after ``n_0, n_0 + n_1, ...`` with uneven ``block_sizes``).

Every routing site (sublayer ``i``, and ``M`` for the output) has its own pseudo-query, the row
``pseudo_queries[i]`` (zero-init: uniform weights), and key-norm gain ``key_gains[i]`` (init 1).
``heads > 1`` is Multi-Head AttnRes: the query and keys are split into ``heads`` slices, each with
its own depth softmax.

The streams hold the math; ``ops.DepthRouter`` runs it on a backend, keeping what that backend
needs between calls in the state's ``memo``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import nn

from ..ops import BACKENDS, DepthRouter, RoutingMemo, get, static_depth_weights, weighted_depth_sum
from .base import KeepsEverySource, Stream, Trace, resolve_block_sizes
from .decode import BlockDecoder, FullDecoder

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


class BlockState(NamedTuple):
    """``blocks``: the completed sources, ``(e, B_0, ..., B_{n-1})`` (Delta: ``null`` first);
    ``partial``: ``P_i``, the sum of the current block's outputs so far (None when empty);
    ``memo``: what the routing backend keeps between calls (``ops.RoutingMemo``);
    ``written``: how many sublayers the state holds (``i`` before sublayer ``i``)."""

    blocks: tuple[torch.Tensor, ...]
    partial: torch.Tensor | None
    memo: RoutingMemo
    written: int = 0


class BlockRoutingStream(DepthRoutingStream):
    """Block bookkeeping and the two-phase computation, shared by Block and Delta AttnRes.

    The output routing is treated as a virtual sublayer ``M`` after the last one: it opens a
    block of its own when the last block is completed, and otherwise reads that block as the
    partial (equal blocks of ``S`` that do not divide ``M``), which gives exactly the output's
    sources of METHOD.md section 3 (the partial final block included when non-empty).

    With ``two_phase=True`` (default), each block's queries are scored against its completed
    sources once when the block opens (``init`` and the ``write`` that closes the previous
    block); a read then only merges its partial sum, with the read's norm fused for Block. With
    ``two_phase=False``, input-dependent queries (not known before the data) or a traced
    read, every read routes on its own (the path the two-phase one is tested against).
    """

    counts_writes = True
    #: whether a read is the routed mix through the site's norm (Block), so that phase 1 can
    #: return a block's first read already normalized; Delta adds its own stream first
    reads_are_normed_mixes = False

    def __init__(
        self,
        dim: int,
        num_sublayers: int,
        eps: float = 1e-6,
        *,
        block_size: int | None = None,
        num_blocks: int | None = None,
        block_sizes: tuple[int, ...] | None = None,
        two_phase: bool = True,
        **options,
    ):
        super().__init__(dim, num_sublayers, eps, **options)
        sizes, closes_last = resolve_block_sizes(num_sublayers, block_size, num_blocks, block_sizes)
        self.block_sizes = sizes
        #: the equal block size ``S``, or None for uneven blocks
        self.block_size = sizes[0] if block_sizes is None else None
        # a block is completed after sublayer i when i + 1 is one of its ends; each end starts the
        # next block, whose sites run to the next end (the last one, to the output routing M)
        ends = list(itertools.accumulate(sizes))
        if not closes_last:
            ends.pop()
        self._ends = frozenset(ends)
        starts = [0, *ends]
        self._block_sites = {first: (starts[k + 1] if k + 1 < len(starts) else num_sublayers + 1)
                             for k, first in enumerate(starts)}
        self.two_phase = bool(two_phase)
        # blocks run phase 1 when asked and when every query of a block is known before the data
        self.opens_blocks = self.two_phase and self.query == "static"

    @property
    def num_blocks(self) -> int:
        return len(self.block_sizes)

    def _begin(self, e: torch.Tensor) -> BlockState:
        """No source yet, for a pass over data like ``e``."""
        return BlockState((), None, self.router.start(e, two_phase=self.opens_blocks))

    def sources(self, state: BlockState) -> tuple[torch.Tensor, ...]:
        """Every source of the current read: the completed ones plus ``P_i`` when not empty."""
        return state.blocks + ((state.partial,) if state.partial is not None else ())

    def _complete(self, state: BlockState, source: torch.Tensor, first_site: int, tokens=None) -> BlockState:
        """``state`` with ``source`` added to the completed sources (and nothing partial), before
        sublayer ``first_site``. ``tokens``: for a source ``[D]`` shared by every token (Delta's
        null), the token shape it stands for."""
        source, memo = self._add_source(state.memo, source, first_site, tokens)
        return BlockState(state.blocks + (source,), None, memo, state.written)

    def _open_block(self, state: BlockState, first_site: int) -> BlockState:
        """Phase 1 of the block whose first sublayer is ``first_site`` (two-phase path)."""
        if not self.opens_blocks:
            return state
        last = self._block_sites[first_site]
        norm = self._site_norm(first_site) if self.reads_are_normed_mixes else None
        memo = self.router.open_block(state.memo, state.blocks, self.pseudo_queries, self.key_gains, first_site,
                                      last, norm)
        return state._replace(memo=memo)

    def _block_mix(self, site: int, state: BlockState, norm=None) -> torch.Tensor:
        """``sum_j alpha_j v_j`` of ``site`` (a sublayer, or ``M`` for the output) over the
        state's sources, through ``norm`` when given (fused): merged into the block's phase 1 on
        the two-phase path, one routing call otherwise. Untraced."""
        if not self.opens_blocks:
            return self._route_sources(site, self.sources(state), state.memo, norm)
        return self.router.read(state.memo, site, state.partial, self.pseudo_queries, self.key_gains, norm)

    def _block_start(self, i: int) -> int:
        """The first site of the block that site ``i`` (``M``: the output) belongs to."""
        return max(first for first in self._block_sites if first <= i)

    def _source_sites(self) -> list[int]:
        """The site before which each completed source (e, then each block) becomes readable."""
        return sorted(self._block_sites)

    def _join_blocks(self, e: torch.Tensor, blocks: tuple[torch.Tensor, ...], partial: torch.Tensor | None,
                     i: int, first: BlockState | None = None) -> BlockState:
        """The block state before site ``i`` holding ``e``, the completed ``blocks`` and
        ``partial``: the sources added again in order (``first``: the state to add them to, by
        default an empty one), and the current block's phase 1 opened again, as a pass that had
        run up to ``i`` holds it."""
        sites = self._source_sites()
        n = sum(1 for site in sites if site <= i)  # e, and every block completed before i
        if len(blocks) + 1 != n or (partial is None) != (i == self._block_start(i)):
            raise ValueError(f"{self.kind} stream: the state before sublayer {i} holds e, {n - 1} completed "
                             f"block(s) and {'no' if i == self._block_start(i) else 'a'} partial sum, given "
                             f"{len(blocks)} block(s) and {'a' if partial is not None else 'no'} partial sum")
        state = first if first is not None else self._begin(e)
        for source, site in zip((e, *blocks), sites):
            state = self._complete(state, source, site)
        state = self._open_block(state, self._block_start(i))
        return BlockState(state.blocks, partial, state.memo, i)

    def _advance(self, state: BlockState, i: int, v: torch.Tensor) -> BlockState:
        """Add sublayer ``i``'s output to the partial sum; close the block after its last sublayer."""
        partial = v if state.partial is None else state.partial + v
        if i + 1 in self._ends:
            closed = BlockState(state.blocks, None, state.memo, i + 1)
            return self._open_block(self._complete(closed, partial, i + 1), i + 1)
        return BlockState(state.blocks, partial, state.memo, i + 1)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, block_sizes={self.block_sizes}, num_blocks={self.num_blocks}, "
            f"two_phase={self.two_phase}"
        )


class BlockAttnResStream(BlockRoutingStream):
    """Block AttnRes with block size ``S`` sublayers (``block_size``), ``num_blocks`` blocks
    (default 8, ``S = ceil(M / 8)``) or explicit sizes ``block_sizes`` ``(n_0, ..., n_{N-1})``
    summing to ``M`` (uneven blocks). ``S = 1`` is Full AttnRes."""

    kind = "block"
    decoder_class = BlockDecoder
    reads_are_normed_mixes = True

    def __init__(self, dim: int, num_sublayers: int, eps: float = 1e-6, **options):
        super().__init__(dim, num_sublayers, eps, **options)
        self._make_norms()

    def _init(self, e: torch.Tensor) -> BlockState:
        return self._open_block(self._complete(self._begin(e), e, 0), 0)

    def _read(self, state: BlockState, i: int, trace: Trace | None) -> torch.Tensor:
        if trace is not None:
            return self._read_traced(i, self.sources(state), trace)
        # on the two-phase path a block's first read comes normalized out of phase 1, a later one
        # out of the merge
        return self._block_mix(i, state, self._site_norm(i))

    def _write(self, state: BlockState, i: int, v: torch.Tensor) -> BlockState:
        return self._advance(state, i, v)

    def _output(self, state: BlockState, trace: Trace | None) -> torch.Tensor:
        return self._read(state, self.num_sublayers, trace)

    def _hidden(self, state: BlockState) -> tuple[torch.Size, torch.device]:
        first = state.blocks[0]
        return first.shape, first.device

    def _written(self, state: BlockState) -> int:
        return state.written

    def split_state(self, state: BlockState) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        return state.blocks, (() if state.partial is None else (state.partial,))

    def _join_state(self, completed, rest, i: int) -> BlockState:
        if not completed or len(rest) > 1:
            raise ValueError(f"block stream: the state is e, the completed blocks and at most one partial sum, given "
                             f"{len(completed)} completed sources and {len(rest)} other tensors")
        return self._join_blocks(completed[0], completed[1:], rest[0] if rest else None, i)
