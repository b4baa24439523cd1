"""A run's folder: what a run writes there, the refusal to start over a run it holds, and the
metrics log (JSONL on the main rank, mirrored to TensorBoard when it is installed).

A run folder holds ``.lock`` (``train/lock.py``: one writer at a time), ``config.json`` (the
run's settings), ``metrics.jsonl`` (one row per logged
step and evaluation), ``checkpoints/`` (``train/checkpoint.py``), ``tensorboard/`` and, once the
run ends, ``summary.json``; a BPE run also caches its tokenizer there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

from . import lock

#: what a run writes into its folder (``overwrite`` removes these and nothing else: not the lock);
#: the first three are files, the last two folders
RUN_FILES = ("config.json", "summary.json", "metrics.jsonl", "checkpoints", "tensorboard")
RUN_FOLDERS = ("checkpoints", "tensorboard")


def _written_by_a_run(folder: str, name: str) -> bool:
    """Whether entry ``name`` of the run's ``folder`` (``RUN_FOLDERS``) is one a run writes: a
    checkpoint (``step-NNNNNNN``, its temporary ``.step-NNNNNNN.tmp``), ``latest`` and its
    temporary file; TensorBoard's event files."""
    if folder == "checkpoints":
        return bool(re.fullmatch(r"\.?step-[0-9]{7}(\.tmp)?|\.?latest(\.tmp)?", name))
    return name.startswith("events.out.tfevents.")


def not_a_run(run_dir: Path, held: list[str]) -> str | None:
    """Why ``run_dir``, which holds the run file names ``held``, is not a run's folder, or None
    when it is one. A folder is a run's when its ``config.json`` has a run config's structure
    (``validate.check_structure``: the sections and the fields' types as the loader reads
    them, not their values, so a run saved on another machine or before a value was refused is
    still a run) and each of its run files is of its kind (a file, or a folder): a file name
    alone says nothing (a project's own ``config.json``)."""
    from ..files import read_json
    from .validate import check_structure

    config = run_dir / "config.json"
    if "config.json" not in held:
        return f"it holds {', '.join(held)} but no run's config.json"
    wrong = [name for name in held if not (run_dir / name).is_symlink()
             and (run_dir / name).is_dir() != (name in RUN_FOLDERS)]
    if wrong:
        return f"{', '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} not what a run writes there"
    try:
        check_structure(read_json(config))
    except (ValueError, OSError) as exc:
        return f"its config.json is not a run's ({str(exc).splitlines()[0][:200]})"
    return None


def outside_links(run_dir: Path) -> list[str]:
    """The run's files (``RUN_FILES``, the checkpoints and their files, the lock) that are links
    leading out of ``run_dir``: a run reads and writes its files only inside its folder."""
    root = run_dir.resolve()
    paths = [run_dir / name for name in (*RUN_FILES, lock.LOCK_FILE)]
    ckpts = run_dir / "checkpoints"
    if ckpts.is_dir() and not ckpts.is_symlink():
        for entry in sorted(ckpts.iterdir()):
            paths.append(entry)
            if entry.is_dir() and not entry.is_symlink():
                paths.extend(sorted(entry.iterdir()))
    found = []
    for path in paths:
        if path.is_symlink():
            target = path.resolve()
            if target != root and root not in target.parents:
                found.append(f"{path} -> {os.readlink(path)}")
    return found


def check_inside(run_dir: Path) -> None:
    """Refuse a run folder whose files lead out of it (``outside_links``), naming them."""
    links = outside_links(run_dir) if run_dir.is_dir() else []
    if links:
        raise ValueError(f"{run_dir}: {', '.join(links)} leads out of the run folder; a run's files stay in "
                         f"its folder: remove the link")


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool, owner: bool = True) -> list[str]:
    """Refuse, before any work, to start in a folder that another job writes (its lock's owner
    named), whose files lead out of it, that holds a file of a run's name but no run
    (``not_a_run``: a user's own ``config.json``; even with ``overwrite``), or that holds a run
    (its config, checkpoints and log would be overwritten or appended to) unless ``resume`` or
    ``overwrite``; reads only.
    Returns the names of the run's files that ``overwrite`` will remove (``remove_run``) once
    the new run is known to be able to start. ``owner=False``: the lock is not looked at (the
    ranks of a job but rank 0, whose lock it is)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise ValueError(f"--run-dir {run_dir} is a file, not a folder")
    who = lock.owner(run_dir) if owner and run_dir.is_dir() else None
    if who:
        raise lock.FolderInUse(lock.in_use_message(run_dir, who))
    check_inside(run_dir)
    held = [name for name in RUN_FILES if (run_dir / name).exists() or (run_dir / name).is_symlink()]
    if not held:
        return []
    problem = not_a_run(run_dir, held)
    if problem:
        raise ValueError(f"{run_dir} is not a run folder: {problem}; a run never replaces files it did not "
                         f"write, with or without --overwrite: choose another --run-dir, or move them away")
    if resume:
        return []
    if not overwrite:
        raise ValueError(f"{run_dir} already holds a run ({', '.join(held)}); continue it with --resume "
                         "or start over with --overwrite")
    return held


def remove_run(run_dir: Path, names: list[str]) -> None:
    """Remove the files ``names`` of the old run in ``run_dir`` (``--overwrite``); a link is
    removed, never followed. Of its folders (``RUN_FOLDERS``) only what a run writes there goes
    (``_written_by_a_run``): a file the user put there stays, and so does the folder holding it."""
    for name in names:
        path = run_dir / name
        if path.is_dir() and not path.is_symlink():
            for entry in path.iterdir():
                if not _written_by_a_run(name, entry.name):
                    continue
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry)
                else:
                    entry.unlink()
            if not any(path.iterdir()):
                path.rmdir()
        elif path.exists() or path.is_symlink():
            path.unlink()


def is_run_config(value) -> bool:
    """Whether ``value`` (a ``config.json`` read as JSON) is a training run's config, by its
    sections (``model``, ``data``, ``optim``, ``run``), not a model folder's."""
    return isinstance(value, dict) and {"model", "data", "optim", "run"} <= set(value)


