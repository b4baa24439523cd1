"""How far a conversion's routing moved over a run: from the converted folder the run started
from (``init_from``, its ``routing.*`` at their identity initialization) to the run's latest
checkpoint, the largest and the mean absolute change over every routing parameter's entries.
``compare --from`` records it in each conversion's ``analysis.json`` (``results.json`` gives it
per design, ``analysis.comparison``): "no shock" means little where the routing never moved.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file

from ..train.checkpoint import is_sharded, latest_checkpoint

#: the prefix of the routing parameters a conversion adds (``attnres.hf.convert``)
ROUTING_PREFIX = "routing."


def routing_movement(start: Path, run_dir: Path) -> dict | None:
    """``{"max_abs", "mean_abs", "entries"}``: the largest and the mean absolute change of the
    routing parameters' entries (``entries`` of them) from the folder ``start``'s weights to the
    latest checkpoint of ``run_dir`` (one process's; a checkpoint saves a folder's model under
    ``lm.``); None when ``start`` has no routing (the control) or the run no such checkpoint."""
    weights = Path(start) / "model.safetensors"
    ckpt = latest_checkpoint(Path(run_dir) / "checkpoints")
    if not weights.is_file() or ckpt is None or is_sharded(ckpt):
        return None
    before = {n: t for n, t in load_file(str(weights)).items() if n.startswith(ROUTING_PREFIX)}
    if not before:
        return None
    after = load_file(str(ckpt / "model.safetensors"))
    changes = []
    for name, tensor in before.items():
        final = after.get(name, after.get(f"lm.{name}"))
        if final is None:
            raise ValueError(f"{ckpt}: no routing tensor {name} (nor lm.{name}) of {weights}")
        changes.append((final.double() - tensor.double()).abs().flatten())
    moved = torch.cat(changes)
    return {"max_abs": float(moved.max()), "mean_abs": float(moved.mean()), "entries": moved.numel()}
