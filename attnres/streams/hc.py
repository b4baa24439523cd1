"""Hyper-Connections, dynamic (docs/METHOD.md section 6).

stores: ``n`` streams ``H`` ``[..., n, D]``, each starting as a copy of ``e``.
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
from .base import MultiStream, Trace


class HyperConnectionStream(MultiStream):
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

    def _projected(self, H: torch.Tensor, W: torch.Tensor) -> torch.Tensor:
        """``Hbar W`` ``[..., n, C]`` for ``W`` ``[D, C]``, without forming ``Hbar``
        (``ops.rms_norm_project``)."""
        return rms_norm_project(H, W, self.eps)

    def _mix_read(self, H: torch.Tensor, i: int) -> torch.Tensor:
        z = self._projected(H, self.read_proj[i].unsqueeze(-1)).squeeze(-1)  # Hbar W_m, [..., n]
        a_m = self.read_scale[i] * torch.tanh(z) + self.read_static[i]
        return self._ops(H).stream_mix(H, a_m.to(H.dtype))  # [..., D]

    def _read(self, H: torch.Tensor, i: int, trace: Trace | None) -> torch.Tensor:
        return self._finish_read(i, self._mix_read(H, i), trace)

    def _write(self, H: torch.Tensor, i: int, v: torch.Tensor) -> torch.Tensor:
        # Hbar's projections are recomputed rather than carried from read: they cost O(n D) per
        # token and keep the state a plain tensor. W_r and W_b in one product: [D, n + 1].
        n = self.streams
        z = self._projected(H, torch.cat([self.mix_proj[i], self.write_proj[i].unsqueeze(-1)], dim=-1))
        a_r = self.read_scale[i] * torch.tanh(z[..., :n]) + self.mix_static[i]  # [..., n(k), n(j)]
        b = self.write_scale[i] * torch.tanh(z[..., n]) + self.write_static[i]  # [..., n]
        # H'_j = sum_k A_r[k, j] H_k + B[j] v: A_r given as indexed [k, j]
        return self._ops(H).stream_update(H, a_r.to(H.dtype), b.to(H.dtype), v, transposed=True)

    def _output(self, H: torch.Tensor, trace: Trace | None) -> torch.Tensor:
        return self._finish_read(self.num_sublayers, H.sum(-2), trace)

