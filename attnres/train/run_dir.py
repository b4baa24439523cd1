"""A run's folder: what a run writes there, the refusal to start over a run it holds, and the
metrics log (JSONL on the main rank, mirrored to TensorBoard when it is installed).

A run folder holds ``config.json`` (the run's settings), ``metrics.jsonl`` (one row per logged
step and evaluation), ``checkpoints/`` (``train/checkpoint.py``), ``tensorboard/`` and, once the
run ends, ``summary.json``; a BPE run also caches its tokenizer there.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from pathlib import Path

#: what a run writes into its folder (``overwrite`` removes these and nothing else)
RUN_FILES = ("config.json", "summary.json", "metrics.jsonl", "checkpoints", "tensorboard")


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse, before any work, to start a new run in a folder that holds one (its config,
    checkpoints and log would be overwritten or appended to) unless ``resume`` or
    ``overwrite``; with ``overwrite`` the old run's files go."""
    held = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not held or resume:
        return
    if not overwrite:
        raise ValueError(f"{run_dir} already holds a run ({', '.join(held)}); continue it with --resume "
                         "or start over with --overwrite")
    for name in held:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def write_json(path: Path, data: dict) -> None:
    """``data`` as indented JSON (the run's ``config.json`` and ``summary.json``)."""
    path.write_text(json.dumps(data, indent=2))


def truncate_log(path: Path, step: int) -> None:
    """Drop the rows of the JSONL log ``path`` written after ``step``: a run that stopped after
    its checkpoint at ``step`` logged them, and resuming from that checkpoint logs them again.
    A row cut short by a crash is dropped too. The file is replaced atomically."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
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
