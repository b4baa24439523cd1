"""SIGINT and SIGTERM: how each kind of work stops on them. A run's steps stop after a step, with
a checkpoint (``Signals``: the signal kept for the work to read); work with no step to stop after
stops where it stands (``Raising``), a folder being written is removed first
(``cleaned_up_on_signals``) and the swap that publishes it runs whole (``signals_held``); the
command then exits as a shell reports that signal (``exit_status``, ``Terminated``).
``pause_at`` stops a command at a known point for a test's signal.
"""

# Imports nothing of the package, nor PyTorch: the command line's start-up reads it (pause_at) and
# a folder's writer (files.py) sits beside it in the lowest layer. The signal every rank of a
# distributed run stops on reduces over the job's process group, so it lives in train/
# (train/agreed_signal.py).

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from contextlib import contextmanager


def exit_status(signum: int | None) -> int:
    """A command's exit status once a signal stopped its work (after the checkpoint is safe):
    128 + the signal's number, as a shell reports a process that signal ended (130 for SIGINT,
    143 for SIGTERM); 0 when no signal came."""
    return 0 if signum is None else 128 + int(signum)


class Terminated(SystemExit):
    """SIGTERM while work that stops where it stands runs (``Raising``, a folder being written):
    the command ends with status 143 once its ``finally`` blocks have run."""


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
    """For work with no step to stop after (a comparison's evaluation, ``experiments/downstream.py``, a
    folder being written): while inside, SIGINT raises ``KeyboardInterrupt`` and SIGTERM
    ``Terminated`` where the work stands, so that it stops at once and its ``finally`` blocks run;
    ``received`` keeps the signal too, in case a library the work calls swallows the exception.
    The previous handlers come back on leaving. Handlers are installed only on the main thread."""

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


@contextmanager
def cleaned_up_on_signals():
    """While inside, SIGINT raises ``KeyboardInterrupt`` and SIGTERM ``Terminated`` (exit 143),
    so that ``finally`` blocks run (a temporary folder removed) before the command exits: by
    default SIGTERM ends the process where it stands. Only the main thread can handle signals;
    elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():  # no handler of ours: no message either
        yield
        return
    with Raising():
        try:
            yield
        except Terminated:
            print("attnres: terminated (SIGTERM); the folder being written was removed", file=sys.stderr)
            raise


@contextmanager
def signals_held():
    """While inside, SIGINT and SIGTERM wait, blocked, and arrive on leaving: the work inside runs
    whole. Only the main thread blocks them; elsewhere nothing changes."""
    held = {signal.SIGINT, signal.SIGTERM}
    blocked = threading.current_thread() is threading.main_thread()
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, held)
    try:
        yield
    finally:
        if blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, held)


def pause_at(point: str) -> None:
    """With ``ATTNRES_PAUSE_AT=POINT``, stop there: ``attnres: paused at POINT`` on stderr, then
    wait for a signal. A test sends its signal at a known point this way (of the command line's
    start-up, ``cli.PAUSE_POINTS``; while a folder is half written, ``written``), not after a
    guessed delay."""
    if os.environ.get("ATTNRES_PAUSE_AT") == point:
        print(f"attnres: paused at {point}", file=sys.stderr, flush=True)
        # Short sleeps, not signal.pause(): a signal that lands between the print and the pause
        # would leave pause() waiting for another; a sleep ends and its handler runs at once.
        while True:
            time.sleep(0.05)
