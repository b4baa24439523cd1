"""Delta AttnRes: identity-preserving routing for converting a pretrained model (SPEC section 5).

stores: the model's additive stream ``h``, plus ``e`` and the block sums of sublayer outputs.
reads:  ``RMSNorm_{g_i}(h_i + a_i * r_i)`` where ``r_i`` routes (multi-head) over
        ``[null, e, B_0, ..., B_{n-1}] (+ [P_i] when p > 0)``.
writes: ``h + v`` and the block bookkeeping of Block AttnRes.

``null`` (a learned source), the pseudo-queries and the scalar gates ``a_i`` start at zero, so at
step 0 the stream computes exactly what PreNorm computes. The output keeps the final norm with a
gated routed term of its own (gate ``a_M``, also zero-initialized).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .attnres import BlockState, DepthRoutingStream, advance_blocks, block_sources
from .base import resolve_block_size


class DeltaState(NamedTuple):
    h: torch.Tensor
    routed: BlockState


class DeltaAttnResStream(DepthRoutingStream):
    kind = "delta"
    options = DepthRoutingStream.options + ("block_size", "num_blocks")

    def __init__(
        self,
        dim: int,
        num_sublayers: int,
        eps: float = 1e-6,
        *,
        block_size: int | None = None,
        num_blocks: int | None = None,
        **options,
    ):
        super().__init__(dim, num_sublayers, eps, **options)
        self.block_size = resolve_block_size(num_sublayers, block_size, num_blocks)
        self.null = nn.Parameter(torch.zeros(dim))
        self.gates = nn.Parameter(torch.zeros(num_sublayers + 1))
        self._make_norms()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.zeros_(self.null)
        nn.init.zeros_(self.gates)

    def init(self, e: torch.Tensor) -> DeltaState:
        return DeltaState(e, BlockState((e,), None))

    def _read_delta(self, site: int, state: DeltaState) -> torch.Tensor:
        null = self.null.to(state.h.dtype).expand_as(state.h)
        routed = self.route(site, [null] + block_sources(state.routed))
        u = state.h + self.gates[site].to(state.h.dtype) * routed
        self._record_rms(site, u)
        norm = self.final_norm if site == self.num_sublayers else self.norms[site]
        return norm(u)

    def read(self, state: DeltaState, i: int) -> torch.Tensor:
        return self._read_delta(i, state)

    def write(self, state: DeltaState, i: int, v: torch.Tensor) -> DeltaState:
        return DeltaState(state.h + v, advance_blocks(state.routed, i, v, self.block_size))

    def output(self, state: DeltaState) -> torch.Tensor:
        return self._read_delta(self.num_sublayers, state)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, block_size={self.block_size}"
