"""Decoding: Full, Block and Delta AttnRes over one buffer of sources.

A decode pass is asked for, never inferred from a tensor's shape: ``Transformer.forward(...,
decode=True)``, which ``generate`` passes for each token after the prompt, and the Hugging Face
classes when they continue from a cache that holds earlier tokens. With autograd off,
``stream.decoder(e)`` gives the design's decoder where the routing backend decodes
(``DepthRouter.decode_backend``: the CPU kernels and the reference); the decoder runs the pass on
the protocol of a stream (``init``, ``read``, ``write``, ``output``, ``split_state``)::

    decoder = stream.decoder(e)        # a Decoder here, or the stream itself where there is none
    state = decoder.init(e)
    for i, sublayer in enumerate(sublayers):
        state = decoder.write(state, i, sublayer(decoder.read(state, i)))
    y = decoder.output(state)

The pass's sources sit one after another in one buffer ``[capacity, ..., D]`` (Delta: ``null``
first), and the open block's partial sum is built in the slot the block will take. A read is one
``decode_read`` call over the first ``count`` sources (the partial last) with its norm fused (for
Delta, ``h + a_i r_i`` and then the norm); a write is one in-place op (two for Delta, which also
adds to ``h``). Nothing is prepared or scored per source: at one position a read costs its call,
not its arithmetic, and the two-phase computation would only add calls. The backend reads any
number of positions, so a pass of several equals the ordinary pass too.

What a pass needs at every read (the queries with the key-norm gains folded in, the norms, Delta's
gates as numbers) is made once, when the decoder is made, and the checks of ``read`` and
``write`` compare Python integers inline, as ``Stream.read`` and ``Stream.write`` do: at batch 1
the Python calls per read are most of its cost.

A traced read routes copies of the buffer's sources on the reference path and records the
weights, as a traced read of the stream does. ``split_state`` gives the stream's tensors (copies:
later writes change the buffer in place); the stream's ``join_state`` continues from them with its
ordinary pass.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .base import Trace, refuse_index, refuse_order, refuse_output


class DecodeState(NamedTuple):
    """The state of a decode pass.

    ``sources``: ``[capacity, ..., D]``, the completed sources in order (Delta: ``null`` first),
    then, when ``has_partial``, the open block's partial sum in ``sources[count]``; ``written``:
    the sublayers written; ``h``: Delta's additive stream (a buffer of its own; None for Full and
    Block).

    A write changes the buffers in place and returns the next state: an earlier state is spent,
    as in a forward pass, which uses each state once."""

    sources: torch.Tensor
    count: int
    has_partial: bool
    written: int
    h: torch.Tensor | None = None


class Decoder:
    """The decode pass of a Full or Block AttnRes stream over embeddings like ``like``: blocks
    of sublayers whose sums become sources after the sublayer counts in ``ends`` (Full: after
    every sublayer, blocks of one).

    Args:
        stream: the stream whose parameters the pass reads (pseudo-queries, key gains, norms).
        like: the embedding ``[..., D]`` of the pass (its shape, dtype and device).
        fns: the backend that decodes (``stream.router.decode_backend(like)``).
        ends: the sublayer counts after which a block is completed.
    """

    def __init__(self, stream, like: torch.Tensor, fns, ends):
        self.stream = stream
        self.kind, self.num_sublayers = stream.kind, stream.num_sublayers
        self.shape, self.dtype, self.device = like.shape, like.dtype, like.device
        self.ends = frozenset(ends)
        self.decode_read, self.options = fns.decode_read, stream.router.options
        # folded in the math dtype (fp32, or fp64 for fp64), as the stream's reads fold them; one
        # row per site: a read takes its row without indexing a tensor
        dt = torch.promote_types(like.dtype, torch.float32)
        queries = stream.pseudo_queries.to(dt)
        if stream.key_gains is not None:
            queries = queries * stream.key_gains.to(dt)
        self.queries = queries.contiguous().unbind(0)
        self.norms = self._site_norms()

    def _site_norms(self) -> list:
        """Each site's norm: sublayer ``i``'s pre-norm, the final norm at ``M``."""
        return [*self.stream.norms, self.stream.final_norm]

    def _first_sources(self, e: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The sources completed before sublayer 0."""
        return (e,)

    def init(self, e: torch.Tensor) -> DecodeState:
        """The state before sublayer 0 from the embedding ``e`` the decoder was made for."""
        if not isinstance(e, torch.Tensor) or e.shape != self.shape or e.dtype != self.dtype or e.device != self.device:
            given = f"{tuple(e.shape)} {e.dtype} on {e.device}" if isinstance(e, torch.Tensor) else type(e).__name__
            raise ValueError(f"{self.kind} decoder: init takes the embedding it was made for, {tuple(self.shape)} "
                             f"{self.dtype} on {self.device}, given {given}")
        first = self._first_sources(e)
        # the completed sources, then an open block's partial where the last block is not closed
        capacity = len(first) + len(self.ends) + (self.num_sublayers not in self.ends)
        sources = e.new_empty((capacity, *e.shape))
        for slot, source in zip(sources, first):
            slot.copy_(source)
        return DecodeState(sources, len(first), False, 0)

    def read(self, state: DecodeState, i: int, trace: Trace | None = None) -> torch.Tensor:
        """What sublayer ``i`` consumes, ``[..., D]``, its pre-norm included."""
        # inline and in one condition, as in Stream.read: the checks run at every read of every token
        if type(i) is not int or not 0 <= i < self.num_sublayers or state.written != i:
            self._refuse(state, i, "read")
        return self._read(state, i, trace)

    def write(self, state: DecodeState, i: int, v: torch.Tensor) -> DecodeState:
        """The state after sublayer ``i`` produced ``v`` ``[..., D]``; ``state`` is spent."""
        if type(i) is not int or not 0 <= i < self.num_sublayers or state.written != i:
            self._refuse(state, i, "write")
        if not isinstance(v, torch.Tensor) or v.shape != self.shape or v.device != self.device:
            refuse_output(f"{self.kind} decoder", i, v, self.shape, self.device)
        return self._advance(state, i, v)

    def output(self, state: DecodeState, trace: Trace | None = None) -> torch.Tensor:
        """The final normalized hidden state ``[..., D]`` for the LM head."""
        if state.written != self.num_sublayers:
            raise RuntimeError(f"{self.kind} decoder: output needs all {self.num_sublayers} sublayers written, "
                               f"the state holds {state.written}")
        return self._read(state, self.num_sublayers, trace)

    def split_state(self, state: DecodeState) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """``(completed, rest)`` as the stream's ``split_state`` gives them (Full: every source;
        Block: ``e`` and the blocks, then the partial sum when there is one), as copies."""
        return self._copies(state, 0, state.count), self._copies(state, state.count)

    def _read(self, state: DecodeState, site: int, trace: Trace | None) -> torch.Tensor:
        """The read of ``site`` (``M``: the output) through its norm."""
        if trace is not None:
            return self.stream._read_traced(site, self._copies(state), trace)
        return self.decode_read(state.sources, state.count + state.has_partial, self.queries[site],
                                norm=self.norms[site], **self.options)

    def _advance(self, state: DecodeState, i: int, v: torch.Tensor) -> DecodeState:
        """Add sublayer ``i``'s output to the partial sum, in the slot its block will take: a
        closed block is only counted."""
        slot = state.sources[state.count]
        if state.has_partial:
            slot.add_(v)
        else:
            slot.copy_(v)
        if i + 1 in self.ends:
            return DecodeState(state.sources, state.count + 1, False, i + 1, state.h)
        return DecodeState(state.sources, state.count, True, i + 1, state.h)

    @staticmethod
    def _copies(state: DecodeState, first: int = 0, end: int | None = None) -> tuple[torch.Tensor, ...]:
        """Copies of the sources ``first .. end - 1`` (default: to the last, the partial when
        open): a traced read may keep them, and later writes change the buffer in place."""
        end = state.count + state.has_partial if end is None else end
        return tuple(source.clone() for source in state.sources[first:end])

    def _refuse(self, state: DecodeState, i, operation: str) -> None:
        if type(i) is not int or not 0 <= i < self.num_sublayers:
            refuse_index(f"{self.kind} decoder", self.num_sublayers, i, operation)
        refuse_order(f"{self.kind} decoder", i, operation, state.written)


