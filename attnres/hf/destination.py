"""Where ``attnres export`` and ``attnres convert`` write: a model folder of their own, checked
before any work and held with a run folder's lock while it is written.

What they write is a model folder: ``config.json`` (a model's, naming its ``model_type``), the
weights (``model.safetensors``, or its shards and their index), the generation config and the
tokenizer's files (``MODEL_FILES``). ``--overwrite`` replaces such a folder and nothing else:
one that holds a training run (live or finished: a run's ``config.json``, its log, checkpoints or
summary) or any other file is refused with or without it, naming what it holds, and one that
another job writes (its ``.lock``, ``train/lock.py``) is refused naming that job. While the model
is written the command holds the destination's lock as ``train`` holds its run folder's, so a
run started there meanwhile is refused, and so is a second export or conversion.
"""

from __future__ import annotations

import contextlib
import re
from pathlib import Path

from ..files import read_json
from ..train import lock
from ..train.run_files import RUN_FILES, not_a_run

#: the tokenizer's files a model folder holds (``convert`` copies those of its source)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "generation_config.json", "chat_template.jinja")
#: what ``save_pretrained`` and the tokenizer write into a model folder
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", *TOKENIZER_FILES)
#: the weights of a model saved in shards
SHARD = re.compile(r"model-[0-9]{5}-of-[0-9]{5}\.safetensors")


def _written_here(entry: Path) -> bool:
    """Whether ``entry`` is a file export and convert write (``MODEL_FILES``, a weight shard)."""
    return entry.is_file() and not entry.is_symlink() and (entry.name in MODEL_FILES or bool(SHARD.fullmatch(entry.name)))


def model_folder_problem(folder: Path) -> str | None:
    """What in ``folder`` is not a model folder's, or None when it is one (or holds nothing but
    its lock file): a training run (the run's files named), files export and convert never
    write (named), or a ``config.json`` that is not a model's."""
    entries = sorted(e for e in folder.iterdir() if e.name != lock.LOCK_FILE)
    run_files = [name for name in RUN_FILES if (folder / name).exists() or (folder / name).is_symlink()]
    if run_files and not_a_run(folder, run_files) is None:
        return (f"holds a training run ({', '.join(run_files)}): a run is continued with `attnres train --resume "
                f"--run-dir {folder}` and exported to a folder of its own")
    foreign = [e.name + ("/" if e.is_dir() else "") for e in entries if not _written_here(e)]
    if foreign:
        shown = ", ".join(foreign[:5]) + (f" and {len(foreign) - 5} more" if len(foreign) > 5 else "")
        return f"holds files export and convert do not write ({shown})"
    if (folder / "config.json").is_file():
        config = read_json(folder / "config.json")
        if not isinstance(config, dict) or not isinstance(config.get("model_type"), str):
            return "holds a config.json that is not a model's (it names no model_type)"
    return None


def check_destination(src: Path, dst: Path, overwrite: bool) -> None:
    """Raise ``ValueError`` for a destination that would harm the source or another folder's
    files: the source itself, a folder inside it or around it, a file, a folder another job
    writes (``lock.FolderInUse``, naming it), one that holds a training run or files export and
    convert do not write (``model_folder_problem``; even with ``overwrite``), or (without
    ``overwrite``) a model folder; a destination under a file (it could never be made: refused
    here, not after the weights load). Reads only."""
    for folder in dst.absolute().parents:
        if folder.exists():
            if not folder.is_dir():
                raise ValueError(f"destination {dst} lies under {folder}, which is a file, not a folder; choose "
                                 f"another path")
            break
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents:
        raise ValueError(f"destination {dst} is the source model's folder or inside it; choose another folder")
    if d in s.parents:
        raise ValueError(f"destination {dst} holds the source model {src}; choose another folder")
    if d.exists() and not d.is_dir():
        raise ValueError(f"destination {dst} is a file, not a folder; choose another path")
    if not d.is_dir():
        return
    who = lock.owner(d)
    if who:
        raise lock.FolderInUse(f"destination {dst} is in use by {who}: a job writes that folder; wait for it to "
                               f"end or choose another folder")
    problem = model_folder_problem(d)
    if problem:
        raise ValueError(f"destination {dst} {problem}; export and convert replace only a model folder they "
                         f"wrote, with or without --overwrite: choose another folder")
    if not overwrite and any(e.name != lock.LOCK_FILE for e in d.iterdir()):
        raise ValueError(f"destination {dst} exists and is not empty (a model folder); pass --overwrite to "
                         f"replace it")


@contextlib.contextmanager
def held(src: Path, dst: Path, overwrite: bool):
    """Hold ``dst``'s lock (``train/lock.py``; the folder made for it if missing) while a model
    is written there, and check the destination again under it (``check_destination``: a job
    may have started there since the first check). When the write fails or is interrupted, the
    lock file this command made goes (before the lock is let go, so that no other job takes that
    file meanwhile), and so do the folders made for it: the destination is left as it was."""
    dst = Path(dst)
    made = [p for p in (dst, *dst.parents) if not p.exists()]
    had_lock = (dst / lock.LOCK_FILE).exists()
    key = lock.acquire(dst)
    try:
        check_destination(src, dst, overwrite)
        yield
    except BaseException:
        if not had_lock:
            (dst / lock.LOCK_FILE).unlink(missing_ok=True)
        with contextlib.suppress(OSError):
            for folder in made:
                folder.rmdir()
        raise
    finally:
        lock.release(key)
