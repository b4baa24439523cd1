"""DenseFormer: a depth-weighted average of every earlier output (docs/METHOD.md section 9).

stores: every new output ``(e, v_0, ..., v_{i-1})``, as Full AttnRes does.
reads:  ``x_i = RMSNorm_{g_i}(sum_{j=-1}^{i-1} a_{i,j} v_j)`` with learned scalars ``a_{i,j}``,
        all initialized to 1, so that the first forward is PreNorm's (``h_i = e + v_0 + ... +
        v_{i-1}``); the output: the same over all ``M + 1`` sources with its own row, then the
        final norm.
writes: appends ``v_i``.

Granularity: one weighted sum before every sublayer (attention and MLP alike), the unit every
stream reads at; DenseFormer proper (Pagliardini et al. 2024) averages once after each
transformer block. The weights are the rows of ``source_weights`` ``[M + 1, M + 1]`` (row ``i``:
site ``i``, ``M`` for the output; column ``j``: source ``j``, ``e`` first); the entries past a
site's sources are never read.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..ops import weighted_depth_sum
from .base import KeepsEverySource, Stream, Trace


class DenseState(NamedTuple):
    """``sources``: ``(e, v_0, ..., v_{i-1})``."""

    sources: tuple[torch.Tensor, ...]


class DenseFormerStream(KeepsEverySource, Stream):
    kind = "denseformer"

    def __init__(self, dim: int, num_sublayers: int, eps: float = 1e-6):
        super().__init__(dim, num_sublayers, eps)
        self._make_norms()
        sites = num_sublayers + 1
        self.source_weights = nn.Parameter(torch.ones(sites, sites))

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.ones_(self.source_weights)

    def no_weight_decay(self) -> set[str]:
        # decay would pull the weights towards 0, away from the sum that the init is
        return super().no_weight_decay() | {"source_weights"}

    def _init(self, e: torch.Tensor) -> DenseState:
        return DenseState((e,))

    def _read(self, state: DenseState, i: int, trace: Trace | None) -> torch.Tensor:
        weights = self.source_weights[i, :i + 1]
        if trace is not None:  # the same weights for every token, one head
            tokens = state.sources[0].shape[:-1]
            trace.depth_weights[i] = weights.detach().view(i + 1, *(1,) * len(tokens), 1).expand(-1, *tokens, 1)
        return self._finish_read(i, weighted_depth_sum(weights, state.sources), trace)

    def _write(self, state: DenseState, i: int, v: torch.Tensor) -> DenseState:
        return DenseState(state.sources + (v,))

    def _output(self, state: DenseState, trace: Trace | None) -> torch.Tensor:
        return self._read(state, self.num_sublayers, trace)
