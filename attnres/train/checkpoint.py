"""Checkpoints: data, not code, written atomically.

A checkpoint of one process is a folder ``step-NNNNNNN/`` holding ``model.safetensors``
(weights) and ``state.pt`` (optimizer state, RNG state, step, config; plain tensors and
containers, loaded with ``weights_only=True``). A run of several processes writes the same
folder sharded instead (``train/sharded.py``: DCP's files for the model and the optimizer, and
``state.pt`` without the optimizer); every function here reads both. Either is written and
published atomically, with ``latest`` naming the newest complete one
(``train/checkpoint_store.py``).
"""

from __future__ import annotations

import dataclasses
import pickle
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from ..model import ModelConfig
from .checkpoint_store import CheckpointError, is_sharded, latest_checkpoint, prune, publish, write_synced
from .sharded import read_weights
from .stage_local import meta_model
from .validate import load_saved

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
        write_synced(tmp / "model.safetensors", lambda p: save_file(weights, str(p)))
        write_synced(tmp / "state.pt", lambda p: torch.save(train_state, p))
        publish(tmp, final)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_checkpoint(ckpt_root)
        kept = f"the previous checkpoint {previous} is kept" if previous else "no earlier checkpoint exists"
        raise CheckpointError(f"saving checkpoint {final} failed ({exc.strerror or exc}); {kept}") from exc
    prune(ckpt_root, keep=final)
    return final


#: what ``state.pt`` holds: key -> (accepted types, what it is)
STATE_KEYS = {"optimizer": (dict, "the optimizer's state"), "rng": (torch.Tensor, "the RNG state"),
              "step": (int, "the step"), "config": (dict, "the run's config")}


def check_state(state, path: Path) -> None:
    """``CheckpointError`` unless ``state`` (``state.pt``'s content) holds ``STATE_KEYS`` of
    their types (a sharded checkpoint's optimizer lives with its shards), an optimizer state
    with its ``state`` and ``param_groups``, a step >= 0."""
    where = path / "state.pt"
    if not isinstance(state, dict):
        raise CheckpointError(f"{where} holds {type(state).__name__}, not a checkpoint's state")
    sharded = is_sharded(path)
    for key, (kind, what) in STATE_KEYS.items():
        if sharded and key == "optimizer":
            continue
        if key not in state:
            raise CheckpointError(f"{where} lacks {key!r} ({what}); was it edited by hand?")
        if not isinstance(state[key], kind) or (kind is int and isinstance(state[key], bool)):
            raise CheckpointError(f"{where}: {key!r} ({what}) is {type(state[key]).__name__}, not {kind.__name__}")
    optim = state.get("optimizer", {"state": {}, "param_groups": []})
    if not isinstance(optim.get("state"), dict) or not isinstance(optim.get("param_groups"), list):
        raise CheckpointError(f"{where}: the optimizer's state lacks 'state' or 'param_groups'")
    rng = state["rng"]
    if state["step"] < 0 or rng.dtype != torch.uint8 or rng.shape != torch.get_rng_state().shape:
        raise CheckpointError(f"{where}: step {state['step']} or the RNG state ({state['rng'].dtype}) is not "
                              f"one a run saves")
    for key in ("grad_norm_sums", "grad_norm_count"):
        value = state.get(key)
        if value is not None and not isinstance(value, (torch.Tensor, int)):
            raise CheckpointError(f"{where}: {key!r} is {type(value).__name__}")


