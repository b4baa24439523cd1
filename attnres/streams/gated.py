"""Gated Residual, GR (docs/METHOD.md section 8).

stores: ``n_r`` branches ``R`` ``[..., n_r, D]``, each starting as a copy of ``e``, and the next
        site's ``Rhat`` with its products through ``W_down`` and ``W_inject`` (``base.PreparedStreams``).
reads:  ``mean_k(G_k * Rhat_k)`` where ``Rhat`` is a per-branch RMSNorm with zero-centred gain
        (``x * (1 + w)``) and ``G = sigmoid(W_up SiLU(W_down vec(Rhat) / n_r))`` are elementwise
        gates. GR replaces the pre-norm: the read is not normalized again.
writes: ``R_k += s_k v`` with ``s = 2 sigmoid(W_inject vec(Rhat) / n_r)``.
Output: a final GR read (site ``M``) without the write; it replaces the final norm.

Init: ``W_up = W_inject = 0`` (gates 1/2, write scalars 1), ``W_down ~ N(0, 0.02)``, gains 0.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .base import MultiStream, PreparedStreams, PreparesNextSite, Trace, record_rms


def gated_branch_mix(rhat: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
    """``mean_k(G_k * Rhat_k)``: ``[..., n_r, D] x [..., n_r, D] -> [..., D]``."""
    return (gates * rhat).mean(-2)


class GatedResidualStream(PreparesNextSite, MultiStream):
    kind = "gr"
    config_names = {"rank": "gr_rank"}

    def __init__(
        self,
        dim: int,
        num_sublayers: int,
        eps: float = 1e-6,
        *,
        streams: int = 4,
        rank: int | None = None,
        backend: str = "auto",
    ):
        super().__init__(dim, num_sublayers, eps, streams, backend=backend)
        rank = max(1, dim // 8) if rank is None else rank
        if not isinstance(rank, int) or rank < 1:
            raise ValueError(f"rank={rank!r} must be a positive integer (default dim // 8)")
        n, sites = streams, num_sublayers + 1
        self.rank = rank
        self.branch_gains = nn.Parameter(torch.empty(sites, dim))  # zero-centred: x * (1 + w)
        self.gate_down = nn.Parameter(torch.empty(sites, rank, n * dim))
        self.gate_up = nn.Parameter(torch.empty(sites, n * dim, rank))
        self.inject = nn.Parameter(torch.empty(num_sublayers, n, n * dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        nn.init.zeros_(self.branch_gains)
        nn.init.normal_(self.gate_down, std=0.02)
        nn.init.zeros_(self.gate_up)
        nn.init.zeros_(self.inject)

    def no_weight_decay(self) -> set[str]:
        return super().no_weight_decay() | {"branch_gains"}

    def _prepare(self, R: torch.Tensor, site: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Rhat, z)`` of ``site`` (``M``: the output). ``Rhat`` ``[..., n_r, D]``: each branch
        through RMSNorm with the gain ``1 + w``, on the backend's ``rms_norm`` (one op that keeps
        only ``R`` and the inverse RMS). ``z`` ``[..., r (+ n_r)]``: ``vec(Rhat) / n_r`` through
        the read's ``W_down`` and, but at the output, the write's ``W_inject``, in one product (in
        fp32 at least, outside autocast). The read and the write of the site both take them."""
        rhat = self._ops(R).rms_norm(R, (1 + self.branch_gains[site]).to(R.dtype), self.eps)
        W = self.gate_down[site]  # [r, n_r D], then [n_r, n_r D] of the write
        if site < self.num_sublayers:
            W = torch.cat((W, self.inject[site]))
        return rhat, self._project(rhat, W)

    def _project(self, rhat: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """``(vec(Rhat) W^T) / n_r`` ``[..., rows of W]``, in fp32 at least: the division on the
        few numbers of the product rather than on ``vec(Rhat)``."""
        dt = torch.promote_types(rhat.dtype, torch.float32)
        return (rhat.flatten(-2).to(dt) @ W.T.to(dt)) / self.streams

    def gate_logits(self, rhat: torch.Tensor, site: int) -> torch.Tensor:
        """The gates' logits ``W_up SiLU(W_down vec(Rhat) / n_r)`` ``[..., n_r, D]`` of ``site``,
        the down-projection in fp32 at least as ``_prepare`` forms it (for analysis: a pass
        takes them from the prepared state)."""
        hidden = F.silu(self._project(rhat, self.gate_down[site])).to(rhat.dtype)  # [..., r]
        return (hidden @ self.gate_up[site].T).unflatten(-1, (self.streams, self.dim))

    def gates(self, rhat: torch.Tensor, site: int) -> torch.Tensor:
        """Elementwise gates ``G`` ``[..., n_r, D]`` of ``site`` from ``Rhat`` ``[..., n_r, D]``."""
        return torch.sigmoid(self.gate_logits(rhat, site))

    def _gated_read(self, state: PreparedStreams, site: int, trace: Trace | None) -> torch.Tensor:
        R, (rhat, z) = self._state(state, site)[:2]
        if trace is not None:  # the branch mean only where it is recorded
            record_rms(site, R.mean(-2), trace)
        hidden = F.silu(z[..., :self.rank]).to(rhat.dtype)  # [..., r]
        # mean_k(G_k * Rhat_k), G = sigmoid(W_up hidden): the backend's op forms W_up hidden itself
        return self._ops(R).gated_mix_lowrank(rhat, hidden, self.gate_up[site].to(rhat.dtype))

    def _read(self, state: PreparedStreams, i: int, trace: Trace | None) -> torch.Tensor:
        return self._gated_read(state, i, trace)

    def _write(self, state: PreparedStreams, i: int, v: torch.Tensor) -> PreparedStreams:
        R, (_, z) = self._state(state, i)[:2]
        s = 2 * torch.sigmoid(z[..., self.rank:])  # [..., n_r]: 2 sigmoid(W_inject vec(Rhat) / n_r)
        return self._carry(self._ops(R).stream_update(R, None, s.to(R.dtype), v), i + 1)  # R + s v

    def _output(self, state: PreparedStreams, trace: Trace | None) -> torch.Tensor:
        return self._gated_read(state, self.num_sublayers, trace)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, rank={self.rank}"
