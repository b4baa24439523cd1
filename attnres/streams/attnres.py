"""Attention Residuals: Full and Block AttnRes, single- or multi-head (SPEC sections 2-4).

Full  stores: every new output ``[e, v_0, ..., v_{i-1}]``.
      reads:  ``RMSNorm_{g_i}(sum_j alpha_j v_j)`` with ``alpha = softmax_j(w_i . RMSNorm_{k_i}(v_j))``.
      writes: appends ``v_i``.
Block stores: ``e``, the completed block sums ``B_0..B_{n-1}`` and the partial sum ``P_i``.
      reads:  the same routing over ``[e, B_0, ..., B_{n-1}] (+ [P_i] when p > 0)``.
      writes: adds ``v_i`` to the partial; the partial becomes a block every ``S`` sublayers.

Every routing site (sublayer ``i``, and ``M`` for the output) has its own pseudo-query, the row
``pseudo_queries[i]`` (zero-init: uniform weights), and key-norm gain ``key_gains[i]`` (init 1).
``heads > 1`` is Multi-Head AttnRes: the query and keys are split into ``heads`` slices, each with
its own depth softmax.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..ops import (
    depth_attention,
    inverse_rms,
    merge,
    merge_and_norm,
    mix_scored,
    multi_query_attention,
    resolve_backend,
    source_scores,
)
from ..ops.depth_attention import BACKENDS, SCORES
from .base import Stream, resolve_block_size

QUERIES = ("static", "input")


class DepthRoutingStream(Stream):
    """Parameters and the routing call shared by the AttnRes family.

    Args:
        heads: depth-attention heads ``H`` (must divide ``dim``); 1 is single-head AttnRes.
        query: ``"static"`` (a learned pseudo-query, the method) or ``"input"`` (SPEC section 9
            ablation: ``w_i + W_i @ latest_source`` with ``W_i`` ``[D, D]`` zero-initialized).
        score: ``"softmax"`` or the ``"sigmoid"`` ablation.
        key_norm: RMSNorm on the keys (``False`` is an ablation; then there are no key gains).
        backend: depth-attention backend (``ops.depth_attention``): ``"auto"``, ``"cpu"``,
            ``"torch"``, ``"triton"`` or ``"naive"``. The input-dependent query ablation always
            runs on ``"naive"``.
    """

    options = ("heads", "query", "score", "key_norm", "backend")

    def __init__(
        self,
        dim: int,
        num_sublayers: int,
        eps: float = 1e-6,
        *,
        heads: int = 1,
        query: str = "static",
        score: str = "softmax",
        key_norm: bool = True,
        backend: str = "auto",
    ):
        super().__init__(dim, num_sublayers, eps)
        if backend not in BACKENDS:
            raise ValueError(f"backend={backend!r} is not one of {BACKENDS}")
        if not isinstance(heads, int) or heads < 1 or dim % heads:
            raise ValueError(f"heads={heads!r} must be a positive integer dividing dim={dim}")
        if query not in QUERIES:
            raise ValueError(f"query={query!r} is not one of {QUERIES}")
        if score not in SCORES:
            raise ValueError(f"score={score!r} is not one of {SCORES}")
        self.heads = heads
        self.query = query
        self.score = score
        self.key_norm = bool(key_norm)
        self.backend = "naive" if query == "input" else backend
        sites = num_sublayers + 1  # one per sublayer, plus the output routing
        self.pseudo_queries = nn.Parameter(torch.zeros(sites, dim))
        self.key_gains = nn.Parameter(torch.ones(sites, dim)) if self.key_norm else None
        self.query_proj = nn.Parameter(torch.zeros(sites, dim, dim)) if query == "input" else None

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.zeros_(self.pseudo_queries)
        if self.key_gains is not None:
            nn.init.ones_(self.key_gains)
        if self.query_proj is not None:
            nn.init.zeros_(self.query_proj)

    def no_weight_decay(self) -> set[str]:
        names = super().no_weight_decay() | {"pseudo_queries"}
        if self.key_gains is not None:
            names.add("key_gains")
        return names

    def _chosen_backend(self, v: torch.Tensor) -> str:
        """The backend that routes sources like ``v`` (``ops.resolve_backend``)."""
        return resolve_backend(self.backend, device_type=v.device.type, score=self.score,
                               key_norm=self.key_norm, dtype=v.dtype)

    def key_stats(self, v: torch.Tensor) -> torch.Tensor | None:
        """The inverse RMS ``[...]`` of a new source ``v``, computed once and shared by every read
        of it (SPEC section 11: normalize each source once), or None where no read would use it
        (no key norm, tracing, or a backend that normalizes inside its kernel)."""
        if not self.key_norm or self.trace is not None:
            return None
        return inverse_rms(v, self.eps) if self._chosen_backend(v) in ("torch", "cpu") else None

    def scores_ahead(self, v: torch.Tensor, first_site: int, stats: torch.Tensor | None) -> torch.Tensor | None:
        """With autograd off on the ``torch`` or ``cpu`` backend (the inference path): the logits
        ``[..., M + 1 - first_site, H]`` of a new source ``v`` for every site from
        ``first_site`` on, computed once (``ops.source_scores``); otherwise None."""
        if torch.is_grad_enabled():
            return None
        if self._chosen_backend(v) not in ("torch", "cpu"):
            return None
        gains = None if self.key_gains is None else self.key_gains[first_site:]
        return source_scores(v, self.pseudo_queries[first_site:], gains, heads=self.heads, eps=self.eps,
                             key_norm=self.key_norm, inv_rms=stats)

    def route(self, site: int, sources: list[torch.Tensor], stats: list | None = None) -> torch.Tensor:
        """``sum_j alpha_j v_j`` over ``sources`` with the query and gain of ``site``; ``stats``
        optionally holds each source's ``key_stats`` (None entries are computed on the way)."""
        query = self.pseudo_queries[site]
        if self.query_proj is not None:
            # input-dependent query from the latest source, per token: [..., D]
            query = query + sources[-1].to(query.dtype) @ self.query_proj[site].T
        gain = self.key_gains[site] if self.key_gains is not None else None
        kwargs = dict(self._routing_kwargs(), backend=self.backend)
        if self.trace is None:
            return depth_attention(query, sources, gain, inv_rms=stats, **kwargs)
        mixed, weights = depth_attention(query, sources, gain, return_weights=True, **kwargs)
        self.trace.depth_weights[site] = weights.detach()
        if self.trace.keep_sources:
            self.trace.sources[site] = [s.detach() for s in sources]
        return mixed

    def _routing_kwargs(self) -> dict:
        return dict(heads=self.heads, eps=self.eps, score=self.score, key_norm=self.key_norm)

    def _site_norm(self, site: int) -> nn.Module:
        """The pre-norm of sublayer ``site``, or the final norm for the output (``site == M``)."""
        return self.final_norm if site == self.num_sublayers else self.norms[site]

    def _finish_read(self, site: int, h: torch.Tensor) -> torch.Tensor:
        """Record and apply the pre-norm of ``site`` (the final norm for the output)."""
        self._record_rms(site, h)
        return self._site_norm(site)(h)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, heads={self.heads}, query={self.query}, score={self.score}, "
            f"key_norm={self.key_norm}, backend={self.backend}"
        )


