"""The sublayer loop that every host model shares: each sublayer reads the stream, runs, and
writes its output back, in depth order.

    for i in first .. last - 1:                 # attention at even i, the MLP at odd i
        h_i = stream.read(state, i)             # what sublayer i sees
        state = stream.write(state, i, f_i(h_i))

The hosts are attnres's own ``Transformer`` (``model.py``, a whole pass or one pipeline stage's
part), a converted Hugging Face model (``hf/convert.py``) and the two vLLM models
(``serving/exported.py``, ``serving/converted.py``); each supplies ``f_i`` for its own layers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .base import Trace

#: sublayer ``i``'s function: ``(i, h_i [B, T, D]) -> v_i [B, T, D]``
Sublayer = Callable[[int, torch.Tensor], torch.Tensor]


def run_sublayers(stream: Any, state: Any, sublayer: Sublayer, first: int, last: int,
                  trace: Trace | None = None) -> Any:
    """The stream ``state`` after sublayers ``first .. last - 1``, each read, run by
    ``sublayer(i, h_i)`` and written in turn. ``stream``: a ``Stream`` or what its ``decoder``
    gave; ``trace``: what analysis records of each read (``Trace``), or None."""
    for i in range(first, last):
        state = stream.write(state, i, sublayer(i, stream.read(state, i, trace)))
    return state
