"""Manifold-constrained Hyper-Connections, mHC (docs/METHOD.md section 7).

stores: ``n`` streams ``H`` ``[..., n, D]``, each starting as a copy of ``e``, and the next
        site's projections ``u Phi`` (``base.PreparedStreams``).
reads:  ``RMSNorm_{g_i}(sum_k Hpre[k] H_k)``, ``Hpre = sigmoid(a_pre (u Phi_pre) + b_pre)``.
writes: ``H' = Hres @ H + Hpost^T v`` with ``Hpost = 2 sigmoid(a_post (u Phi_post) + b_post)`` and
        ``Hres = Sinkhorn(exp(a_res mat(u Phi_res) + b_res))``, doubly stochastic;
        ``u = RMSNorm(vec(H))`` over all ``n * D`` values (no gain).

The three projections of one site are stored side by side in ``proj`` ``[M, n*D, 2n + n^2]``:
one product per site, formed by the write before it (``init`` for site 0) and carried in the
state with the streams (``base.PreparedStreams``). Init: ``Phi = 0``, ``a = 0.01``, biases giving ``Hpre = 1/n`` (the stream
average), ``Hpost = 1`` and ``Hres`` diagonal-dominant (diagonal logit 2). Output: the stream average, then the final norm.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..ops import rms_norm_project
from .base import PreparesNextSite, MultiStream, PreparedStreams, Trace


class ManifoldHyperConnectionStream(PreparesNextSite, MultiStream):
    kind = "mhc"

    def __init__(
        self,
        dim: int,
        num_sublayers: int,
        eps: float = 1e-6,
        *,
        streams: int = 4,
        sinkhorn_iterations: int = 20,
        backend: str = "auto",
    ):
        super().__init__(dim, num_sublayers, eps, streams, minimum=2, backend=backend)
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

    def _prepare(self, H: torch.Tensor, site: int) -> torch.Tensor:
        """``u [Phi_pre | Phi_post | Phi_res]`` ``[..., 2n + n^2]`` of ``site``, without forming
        ``u = RMSNorm(vec(H))`` (``ops.rms_norm_project``); None for the output."""
        if site == self.num_sublayers:
            return None
        return rms_norm_project(H.flatten(-2), self.proj[site], self.eps)

    def _write_logits(self, projected: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Site ``i``'s pre-activation logits of ``Hpost`` ``[..., n]`` and ``Hres`` ``[..., n, n]``
        from its projections."""
        n = self.streams
        post, res = projected[..., n:].split([n, n * n], dim=-1)
        b_post, b_res = self.bias[i, n:].split([n, n * n])
        return self.scales[i, 1] * post + b_post, (self.scales[i, 2] * res + b_res).unflatten(-1, (n, n))

    def mixing_matrix(self, H: torch.Tensor, i: int) -> torch.Tensor:
        """``Hres`` ``[..., n, n]`` of site ``i`` for the streams ``H`` ``[..., n, D]``: doubly
        stochastic."""
        return self._ops(H).sinkhorn(self._write_logits(self._prepare(H, i), i)[1], self.sinkhorn_iterations)

    def _read(self, state: PreparedStreams, i: int, trace: Trace | None) -> torch.Tensor:
        H, projected = self._state(state, i)[:2]
        n = self.streams
        h_pre = torch.sigmoid(self.scales[i, 0] * projected[..., :n] + self.bias[i, :n])  # [..., n]
        return self._finish_read(i, self._ops(H).stream_mix(H, h_pre.to(H.dtype)), trace)

    def _write(self, state: PreparedStreams, i: int, v: torch.Tensor) -> PreparedStreams:
        H, projected = self._state(state, i)[:2]
        post, res = self._write_logits(projected, i)
        h_post = 2 * torch.sigmoid(post)  # [..., n]
        ops = self._ops(H)
        h_res = ops.sinkhorn(res, self.sinkhorn_iterations)  # [..., n(j), n(k)]
        return self._carry(ops.stream_update(H, h_res.to(H.dtype), h_post.to(H.dtype), v), i + 1)

    def _output(self, state: PreparedStreams, trace: Trace | None) -> torch.Tensor:
        return self._finish_read(self.num_sublayers, self._state(state, self.num_sublayers).H.mean(-2), trace)