class FullState(NamedTuple):
    """``sources``: ``(e, v_0, ..., v_{i-1})``; ``stats``: each source's ``key_stats`` (entries
    None where no read uses them)."""

    sources: tuple[torch.Tensor, ...]
    stats: tuple[torch.Tensor | None, ...]


class FullAttnResStream(DepthRoutingStream):
    """Full AttnRes: the state holds every source ``(e, v_0, ..., v_{i-1})``."""

    kind = "full"

    def __init__(self, dim: int, num_sublayers: int, eps: float = 1e-6, **options):
        super().__init__(dim, num_sublayers, eps, **options)
        self._make_norms()

    def init(self, e: torch.Tensor) -> FullState:
        return FullState((e,), (self.key_stats(e),))

    def read(self, state: FullState, i: int) -> torch.Tensor:
        return self._finish_read(i, self.route(i, list(state.sources), list(state.stats)))

    def write(self, state: FullState, i: int, v: torch.Tensor) -> FullState:
        return FullState(state.sources + (v,), state.stats + (self.key_stats(v),))

    def output(self, state: FullState) -> torch.Tensor:
        site = self.num_sublayers
        return self._finish_read(site, self.route(site, list(state.sources), list(state.stats)))


class PhaseOne(NamedTuple):
    """Phase 1 of the current block: every query of the block (sites ``first_site ..``) scored
    against the completed sources once. ``out``: ``S'`` tensors ``[..., D]``; ``lse``
    ``[S', ..., H]``."""

    out: tuple[torch.Tensor, ...]
    lse: torch.Tensor
    first_site: int


