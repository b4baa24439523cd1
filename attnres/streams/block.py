"""Block AttnRes (docs/METHOD.md section 3): the routing over the embedding, the completed block
sums and the partial sum of the current block, single- or multi-head.

Block stores: ``e``, the completed block sums ``B_0..B_{n-1}`` and the partial sum ``P_i``.
      reads:  ``RMSNorm_{g_i}(sum_j alpha_j s_j)`` over ``s = [e, B_0, ..., B_{n-1}] (+ [P_i] when
              p > 0)``, ``alpha = softmax_j(w_i . RMSNorm_{k_i}(s_j))``.
      writes: adds ``v_i`` to the partial; the partial becomes a block at each block's end (every
              ``S`` sublayers, or after ``n_0, n_0 + n_1, ...`` with uneven ``block_sizes``).

``BlockRoutingStream`` holds what every block-structured routing shares (Delta AttnRes builds on
it, streams/delta.py); ``BlockAttnResStream`` is Block AttnRes itself.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from ..ops import RoutingMemo
from .attnres import DepthRoutingStream
from .base import Trace, resolve_block_sizes
from .decode import BlockDecoder


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
