"""Delta AttnRes: identity-preserving routing for converting a pretrained model (docs/METHOD.md
section 5).

stores: the model's additive stream ``h``, plus ``e`` and the block sums of sublayer outputs.
reads:  ``RMSNorm_{g_i}(h_i + a_i * r_i)`` where ``r_i`` routes (multi-head) over
        ``[null, e, B_0, ..., B_{n-1}] (+ [P_i] when p > 0)``.
writes: ``h + v`` and the block bookkeeping of Block AttnRes (two-phase included).

``null`` (a learned source), the pseudo-queries and the scalar gates ``a_i`` start at zero, so at
step 0 the stream computes exactly what PreNorm computes. The output keeps the final norm with a
gated routed term of its own (gate ``a_M``, also zero-initialized).

``own_norms=False`` is for wrapping a model that keeps its own norm modules (a converted Hugging
Face model): the stream then has no norm parameters, and ``read``/``output`` return the value
*before* the norm (``h_i + a_i r_i``), which the caller normalizes with the model's own module.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from .block import BlockRoutingStream, BlockState
from .base import Trace, record_rms
from .decode import DeltaDecoder


class DeltaState(NamedTuple):
    h: torch.Tensor
    routed: BlockState


class DeltaAttnResStream(BlockRoutingStream):
    kind = "delta"
    decoder_class = DeltaDecoder

    wrapper_options = ("own_norms",)

    def __init__(self, dim: int, num_sublayers: int, eps: float = 1e-6, *, own_norms: bool = True, **options):
        super().__init__(dim, num_sublayers, eps, **options)
        self.null = nn.Parameter(torch.zeros(dim))
        self.gates = nn.Parameter(torch.zeros(num_sublayers + 1))
        self.own_norms = bool(own_norms)
        if self.own_norms:
            self._make_norms()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.zeros_(self.null)
        nn.init.zeros_(self.gates)

    def _init(self, e: torch.Tensor) -> DeltaState:
        # the null source comes first: one vector for every token, prepared and scored once
        routed = self._complete(self._begin(e), self.null.to(e.dtype), 0, tokens=e.shape[:-1])
        return DeltaState(e, self._open_block(self._complete(routed, e, 0), 0))

    def _gated_read(self, site: int, h: torch.Tensor, routed: torch.Tensor, trace: Trace | None) -> torch.Tensor:
        """The read of ``site`` from the additive stream ``h`` and the site's routed mix:
        ``RMSNorm_{g_site}(h + a_site * routed)``, or ``h + a_site * routed`` without own norms
        (its RMS recorded when traced)."""
        u = h + self.gates[site].to(h.dtype) * routed
        if not self.own_norms:
            record_rms(site, u, trace)
            return u
        return self._finish_read(site, u, trace)

    def _read(self, state: DeltaState, i: int, trace: Trace | None) -> torch.Tensor:
        if trace is not None:
            return self._gated_read(i, state.h, self._route_traced(i, self.sources(state.routed), trace), trace)
        return self._gated_read(i, state.h, self._block_mix(i, state.routed), None)

    def _write(self, state: DeltaState, i: int, v: torch.Tensor) -> DeltaState:
        return DeltaState(state.h + v, self._advance(state.routed, i, v))

    def _output(self, state: DeltaState, trace: Trace | None) -> torch.Tensor:
        return self._read(state, self.num_sublayers, trace)

    def _hidden(self, state: DeltaState) -> tuple[torch.Size, torch.device]:
        return state.h.shape, state.h.device

    def _written(self, state: DeltaState) -> int:
        return state.routed.written

    def split_state(self, state: DeltaState) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """Completed: e and the blocks (the null source is a parameter, not state); the rest:
        the additive stream ``h``, then the partial sum when there is one."""
        routed = state.routed
        return routed.blocks[1:], (state.h,) + (() if routed.partial is None else (routed.partial,))

    def _join_state(self, completed, rest, i: int) -> DeltaState:
        if not completed or not 1 <= len(rest) <= 2:
            raise ValueError(f"delta stream: the state is e and the completed blocks, then h and at most one partial "
                             f"sum, given {len(completed)} completed sources and {len(rest)} other tensors")
        e = completed[0]
        with_null = self._complete(self._begin(e), self.null.to(e.dtype), 0, tokens=e.shape[:-1])
        routed = self._join_blocks(e, completed[1:], rest[1] if len(rest) > 1 else None, i, first=with_null)
        return DeltaState(rest[0], routed)


def check_routing_options(config, heads, block_layers, defaulted=()) -> None:
    """Raise ``ValueError`` unless ``heads`` divides the model's width and ``block_layers`` is a
    number of its layers (equal blocks) or a list of positive layer counts summing to them.
    ``defaulted``: the options (``"heads"``, ``"block_layers"``) the user left at their defaults;
    a refusal of one says it is the default and which values fit this model."""
    width, layers = config.hidden_size, config.num_hidden_layers
    if type(heads) is not int or heads < 1 or width % heads:
        fits = [h for h in range(1, width + 1) if width % h == 0]
        default = (f" (heads={heads} is the default; this model takes {', '.join(map(str, fits[:12]))}"
                   f"{', ...' if len(fits) > 12 else ''})" if "heads" in defaulted else "")
        raise ValueError(f"heads={heads!r} must be a positive integer dividing hidden_size={width}{default}")
    if isinstance(block_layers, (list, tuple)):
        if not block_layers or any(type(n) is not int or n < 1 for n in block_layers) or sum(block_layers) != layers:
            raise ValueError(f"block_layers={list(block_layers)} must be positive layer counts summing to "
                             f"{layers} (the number of layers)")
    elif type(block_layers) is not int or not 1 <= block_layers <= layers:
        default = (f" (block_layers={block_layers} is the default, and this model has {layers} layers: give a "
                   f"number of layers per block in [1, {layers}], or a list of each block's layers summing to {layers})"
                   if "block_layers" in defaulted else "")
        raise ValueError(f"block_layers={block_layers!r} must be an integer in [1, {layers}] (the number of layers) "
                         f"or a list of layers per block{default}")


def routing_blocks(block_layers) -> dict:
    """The stream's block option for ``block_layers`` transformer layers per block (an integer,
    equal blocks) or a list of them (uneven blocks): two sublayers per layer."""
    if isinstance(block_layers, (list, tuple)):
        return {"block_sizes": tuple(2 * n for n in block_layers)}
    return {"block_size": 2 * block_layers}


def converted_routing(config) -> DeltaAttnResStream:
    """The routing of a converted model (``attnres convert``) whose Hugging Face ``config`` gives
    ``hidden_size``, ``num_hidden_layers``, ``rms_norm_eps``, ``delta_heads`` and
    ``delta_block_layers``: a Delta stream over its ``2 * num_hidden_layers`` sublayers that
    leaves the norms to the model's own modules. Built alike by the ``transformers`` model
    (``attnres.hf.convert``) and the vLLM one (``attnres.serving.converted``)."""
    heads, block_layers = config.delta_heads, config.delta_block_layers
    check_routing_options(config, heads, block_layers)
    return DeltaAttnResStream(config.hidden_size, 2 * config.num_hidden_layers, config.rms_norm_eps, heads=heads,
                              **routing_blocks(block_layers), own_norms=False)
