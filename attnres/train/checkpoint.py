"""Checkpoints: data, not code, written atomically.

A checkpoint is a folder ``step-NNNNNNN/`` holding ``model.safetensors`` (weights) and
``state.pt`` (optimizer state, RNG state, step, config; plain tensors and containers, loaded with
``weights_only=True``). It is written under a temporary name, every file fsynced, then renamed;
the file ``latest`` (itself replaced atomically) names the newest complete checkpoint. A crash or
a full disk mid-write leaves the previous checkpoint untouched and ``latest`` pointing at it.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..model import ModelConfig

KEEP = 2  # complete checkpoints kept on disk


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or read; the message says which and why."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_file(path: Path, write) -> None:
    write(path)
    with open(path, "rb+") as f:
        os.fsync(f.fileno())


def save_checkpoint(ckpt_root: Path, step: int, model_state: dict, train_state: dict) -> Path:
    """Write ``model_state`` (name -> tensor) and ``train_state`` as checkpoint ``step``."""
    ckpt_root = Path(ckpt_root)
    ckpt_root.mkdir(parents=True, exist_ok=True)
    final = ckpt_root / f"step-{step:07d}"
    tmp = ckpt_root / f".step-{step:07d}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        # safetensors refuses aliased tensors (tied embeddings): store each storage once
        weights = {k: v.detach().contiguous().clone() for k, v in model_state.items()}
        _write_file(tmp / "model.safetensors", lambda p: save_file(weights, str(p)))
        _write_file(tmp / "state.pt", lambda p: torch.save(train_state, p))
        _fsync_dir(tmp)
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        latest_tmp = ckpt_root / ".latest.tmp"
        _write_file(latest_tmp, lambda p: p.write_text(final.name))
        os.replace(latest_tmp, ckpt_root / "latest")
        _fsync_dir(ckpt_root)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(ckpt_root)
        kept = f"the previous checkpoint {previous} is kept" if previous else "no earlier checkpoint exists"
        raise CheckpointError(f"saving checkpoint {final} failed ({exc.strerror or exc}); {kept}") from exc
    _prune(ckpt_root, keep=final)
    return final


def _prune(ckpt_root: Path, keep: Path) -> None:
    done = sorted(p for p in ckpt_root.glob("step-*") if p.is_dir())
    for old in done[:-KEEP]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def latest_checkpoint(ckpt_root: Path) -> Path | None:
    pointer = Path(ckpt_root) / "latest"
    if not pointer.exists():
        return None
    path = Path(ckpt_root) / pointer.read_text().strip()
    return path if path.is_dir() else None


def load_checkpoint(path: Path, expected_model: ModelConfig | None = None) -> tuple[dict, dict]:
    """``(model_state, train_state)`` of checkpoint folder ``path``; a corrupt file or a model
    config other than ``expected_model`` raises ``CheckpointError``."""
    path = Path(path)
    missing = [n for n in ("model.safetensors", "state.pt") if not (path / n).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: {missing} missing")
    try:
        weights = load_file(str(path / "model.safetensors"))
        state = torch.load(path / "state.pt", weights_only=True, map_location="cpu")
    except (SafetensorError, RuntimeError, EOFError, ValueError) as exc:
        raise CheckpointError(f"checkpoint {path} is corrupt or not an attnres checkpoint: {exc}") from None
    if expected_model is not None:
        saved = state.get("config", {}).get("model")
        current = {k: v for k, v in vars(expected_model).items() if not k.startswith("_")}
        if saved is not None:  # a field added since the checkpoint was written reads as its default
            defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING}
            saved = {**{k: defaults[k] for k in current if k not in saved and k in defaults}, **saved}
        if saved != current:
            diff = sorted(k for k in current if saved is None or saved.get(k) != current[k])
            raise CheckpointError(
                f"checkpoint {path} was written for another model (fields differ: {diff})"
            )
    return weights, state
