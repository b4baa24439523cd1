"""Signals: SIGINT and SIGTERM stop a run's work where it can stop cleanly (after a step, with a
checkpoint), every rank at the same step, and the command then exits as a shell reports that
signal.
"""

from __future__ import annotations

import signal
import threading

import torch

from ..files import Terminated
from . import distributed as dist


def exit_status(signum: int | None) -> int:
    """A command's exit status once a signal stopped its work (after the checkpoint is safe):
    128 + the signal's number, as a shell reports a process that signal ended (130 for SIGINT,
    143 for SIGTERM); 0 when no signal came."""
    return 0 if signum is None else 128 + int(signum)


class Signals:
    """SIGINT/SIGTERM set ``received`` (the signal's number) instead of ending the process; the
    work checks it where it can stop cleanly (``run_steps`` after a step, with a checkpoint).
    Nested uses share the outermost one: a comparison holds it over all its runs, so a signal
    between two runs stops the comparison, and one during a run stops that run and then the
    comparison. Handlers are installed only on the main thread."""

    _active: "Signals | None" = None

    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def __enter__(self) -> "Signals":
        if Signals._active is not None:
            return Signals._active
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
            Signals._active = self
        return self

    def _handle(self, signum, frame):
        self.received = signum

    def __exit__(self, *exc):
        if Signals._active is self:
            for sig, handler in self._previous.items():
                signal.signal(sig, handler)
            Signals._active = None


class Raising:
    """For work with no step to stop after (a comparison's evaluation, ``hf/downstream.py``):
    while inside, SIGINT raises ``KeyboardInterrupt`` and SIGTERM ``files.Terminated`` where the
    work stands, so that it stops at once and its ``finally`` blocks run; ``received`` keeps the
    signal too, in case a library the work calls swallows the exception. The previous handlers
    come back on leaving. Handlers are installed only on the main thread."""

    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def __enter__(self) -> "Raising":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signum
        raise KeyboardInterrupt if signum == signal.SIGINT else Terminated(exit_status(signum))

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler if handler is not None else signal.SIG_DFL)


def agreed_signal(received: int | None, info: dist.DistInfo) -> int | None:
    """The signal that stops every rank: under torchrun the highest number any rank received
    (SIGTERM over SIGINT), so that all ranks stop at the same step and end alike."""
    if not info.distributed:
        return received
    t = torch.tensor([received or 0], device=info.device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item()) or None
