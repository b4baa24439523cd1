"""PreNorm residual, the baseline (docs/METHOD.md section 1).

stores: one running sum ``h``.  reads: ``RMSNorm_{g_i}(h)``.  writes: ``h + v``.
"""

from __future__ import annotations

import torch

from .base import Stream, Trace


class PreNormStream(Stream):
    kind = "prenorm"

    def __init__(self, dim: int, num_sublayers: int, eps: float = 1e-6):
        super().__init__(dim, num_sublayers, eps)
        self._make_norms()

    def _init(self, e: torch.Tensor) -> torch.Tensor:
        return e

    def _hidden(self, h: torch.Tensor) -> tuple[torch.Size, torch.device]:
        return h.shape, h.device

    def _read(self, h: torch.Tensor, i: int, trace: Trace | None) -> torch.Tensor:
        return self._finish_read(i, h, trace)

    def _write(self, h: torch.Tensor, i: int, v: torch.Tensor) -> torch.Tensor:
        return h + v

    def _output(self, h: torch.Tensor, trace: Trace | None) -> torch.Tensor:
        return self._finish_read(self.num_sublayers, h, trace)
