"""A checkpoint folder on disk, in either format (one process's, ``train/checkpoint.py``, or
several processes' shards, ``train/sharded.py``): each checkpoint ``step-NNNNNNN/`` is written
under a temporary name, every file fsynced, then renamed into place (``publish``); the file
``latest`` (itself replaced atomically) names the newest complete checkpoint, and only the newest
``KEEP`` are kept (``prune``). A crash or a full disk mid-write leaves the previous checkpoint
untouched and ``latest`` pointing at it.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

KEEP = 2  # complete checkpoints kept on disk


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message says which and why."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_synced(path: Path, write) -> None:
    """``write(path)``, then the file's data synced to the disk."""
    write(path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def publish(tmp: Path, final: Path) -> None:
    """Make the complete checkpoint written in folder ``tmp`` the checkpoint ``final`` (same
    parent): its files synced, renamed into place, then ``latest`` replaced to name it."""
    ckpt_root = final.parent
    _fsync_dir(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    latest_tmp = ckpt_root / ".latest.tmp"
    write_synced(latest_tmp, lambda p: p.write_text(final.name))
    os.replace(latest_tmp, ckpt_root / "latest")
    _fsync_dir(ckpt_root)


def prune(ckpt_root: Path, keep: Path) -> None:
    """Remove all but the newest ``KEEP`` complete checkpoints of ``ckpt_root``, never ``keep``."""
    done = sorted(p for p in ckpt_root.glob("step-*") if p.is_dir())
    for old in done[:-KEEP]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


#: a complete checkpoint's folder name: a checkpoint is written under another name and renamed
#: to this one only once all its files are synced (``publish``)
STEP_NAME = r"step-[0-9]{7}"


def newest_complete(ckpt_root: Path) -> Path | None:
    """The complete checkpoint of ``ckpt_root`` with the highest step (a folder named
    ``step-NNNNNNN``, not a link), or None."""
    if not ckpt_root.is_dir():
        return None
    done = [p for p in ckpt_root.iterdir()
            if re.fullmatch(STEP_NAME, p.name) and p.is_dir() and not p.is_symlink()]
    return max(done, key=lambda p: p.name, default=None)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    """The checkpoint that ``latest`` names; without a ``latest`` (deleted by hand, or lost with
    a copy of the folder) the newest complete checkpoint, since every ``step-NNNNNNN`` folder is
    complete; None when there is none. ``CheckpointError`` when ``latest`` names no complete
    checkpoint of this folder (a pointer that is garbage, leads elsewhere or names a missing
    folder): what it meant is unknown, so no other checkpoint is taken in its place."""
    ckpt_root = Path(ckpt_root)
    pointer = ckpt_root / "latest"
    if not pointer.exists() and not pointer.is_symlink():
        return newest_complete(ckpt_root)
    if pointer.is_symlink() or not pointer.is_file():
        raise CheckpointError(f"{pointer} is not a plain file naming a checkpoint; remove it or write the name "
                              f"of a step-NNNNNNN folder into it")
    try:
        name = pointer.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{pointer} cannot be read ({exc})") from None
    if not re.fullmatch(STEP_NAME, name):
        raise CheckpointError(f"{pointer} names {name[:80]!r}, not a checkpoint folder step-NNNNNNN of {ckpt_root}")
    path = ckpt_root / name
    if path.is_symlink() or not path.is_dir():
        raise CheckpointError(f"{pointer} names {name}, which is not a checkpoint folder in {ckpt_root}")
    return path


def is_sharded(path: Path) -> bool:
    """Whether checkpoint folder ``path`` was written by several processes (DCP's metadata)."""
    return (Path(path) / ".metadata").is_file()