def load_run_config(run_dir: Path):
    """The ``TrainConfig`` a run saved in ``run_dir/config.json``, read only inside the folder
    (``check_inside``); ``ValueError`` naming the file and what is wrong with it, or naming a
    Hugging Face model folder as one (what takes it: ``train --from``, ``eval``, ``serve``)."""
    from ..files import read_json
    from .validate import load_saved

    run_dir = Path(run_dir)
    path = run_dir / "config.json"
    if not path.is_file():
        raise ValueError(f"{run_dir} is not a training run: config.json is missing")
    check_inside(run_dir)
    saved = read_json(path)
    if isinstance(saved, dict) and isinstance(saved.get("model_type"), str) and not is_run_config(saved):
        raise ValueError(f"{run_dir} is a Hugging Face model folder (model_type={saved['model_type']!r}), not a "
                         f"training run: `attnres train --from {run_dir}` trains it, `attnres eval {run_dir}` "
                         f"evaluates it, and transformers or `attnres serve {run_dir}` run it")
    try:
        return load_saved(saved)
    except ValueError as exc:
        text = str(exc)
        raise ValueError(text if str(path) in text else f"{path}: {text}") from None


def write_json(path: Path, data: dict) -> None:
    """``data`` as indented JSON (the run's ``config.json`` and ``summary.json``), written to a
    temporary file and renamed over ``path``: a link there is replaced, never written through."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def truncate_log(path: Path, step: int) -> None:
    """Drop the rows of the JSONL log ``path`` written after ``step``: a run that stopped after
    its checkpoint at ``step`` logged them, and resuming from that checkpoint logs them again.
    A row cut short by a crash is dropped too. The file is replaced atomically."""
    if not path.exists():
        return
    lines = path.read_bytes().decode("utf-8", errors="replace").splitlines()  # a garbled row is dropped
    kept = []
    for line in lines:
        try:
            if "\ufffd" not in line and json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    if len(kept) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)


class Metrics:
    """JSONL metrics on the main rank, mirrored to TensorBoard when it is installed. Resuming
    from the checkpoint at ``resume_step`` first drops what was logged after it."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, resume_step: int | None = None):
        self.enabled = enabled
        if enabled and resume_step is not None:
            truncate_log(run_dir / "metrics.jsonl", resume_step)
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: events at later steps, from before a crash, are discarded
                purge = None if resume_step is None else resume_step + 1
                self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)
            except ImportError:
                warnings.warn("tensorboard is not installed: metrics go to metrics.jsonl only", stacklevel=2)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            split, step = record["split"], record["step"]
            for k, v in record.items():
                if k not in ("step", "tokens", "split") and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{split}/{k}", v, step)
            for layer, load in enumerate(record.get("expert_load") or ()):
                for expert, fraction in enumerate(load):
                    self.tb.add_scalar(f"{split}/expert_load/layer{layer}/expert{expert}", fraction, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


@contextmanager
def no_trace_if_refused(run_dir: Path, main: bool):
    """On the main rank, a refusal or failure before the run's first step removes what this
    job made in ``run_dir`` (the folder itself when it made it): a corrected command then finds
    the folder as it was."""
    existed = run_dir.is_dir()
    before = set(os.listdir(run_dir)) if existed else set()
    try:
        yield
    except BaseException as exc:
        if main and not isinstance(exc, lock.FolderInUse) and run_dir.is_dir():
            if not existed:
                shutil.rmtree(run_dir, ignore_errors=True)
            else:
                for name in set(os.listdir(run_dir)) - before:
                    path = run_dir / name
                    shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        raise
