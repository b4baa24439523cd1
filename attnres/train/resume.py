"""Resuming a run: the checkpoint it continues from, read and checked before any work
(``resume_point``), its state restored into the new run's model and optimizer (``restore``),
what a resume on other arithmetic than the stopped job's changes (``machine_change``), and its
counterpart, the checkpoint a run writes (``save``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ..files import read_json
from ..model import match_param_groups
from .checkpoint import (CheckpointError, check_state, is_sharded, latest_checkpoint, load_checkpoint, load_problem,
                         load_train_state, save_checkpoint)
from .config import SAVED_BEFORE, TrainConfig, to_dict
from .data import is_path_source
from .machine import machine
from .sharded import load_full, load_sharded, save_sharded
from .steps import LayerGradNorms


@dataclass
class ResumePoint:
    """The checkpoint a resumed run continues from, read and checked before any work: its
    folder, its weights (a one-process checkpoint; a sharded one is read rank by rank when it is
    restored: None) and state (``state.pt``)."""

    path: Path
    weights: dict | None
    state: dict


def _same_data(saved: dict, given: dict) -> list[str]:
    """The ``data.*`` fields where the run's saved settings and the given ones differ (paths
    compared as the files they name)."""
    def norm(key, value):
        if key == "source" and isinstance(value, str) and is_path_source(value):
            return str(Path(value).expanduser().resolve())
        return value

    saved = {**SAVED_BEFORE["data"], **saved}  # a field the run saved before it existed: what it did then
    return [f"data.{k}: the run's {saved.get(k)!r}, given {v!r}" for k, v in given.items()
            if norm(k, saved.get(k)) != norm(k, v)]


#: what a resumed run keeps from the saved one: the global batch it draws each step
KEPT_ON_RESUME = ("batch_size", "seq_len", "seed")


def _same_run(saved: dict, cfg: TrainConfig) -> list[str]:
    """The ``run.*`` fields of ``KEPT_ON_RESUME`` where the saved settings and ``cfg`` differ."""
    return [f"run.{k}: the run's {saved[k]!r}, given {getattr(cfg.run, k)!r}" for k in KEPT_ON_RESUME
            if k in saved and saved[k] != getattr(cfg.run, k)]


def _same_source(saved: dict, cfg: TrainConfig) -> bool:
    """Whether the checkpoint's saved config and ``cfg`` continue the same folder's model: the
    same digest where both recorded one (the folder may have moved: ``--source``), else the same
    path (None for attnres's own runs)."""
    recorded, given = saved.get("init_from_digest"), cfg.init_from_digest
    if isinstance(recorded, dict) and given is not None:
        return recorded.get("sha256") == given["sha256"]
    return saved.get("init_from") == cfg.init_from


def resume_point(cfg: TrainConfig, run_dir: Path, checked_model=None) -> ResumePoint:
    """The latest checkpoint of ``run_dir``, every file checked against ``cfg`` (its model, its
    data: a resumed run continues on the batches it was drawing) and refused when it already
    reached ``run.steps``; reads only. ``checked_model``: the model config its weights and state
    are checked against (``RunModel.checkpoint_model``; None: a folder's model, whose state is
    checked by its contents and its weights by their names on loading)."""
    ckpt_root = run_dir / "checkpoints"
    path = latest_checkpoint(ckpt_root)
    if path is None:
        raise CheckpointError(f"--resume: no checkpoint in {ckpt_root}")
    if is_sharded(path):
        weights, state = None, load_train_state(path, checked_model)
    else:
        weights, state = load_checkpoint(path, checked_model)
    check_state(state, path)  # the state's contents, checked already with a model config to check against
    if not _same_source(state["config"], cfg):
        raise ValueError(f"--resume continues the run in {run_dir}, which continued the model of "
                         f"{state['config'].get('init_from')}, and the run given continues {cfg.init_from}")
    saved_run = state["config"].get("run")
    changed = _same_run(saved_run if isinstance(saved_run, dict) else {}, cfg)
    if changed:
        raise ValueError(f"--resume continues the run in {run_dir} on its own batches, and {'; '.join(changed)}: "
                         f"a resumed run may change its layout (run.parallel, run.pp_*, run.grad_accum, the number "
                         f"of processes), not its batch")
    saved_data = state["config"].get("data")
    differ = _same_data(saved_data if isinstance(saved_data, dict) else {}, to_dict(cfg)["data"])
    if differ:
        raise ValueError(f"--resume continues the run in {run_dir} on its own data, and {'; '.join(differ)}: "
                         f"drop the data settings, or start a new run (--run-dir, or --overwrite) on the new data")
    step = state["step"]
    if step >= cfg.run.steps:
        raise ValueError(
            f"the run in {run_dir} already finished its {step} steps; resume with "
            f"--set run.steps=N (N > {step}) to train further"
        )
    return ResumePoint(path, weights, state)


def saved_machine(point: ResumePoint, run_dir: Path) -> dict | None:
    """The machine (``machine.machine``) of the job that wrote checkpoint ``point``: the record in
    its ``state.pt``, or for a checkpoint saved before that record, the one the run's
    ``summary.json`` names (the last job that ended; None when it has none or cannot be read)."""
    recorded = point.state.get("machine") if isinstance(point.state, dict) else None
    if recorded is None:
        try:
            recorded = read_json(Path(run_dir) / "summary.json").get("machine")
        except (OSError, ValueError, AttributeError):
            return None
    return recorded if isinstance(recorded, dict) and recorded.get("id") else None


def machine_change(before: dict | None, now: dict, run_dir: Path) -> str | None:
    """One line when run ``run_dir`` resumes on other arithmetic than the job that wrote its
    checkpoint (``machine.machine``'s ``id`` differs: the CPU or its instruction flags, the thread
    count, torch, the GPU), naming what changed; None when it is the same or unknown. A step's
    reductions split over other threads or run other instructions round otherwise, so the
    resumed losses leave an uninterrupted run's in their last digits (equal to the last bit only
    on one machine at one thread count)."""
    if before is None or before.get("id") == now.get("id"):
        return None
    changed = [f"{key} {before.get(key)!r} -> {now.get(key)!r}" for key in ("cpu", "threads", "torch", "gpu")
               if before.get(key) != now.get(key)]
    return (f"{run_dir} resumes on other arithmetic than the job that wrote its checkpoint "
            f"({'; '.join(changed) or 'the CPU instruction flags'}): from here its losses round otherwise than "
            f"an uninterrupted run's (equal to the last bit only on one machine at one thread count)")


def restore(point: ResumePoint, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig,
            distributed: bool, mismatch: str = "") -> tuple[int, LayerGradNorms]:
    """Continue from ``point`` (``resume_point``) exactly where it stopped: the weights into
    ``model`` (this rank's part), the optimizer's state, the RNG; returns the step to continue
    from and the gradient-norm statistics. A checkpoint of any layout loads into any other: a
    sharded one through DCP (``sharded.load_sharded``), a one-process one into one process as it
    was saved, or into each rank's part (``sharded.load_full``, ``distributed``). Each group's
    learning-rate scale is the run's settings', not the checkpoint's: a resume with another
    ``optim.query_lr_scale`` or ``optim.routing_lr_scale`` trains at the new one. ``mismatch``:
    what weights that do not fit ``model`` may mean (``RunModel.checkpoint_mismatch``)."""
    state = point.state
    scales = {g.get("name"): g.get("lr_scale") for g in optimizer.param_groups}
    try:
        if point.weights is None:
            load_sharded(point.path, model, optimizer)
        elif not distributed:
            try:
                model.load_state_dict(point.weights)
            except RuntimeError as exc:
                raise CheckpointError(f"{point.path / 'model.safetensors'}: its weights are not the model's "
                                      f"({load_problem(exc)}){mismatch}") from None
            saved = state["optimizer"]
            groups = match_param_groups(saved["param_groups"], optimizer.param_groups)
            optimizer.load_state_dict({**saved, "param_groups": groups})
        else:
            load_full(model, optimizer, point.weights, state["optimizer"], cfg.model, cfg.optim)
    except CheckpointError:
        raise
    except (ValueError, KeyError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"{point.path / 'state.pt'}: its optimizer state does not fit the model "
                              f"({str(exc).splitlines()[0][:200]})") from None
    for group in optimizer.param_groups:
        for p in group["params"]:
            moments = optimizer.state.get(p, {})
            if any(isinstance(v, torch.Tensor) and v.dim() and v.shape != p.shape for v in moments.values()):
                raise CheckpointError(f"{point.path / 'state.pt'}: its optimizer state holds moments of another "
                                      f"shape than the model's parameters")
    for group in optimizer.param_groups:  # loading took the saved groups' settings
        if scales.get(group.get("name")) is None:
            group.pop("lr_scale", None)
        else:
            group["lr_scale"] = scales[group["name"]]
    torch.set_rng_state(state["rng"])
    return state["step"], LayerGradNorms.from_state(state)


def save(ckpt_root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer, cfg: TrainConfig,
         grad_norms: LayerGradNorms, distributed: bool) -> None:
    """Checkpoint ``step`` into ``ckpt_root``: the weights and optimizer state, the RNG, the
    config and the gradient-norm statistics; one process writes them whole, several
    (``distributed``) write their own shards (``sharded.save_sharded``), nothing gathered; the
    machine that wrote it (``machine.machine``), which a resume compares with its own."""
    first = next(model.parameters(), None)
    train_state = dict(rng=torch.get_rng_state(), step=step, config=to_dict(cfg), **grad_norms.state(),
                       machine=machine(first.device if first is not None else None))
    if distributed:
        save_sharded(ckpt_root, step, model, optimizer, train_state)
    else:
        save_checkpoint(ckpt_root, step, model.state_dict(), dict(optimizer=optimizer.state_dict(), **train_state))
