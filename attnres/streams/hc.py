"""Hyper-Connections, dynamic (docs/METHOD.md section 6).

stores: ``n`` streams ``H`` ``[..., n, D]``, each starting as a copy of ``e``, and the next
        site's ``Hbar [W_m | W_r | W_b]`` (``base.PreparedStreams``).
reads:  ``RMSNorm_{g_i}(sum_k A_m[k] H_k)`` with ``A_m = s_a tanh(Hbar W_m) + A_m0``.
writes: ``H'_j = B[j] v + sum_k A_r[k, j] H_k`` with ``A_r = s_a tanh(Hbar W_r) + A_r0`` and
        ``B = s_b tanh(Hbar W_b) + B0``; ``Hbar = RMSNorm(H)`` per stream (no gain).

At init (``W = 0``, ``A_m0 = onehot(i mod n)``, ``A_r0 = I``, ``B0 = 1``) every stream holds the
PreNorm sum, so the model equals PreNorm. Output: the sum of the streams, then the final norm.
"""

from __future__ import annotations

import torch
from torch import nn

from ..ops import rms_norm_project
from .base import PreparesNextSite, MultiStream, PreparedStreams, Trace


class HyperConnectionStream(PreparesNextSite, MultiStream):
    kind = "hc"

    def __init__(self, dim: int, num_sublayers: int, eps: float = 1e-6, *, streams: int = 4,
                 backend: str = "auto"):
        super().__init__(dim, num_sublayers, eps, streams, backend=backend)
        n, m = streams, num_sublayers
        self.read_proj = nn.Parameter(torch.empty(m, dim))  # W_m
        self.mix_proj = nn.Parameter(torch.empty(m, dim, n))  # W_r
        self.write_proj = nn.Parameter(torch.empty(m, dim))  # W_b
        self.read_static = nn.Parameter(torch.empty(m, n))  # A_m0
        self.mix_static = nn.Parameter(torch.empty(m, n, n))  # A_r0
        self.write_static = nn.Parameter(torch.empty(m, n))  # B0
        self.read_scale = nn.Parameter(torch.empty(m))  # s_a
        self.write_scale = nn.Parameter(torch.empty(m))  # s_b
        self._make_norms()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        n = self.streams
        with torch.no_grad():
            for p in (self.read_proj, self.mix_proj, self.write_proj):
                p.zero_()
            self.read_static.copy_(
                torch.eye(n)[torch.arange(self.num_sublayers) % n]
            )  # onehot(i mod n)
            self.mix_static.copy_(torch.eye(n).expand_as(self.mix_static))
            self.write_static.fill_(1.0)
            self.read_scale.fill_(0.01)
            self.write_scale.fill_(0.01)

    def no_weight_decay(self) -> set[str]:
        return super().no_weight_decay() | {"read_static", "mix_static", "write_static"}

    def _prepare(self, H: torch.Tensor, site: int) -> torch.Tensor:
        """``Hbar [W_m | W_r | W_b]`` ``[..., n, n + 2]`` of ``site`` (its read's column, then its
        write's), without forming ``Hbar`` (``ops.rms_norm_project``); None for the output."""
        if site == self.num_sublayers:
            return None
        W = torch.cat([self.read_proj[site].unsqueeze(-1), self.mix_proj[site], self.write_proj[site].unsqueeze(-1)],
                      dim=-1)
        return rms_norm_project(H, W, self.eps)

    def _read(self, state: PreparedStreams, i: int, trace: Trace | None) -> torch.Tensor:
        H, z = self._state(state, i)[:2]
        a_m = self.read_scale[i] * torch.tanh(z[..., 0]) + self.read_static[i]  # [..., n]
        return self._finish_read(i, self._ops(H).stream_mix(H, a_m.to(H.dtype)), trace)

    def _write(self, state: PreparedStreams, i: int, v: torch.Tensor) -> PreparedStreams:
        H, z = self._state(state, i)[:2]
        n = self.streams
        a_r = self.read_scale[i] * torch.tanh(z[..., 1:n + 1]) + self.mix_static[i]  # [..., n(k), n(j)]
        b = self.write_scale[i] * torch.tanh(z[..., n + 1]) + self.write_static[i]  # [..., n]
        # H'_j = sum_k A_r[k, j] H_k + B[j] v: A_r given as indexed [k, j]
        return self._carry(self._ops(H).stream_update(H, a_r.to(H.dtype), b.to(H.dtype), v, transposed=True), i + 1)

    def _output(self, state: PreparedStreams, trace: Trace | None) -> torch.Tensor:
        return self._finish_read(self.num_sublayers, self._state(state, self.num_sublayers).H.sum(-2), trace)

