"""One writer per run folder: an advisory lock that a job holds on the folder it writes.

The lock is the file ``.lock`` in the folder, locked with ``fcntl.flock`` and holding the
owner's PID and host. The operating system releases it when the owner's process ends, however it
ends, so a killed run leaves no stale lock (the file stays, unlocked, and the next writer takes
it). A second writer is refused at once with ``FolderInUse``, naming the owner. Under torchrun
one process of the job (rank 0) holds it. Locks taken by one process nest: a comparison holds
each design's folder while ``train`` writes it.

``flock`` is advisory: it binds the processes that ask for it, and on a network filesystem it
may bind only those of one machine.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
from pathlib import Path

LOCK_FILE = ".lock"

_held: dict[Path, list] = {}  # folder -> [open file, depth] of the locks this process holds


class FolderInUse(ValueError):
    """Another process writes the folder; the message names it."""


def _owner_text(path: Path) -> str:
    try:
        text = path.read_text().strip()
    except OSError:
        text = ""
    pid, _, host = text.partition(" ")
    return f"process {pid} on {host}" if pid.isdigit() and host else "another process"


def owner(folder: Path) -> str | None:
    """Who holds ``folder``'s lock (``"process PID on HOST"``), or None when no other process
    does; reads only (the lock file is not made)."""
    folder = Path(folder).resolve()
    path = folder / LOCK_FILE
    if folder in _held or not path.is_file() or path.is_symlink():
        return None
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as err:
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return _owner_text(path)
        return None
    finally:
        os.close(fd)  # closing releases the probe's shared lock
    return None


def in_use_message(folder: Path, who: str) -> str:
    return (f"{folder} is in use by {who}: one job writes a run folder at a time; wait for it to end "
            f"or choose another folder")


def acquire(folder: Path) -> Path:
    """Lock ``folder`` (made if missing) for this process; ``FolderInUse`` naming the owner when
    another process holds it. Returns the resolved folder, the key for ``release``."""
    folder = Path(folder).resolve()
    if folder in _held:
        _held[folder][1] += 1
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    if path.is_symlink():
        raise ValueError(f"{path} is a link; a run folder's lock is a plain file: remove the link")
    f = open(path, "a+")
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as err:
        f.close()
        if err.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise FolderInUse(in_use_message(folder, _owner_text(path))) from None
        raise
    f.seek(0)
    f.truncate()
    f.write(f"{os.getpid()} {socket.gethostname()}\n")
    f.flush()
    _held[folder] = [f, 1]
    return folder


def release(folder: Path) -> None:
    """Undo one ``acquire`` of ``folder``; the lock goes with the last."""
    folder = Path(folder).resolve()
    entry = _held.get(folder)
    if entry is None:
        return
    entry[1] -= 1
    if entry[1] == 0:
        del _held[folder]
        entry[0].close()  # closing the file releases the flock


class FolderLock:
    """``with FolderLock(folder):`` holds ``folder``'s lock for the block (``enabled=False``: a
    process of the job that leaves the lock to rank 0)."""

    def __init__(self, folder: Path, enabled: bool = True):
        self.folder, self.enabled = Path(folder), enabled

    def __enter__(self):
        if self.enabled:
            self.folder = acquire(self.folder)
        return self

    def __exit__(self, *exc):
        if self.enabled:
            release(self.folder)