def check_weights(weights: dict, expected_model: ModelConfig, path: Path) -> None:
    """``CheckpointError`` unless ``weights`` have the names and shapes of ``expected_model``'s
    (counted on the meta device): a ``model.safetensors`` of another design or size."""
    expected = {k: tuple(v.shape) for k, v in meta_model(expected_model).state_dict().items()}
    got = {k: tuple(v.shape) for k, v in weights.items()}
    missing, unexpected = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    shapes = sorted(k for k in set(expected) & set(got) if expected[k] != got[k])
    if missing or unexpected or shapes:
        what = "; ".join(text for text in (
            f"missing {missing[:4]}" if missing else "", f"unexpected {unexpected[:4]}" if unexpected else "",
            f"{shapes[0]} is {got[shapes[0]]}, the model's is {expected[shapes[0]]}" if shapes else "") if text)
        raise CheckpointError(f"{path / 'model.safetensors'} holds the weights of another model ({what}); "
                              f"the run's config.json describes {expected_model.residual!r} of dim "
                              f"{expected_model.dim}")


def load_problem(exc: BaseException) -> str:
    """What a ``load_state_dict`` error says is wrong, in one line: its first detail (a size
    mismatch, the keys missing), with how many more there are; the error's own first line only
    names the module (``Error(s) in loading state_dict for FolderLM:``)."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    if len(lines) > 1 and lines[0].endswith(":"):
        more = f" (and {len(lines) - 2} more)" if len(lines) > 2 else ""
        return lines[1][:300] + more
    return (lines[0] if lines else type(exc).__name__)[:300]


def load_checkpoint(path: Path, expected_model: ModelConfig | None = None) -> tuple[dict, dict]:
    """``(model_state, train_state)`` of checkpoint folder ``path``; a file that is missing or
    corrupt raises ``CheckpointError`` naming it, and with ``expected_model`` (loading for a run)
    so does a state of another content (``check_state``) or a model other than
    ``expected_model`` (its config in ``state.pt``, its weights' names and shapes)."""
    path = Path(path)
    state = load_train_state(path, expected_model)
    if is_sharded(path):  # the whole model's weights read from the shards, in this process
        config = expected_model or load_saved(state["config"]).model
        return read_weights(path, config), state
    try:
        weights = load_file(str(path / "model.safetensors"))
    except (SafetensorError, OSError, RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{path / 'model.safetensors'} is corrupt or not a model's weights: {exc}") from None
    if expected_model is not None:
        check_weights(weights, expected_model, path)
    return weights, state


def load_train_state(path: Path, expected_model: ModelConfig | None = None) -> dict:
    """``state.pt`` of checkpoint folder ``path`` (either format), its files present; with
    ``expected_model`` checked as ``load_checkpoint`` does, the weights aside."""
    path = Path(path)
    files = ("state.pt", ".metadata") if is_sharded(path) else ("model.safetensors", "state.pt")
    missing = [n for n in files if not (path / n).is_file()]
    if missing:
        raise CheckpointError(f"checkpoint {path} is incomplete: {missing} missing")
    try:
        state = torch.load(path / "state.pt", weights_only=True, map_location="cpu")
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError, AttributeError, TypeError,
            IndexError, KeyError, ImportError):
        # torch's own text suggests loading it with weights_only=False: never for a run's file
        raise CheckpointError(f"{path / 'state.pt'} is corrupt or not an attnres checkpoint's state (it does not "
                              f"load as plain tensors and containers)") from None
    if expected_model is not None:  # loaded for a run: every part of it checked
        check_state(state, path)
        saved = state["config"].get("model")
        current = {k: v for k, v in vars(expected_model).items() if not k.startswith("_")}
        if isinstance(saved, dict):  # a field added since the checkpoint was written reads as its default
            defaults = {f.name: f.default for f in dataclasses.fields(ModelConfig) if f.default is not dataclasses.MISSING}
            saved = {**{k: defaults[k] for k in current if k not in saved and k in defaults}, **saved}
            if isinstance(saved.get("block_sizes"), list):
                saved["block_sizes"] = tuple(saved["block_sizes"])
        if saved != current:
            diff = sorted(k for k in current if not isinstance(saved, dict) or saved.get(k) != current[k])
            raise CheckpointError(
                f"checkpoint {path} was written for another model (fields differ: {diff})"
            )
    return state