class FullDecoder(Decoder):
    """Full AttnRes decoding: every output is a completed source (blocks of one sublayer)."""

    def __init__(self, stream, like: torch.Tensor, fns):
        super().__init__(stream, like, fns, ends=range(1, stream.num_sublayers + 1))


class BlockDecoder(Decoder):
    """Block AttnRes decoding (equal or uneven blocks, multi-head): the stream's blocks."""

    def __init__(self, stream, like: torch.Tensor, fns):
        super().__init__(stream, like, fns, ends=stream._ends)


class DeltaDecoder(BlockDecoder):
    """Delta AttnRes decoding: the blocks after the ``null`` source, the additive stream ``h``,
    and a read ``RMSNorm(h + a_i r_i)`` (``h + a_i r_i`` for a stream without norms)."""

    def __init__(self, stream, like: torch.Tensor, fns):
        super().__init__(stream, like, fns)
        self.gates = stream.gates.tolist()

    def _site_norms(self) -> list:
        """None at every site for a stream without norms (its caller normalizes)."""
        return super()._site_norms() if self.stream.own_norms else [None] * (self.num_sublayers + 1)

    def _first_sources(self, e: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return (self.stream.null, e)

    def init(self, e: torch.Tensor) -> DecodeState:
        return super().init(e)._replace(h=e.clone())

    def split_state(self, state: DecodeState) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Completed: ``e`` and the blocks (the null source is a parameter, not state); the rest:
        ``h``, then the partial sum when there is one (copies)."""
        return self._copies(state, 1, state.count), (state.h.clone(), *self._copies(state, state.count))

    def _read(self, state: DecodeState, site: int, trace: Trace | None) -> torch.Tensor:
        if trace is not None:
            stream = self.stream
            return stream._gated_read(site, state.h, stream._route_traced(site, self._copies(state), trace), trace)
        return self.decode_read(state.sources, state.count + state.has_partial, self.queries[site], base=state.h,
                                gate=self.gates[site], norm=self.norms[site], **self.options)

    def _advance(self, state: DecodeState, i: int, v: torch.Tensor) -> DecodeState:
        state.h.add_(v)
        return super()._advance(state, i, v)
