"""PreNorm residual, the baseline (SPEC section 1).

stores: one running sum ``h``.  reads: ``RMSNorm_{g_i}(h)``.  writes: ``h + v``.
"""

from __future__ import annotations

import torch

from .base import Stream


class PreNormStream(Stream):
    kind = "prenorm"

    def __init__(self, dim: int, num_sublayers: int, eps: float = 1e-6):
        super().__init__(dim, num_sublayers, eps)
        self._make_norms()

    def init(self, e: torch.Tensor) -> torch.Tensor:
        return e

    def read(self, h: torch.Tensor, i: int) -> torch.Tensor:
        self._record_rms(i, h)
        return self.norms[i](h)

    def write(self, h: torch.Tensor, i: int, v: torch.Tensor) -> torch.Tensor:
        return h + v

    def output(self, h: torch.Tensor) -> torch.Tensor:
        self._record_rms(self.num_sublayers, h)
        return self.final_norm(h)
