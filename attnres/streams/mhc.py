"""Manifold-constrained Hyper-Connections, mHC (docs/METHOD.md section 7).

stores: ``n`` streams ``H`` ``[..., n, D]``, each starting as a copy of ``e``.
reads:  ``RMSNorm_{g_i}(sum_k Hpre[k] H_k)``, ``Hpre = sigmoid(a_pre (u Phi_pre) + b_pre)``.
writes: ``H' = Hres @ H + Hpost^T v`` with ``Hpost = 2 sigmoid(a_post (u Phi_post) + b_post)`` and
        ``Hres = Sinkhorn(exp(a_res mat(u Phi_res) + b_res))``, doubly stochastic;
        ``u = RMSNorm(vec(H))`` over all ``n * D`` values (no gain).

The three projections of one site are stored side by side in ``proj`` ``[M, n*D, 2n + n^2]``
(one matmul per site). Init: ``Phi = 0``, ``a = 0.01``, biases giving ``Hpre = 1/n`` (the stream
average), ``Hpost = 1`` and ``Hres`` diagonal-dominant (diagonal logit 2). Output: the stream average, then the final norm.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops import rms_norm, sinkhorn
from .base import MultiStream, Trace


class ManifoldHyperConnectionStream(MultiStream):
    kind = "mhc"

    def __init__(
        self,
        dim: int,
        num_sublayers: int,
        eps: float = 1e-6,
        *,
        streams: int = 4,
        sinkhorn_iterations: int = 20,
    ):
        super().__init__(dim, num_sublayers, eps, streams, minimum=2)
        if not isinstance(sinkhorn_iterations, int) or sinkhorn_iterations < 1:
            raise ValueError(f"sinkhorn_iterations={sinkhorn_iterations!r} must be >= 1")
        n, m = streams, num_sublayers
        self.sinkhorn_iterations = sinkhorn_iterations
        self.proj = nn.Parameter(torch.empty(m, n * dim, 2 * n + n * n))  # [Phi_pre|Phi_post|Phi_res]
        self.scales = nn.Parameter(torch.empty(m, 3))  # a_pre, a_post, a_res
        self.bias = nn.Parameter(torch.empty(m, 2 * n + n * n))  # b_pre | b_post | b_res
        self._make_norms()
        self.reset_parameters()

    def reset_parameters(self) -> None:
        super().reset_parameters()
        n = self.streams
        with torch.no_grad():
            self.proj.zero_()
            self.scales.fill_(0.01)
            b_pre = torch.full((n,), -math.log(n - 1))  # sigmoid(b_pre) = 1/n
            b_post = torch.zeros(n)  # 2 sigmoid(0) = 1
            # Diagonal logit 2: Hres starts diagonal-dominant (0.71 on the diagonal for n=4).
            # A sharper start (0.99) leaves 20 Sinkhorn iterations far from doubly stochastic
            # (row sums off by 1e-3) as soon as the projections move.
            b_res = torch.eye(n) * 2.0
            self.bias.copy_(torch.cat([b_pre, b_post, b_res.flatten()]).expand_as(self.bias))

    def no_weight_decay(self) -> set[str]:
        return super().no_weight_decay() | {"bias", "scales"}

    def _logits(self, H: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Pre-activation logits ``[..., n]``, ``[..., n]``, ``[..., n, n]`` of site ``i``."""
        n = self.streams
        u = rms_norm(H.flatten(-2), eps=self.eps)  # [..., n*D]
        z = u.to(self.proj.dtype) @ self.proj[i]  # [..., 2n + n^2]
        pre, post, res = z.split([n, n, n * n], dim=-1)
        b_pre, b_post, b_res = self.bias[i].split([n, n, n * n])
        a = self.scales[i]
        return a[0] * pre + b_pre, a[1] * post + b_post, (a[2] * res + b_res).unflatten(-1, (n, n))

    def mixing_matrix(self, H: torch.Tensor, i: int) -> torch.Tensor:
        """``Hres`` ``[..., n, n]`` of site ``i``: doubly stochastic."""
        return sinkhorn(self._logits(H, i)[2], self.sinkhorn_iterations)

    def _read(self, H: torch.Tensor, i: int, trace: Trace | None) -> torch.Tensor:
        h_pre = torch.sigmoid(self._logits(H, i)[0])  # [..., n]
        return self._finish_read(i, (h_pre.unsqueeze(-1).to(H.dtype) * H).sum(-2), trace)

    def _write(self, H: torch.Tensor, i: int, v: torch.Tensor) -> torch.Tensor:
        # The logits are recomputed rather than carried from read (one small matmul per token)
        # so that the state stays a plain tensor.
        _, post, res = self._logits(H, i)
        h_post = 2 * torch.sigmoid(post)  # [..., n]
        h_res = sinkhorn(res, self.sinkhorn_iterations)  # [..., n(j), n(k)]
        return h_res.to(H.dtype) @ H + h_post.unsqueeze(-1).to(H.dtype) * v.unsqueeze(-2)

    def _output(self, H: torch.Tensor, trace: Trace | None) -> torch.Tensor:
        return self._finish_read(self.num_sublayers, H.mean(-2), trace)