class BlockState(NamedTuple):
    """``blocks``: the completed sources, ``(e, B_0, ..., B_{n-1})`` (Delta: ``null`` first);
    ``partial``: ``P_i``, the sum of the current block's outputs so far (None when empty);
    ``phase_one``: the current block's phase-1 result on the two-phase path (else None);
    ``stats``: each completed source's ``key_stats`` (entries None where no read uses them);
    ``scores``: on the inference path, each completed source's ``scores_ahead`` (else empty)."""

    blocks: tuple[torch.Tensor, ...]
    partial: torch.Tensor | None
    phase_one: PhaseOne | None = None
    stats: tuple[torch.Tensor | None, ...] = ()
    scores: tuple[torch.Tensor, ...] = ()


class BlockRoutingStream(DepthRoutingStream):
    """Block bookkeeping and the two-phase computation, shared by Block and Delta AttnRes.

    The output routing is treated as a virtual sublayer ``M``: it sits at position
    ``M mod S`` of block ``M div S``, which gives exactly the output's sources of SPEC section 3
    (the partial final block included when non-empty).

    With ``two_phase=True`` (default) and a fast backend, each block's queries are scored
    against its completed sources once when the block opens (``init`` and the ``write`` that
    closes the previous block); a read then only merges its partial sum (``ops.merge_partial``,
    or ``ops.merge_and_norm`` with the read's norm fused for Block).
    While tracing, with ``backend="naive"`` or with per-token queries, every read routes on its
    own (the reference path the two-phase path is tested against).
    """

    options = DepthRoutingStream.options + ("block_size", "num_blocks", "two_phase")
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
        two_phase: bool = True,
        **options,
    ):
        super().__init__(dim, num_sublayers, eps, **options)
        self.block_size = resolve_block_size(num_sublayers, block_size, num_blocks)
        self.two_phase = bool(two_phase)

    @property
    def num_blocks(self) -> int:
        return -(-self.num_sublayers // self.block_size)

    def sources(self, state: BlockState) -> list[torch.Tensor]:
        """Every source of the current read: the completed ones plus ``P_i`` when not empty."""
        return list(state.blocks) + ([state.partial] if state.partial is not None else [])

    def start(self, e: torch.Tensor, state: BlockState = BlockState((), None)) -> BlockState:
        """The state before sublayer 0: ``e`` added to the completed sources of ``state``
        (none by default), block 0 open."""
        return self._open_block(self._complete(state, e, 0), 0)

    def _complete(self, state: BlockState, source: torch.Tensor, first_site: int,
                  tokens: torch.Size | None = None) -> BlockState:
        """``state`` with ``source`` added to the completed sources (and nothing partial), before
        sublayer ``first_site``. Scores are kept only while every completed source has them.
        ``tokens``: for a source ``[D]`` shared by every token (Delta's null), the token shape it
        stands for; it is normalized and scored once, then expanded."""
        r = self.key_stats(source)
        ahead = self.scores_ahead(source, first_site, r) if self._uses_two_phase() else None
        complete = ahead is not None and len(state.scores) == len(state.blocks)
        scores = state.scores + (ahead,) if complete else ()
        if tokens is not None:
            source = source.expand(*tokens, source.shape[-1])
            r = None if r is None else r.expand(tokens)
        return BlockState(state.blocks + (source,), None, None, state.stats + (r,), scores)

    def _uses_two_phase(self) -> bool:
        return self.two_phase and self.backend != "naive" and self.trace is None

    def _open_block(self, state: BlockState, first_site: int) -> BlockState:
        if not self._uses_two_phase():
            return state
        last = min(first_site + self.block_size, self.num_sublayers + 1)
        gains = None if self.key_gains is None else self.key_gains[first_site:last]
        norm = None
        if self.reads_are_normed_mixes:
            site_norm = self._site_norm(first_site)
            norm = (site_norm.weight, site_norm.eps)
        if state.scores:  # inference: every logit is already computed
            # each source's scores run from the first site that reads it to the output (M), so
            # this block's sites are the same rows counted from the end
            end = self.num_sublayers + 1
            rows = [s[..., first_site - end:last - end or None, :] for s in state.scores]
            kernels = self._chosen_backend(state.blocks[0]) == "cpu"
            out, lse = mix_scored(rows, list(state.blocks), score=self.score, norm=norm, kernels=kernels)
        else:
            out, lse = multi_query_attention(
                self.pseudo_queries[first_site:last], list(state.blocks), gains,
                backend=self.backend, inv_rms=list(state.stats), norm=norm, **self._routing_kwargs(),
            )
        return state._replace(phase_one=PhaseOne(out, lse, first_site))

    def _route_block(self, site: int, state: BlockState) -> torch.Tensor:
        """``h`` for ``site`` (a sublayer, or ``M`` for the output) before its norm."""
        ph = state.phase_one
        if ph is None or self.trace is not None:
            stats = list(state.stats) + ([None] if state.partial is not None else [])
            return self.route(site, self.sources(state), stats)
        o1 = ph.out[site - ph.first_site]
        if state.partial is None:  # first sublayer of a block: nothing to merge
            return o1
        gain = None if self.key_gains is None else self.key_gains[site]
        return merge(
            o1, ph.lse[site - ph.first_site], state.partial, self.pseudo_queries[site], gain,
            backend=self.backend, **self._routing_kwargs(),
        )

    def _route_block_normed(self, site: int, state: BlockState) -> torch.Tensor:
        """The read of ``site`` including its norm. On the two-phase path the norm is fused: a
        block's first read comes normalized out of phase 1, a merged read out of ``merge_and_norm``."""
        ph = state.phase_one
        if ph is None or self.trace is not None:
            return self._finish_read(site, self._route_block(site, state))
        if state.partial is None:  # the block's first read: normalized inside phase 1
            return ph.out[site - ph.first_site]
        norm = self._site_norm(site)
        gain = None if self.key_gains is None else self.key_gains[site]
        return merge_and_norm(
            ph.out[site - ph.first_site], ph.lse[site - ph.first_site], state.partial,
            self.pseudo_queries[site], gain, norm.weight, norm.eps,
            backend=self.backend, **self._routing_kwargs(),
        )

    def _advance(self, state: BlockState, i: int, v: torch.Tensor) -> BlockState:
        """Add sublayer ``i``'s output to the partial sum; close the block after its last sublayer."""
        partial = v if state.partial is None else state.partial + v
        if (i + 1) % self.block_size == 0:
            return self._open_block(self._complete(state, partial, i + 1), i + 1)
        return state._replace(partial=partial)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, block_size={self.block_size}, num_blocks={self.num_blocks}, "
            f"two_phase={self.two_phase}"
        )


class BlockAttnResStream(BlockRoutingStream):
    """Block AttnRes with block size ``S`` sublayers (``block_size``) or ``num_blocks`` blocks
    (default 8, ``S = ceil(M / 8)``). ``S = 1`` is Full AttnRes."""

    kind = "block"
    reads_are_normed_mixes = True

    def __init__(self, dim: int, num_sublayers: int, eps: float = 1e-6, **options):
        super().__init__(dim, num_sublayers, eps, **options)
        self._make_norms()

    def init(self, e: torch.Tensor) -> BlockState:
        return self.start(e)

    def read(self, state: BlockState, i: int) -> torch.Tensor:
        return self._route_block_normed(i, state)

    def write(self, state: BlockState, i: int, v: torch.Tensor) -> BlockState:
        return self._advance(state, i, v)

    def output(self, state: BlockState) -> torch.Tensor:
        return self._route_block_normed(self.num_sublayers, state)
