"""The signal that stops every rank of a run alike (``agreed_signal``)."""

# Every other part of signal handling is attnres/signals.py, in the lowest layer, which imports
# neither PyTorch nor train/ (the command line reads it before PyTorch loads); this one reduces
# over the job's process group (torch.distributed, train/distributed.py's DistInfo), so it stays here.

from __future__ import annotations

import torch

from . import distributed as dist


def agreed_signal(received: int | None, info: dist.DistInfo) -> int | None:
    """The signal that stops every rank: under torchrun the highest number any rank received
    (SIGTERM over SIGINT), so that all ranks stop at the same step and end alike."""
    if not info.distributed:
        return received
    t = torch.tensor([received or 0], device=info.device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item()) or None
