"""Sharded checkpoints of a run of several processes, with ``torch.distributed.checkpoint`` (DCP).

Each rank writes its own part (a pipeline rank's stages, an FSDP2 rank's shards); nothing is
gathered. The folder ``step-NNNNNNN/`` holds DCP's files (``.metadata`` and one ``.distcp`` file
per rank: the model and the optimizer, under the names the whole model gives its parameters)
and ``state.pt`` (rank 0: step, RNG, config, gradient-norm statistics; plain tensors and
containers). It is written as ``checkpoint.save_checkpoint`` writes one process's: into a
temporary folder, every file fsynced, then renamed by rank 0 once every rank has written, and
``latest`` replaced after. A rank that dies mid-save leaves the temporary folder, never a
``step-*`` folder, and ``latest`` names the previous checkpoint.

Loading reshards: a rank asks DCP for the tensors its own layout holds, and DCP reads them from
whatever layout wrote them (``load_sharded``). A one-process checkpoint (``model.safetensors``)
loads into any layout through ``load_full``. Non-tensor values (the optimizer's settings) are
read with ``torch.load(..., weights_only=True)`` (``DataOnlyLoadPlanner``), never as code.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from ..model import ModelConfig, Transformer, match_param_groups, param_groups
from .checkpoint_store import CheckpointError, latest_checkpoint, prune, publish, write_synced


def _flat_options():
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


#: what DCP's ``.metadata`` may name when it is unpickled: its own record classes and the
#: torch and pathlib types they hold (``torch``'s dtypes are checked apart)
METADATA_CLASSES = frozenset({
    *(("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"),
    ("pathlib", "PurePosixPath"), ("pathlib", "PureWindowsPath"),
})


def _reader(path: Path):
    """DCP's file reader, its ``.metadata`` unpickled with only ``METADATA_CLASSES`` (and
    torch's dtypes) allowed: DCP itself unpickles the file with ``pickle.load``, which runs
    whatever a crafted file names."""
    import pickle

    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class MetadataUnpickler(pickle.Unpickler):
        def find_class(self, module, name):
            allowed = (module, name) in METADATA_CLASSES or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype))
            if not allowed:
                raise CheckpointError(f"{Path(path) / '.metadata'} names {module}.{name}, which a checkpoint's "
                                      f"metadata never holds; it is not read")
            return super().find_class(module, name)

    class DataOnlyReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return DataOnlyReader(str(path))


def _planner():
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class DataOnlyLoadPlanner(DefaultLoadPlanner):
        """DCP's default load planner, but a non-tensor value is read as data only."""

        def load_bytes(self, read_item, value) -> None:
            loaded = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._nested_dict import set_element

                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
            else:
                self.state_dict[read_item.dest_index.fqn] = loaded

    return DataOnlyLoadPlanner()


def local_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """``{"model": ..., "optimizer": ...}``: this rank's tensors, named as the whole model names
    them (FSDP2's shards as DTensors). The optimizer's state is flat, every entry keyed by its
    parameter's name (its moments and its group's settings alike), so that a rank of another
    layout finds what its own parameters need."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer, options=_flat_options())
    return {"model": model_state, "optimizer": _renamed(optim_state, *_tied_alias(model))}


def _tied_alias(model: nn.Module) -> tuple[str, str]:
    """``(local, saved)``: the name under which this rank's optimizer knows a tied embedding and
    the one a checkpoint keeps it under (``tok_embeddings.weight``, as one process names it); a
    rank that holds the head without the embedding knows it as ``lm_head.weight``."""
    inner = getattr(model, "module", model)
    config = getattr(inner, "config", None)
    if getattr(config, "tie_embeddings", False) and inner.tok_embeddings is None and inner.lm_head is not None:
        return "lm_head.weight", "tok_embeddings.weight"
    return "", ""


def _renamed(flat: dict, old: str, new: str) -> dict:
    """A flat optimizer state with parameter name ``old`` replaced by ``new`` in its keys."""
    if not old:
        return flat
    return {k.replace(f".{old}.", f".{new}.") if f".{old}." in k else k: v for k, v in flat.items()}


def save_sharded(ckpt_root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                 train_state: dict) -> Path:
    """Write checkpoint ``step`` from every rank (collective); rank 0 writes ``train_state``
    (``state.pt``), renames the folder into place and replaces ``latest``."""
    import torch.distributed.checkpoint as dcp

    ckpt_root = Path(ckpt_root)
    final, tmp = ckpt_root / f"step-{step:07d}", ckpt_root / f".step-{step:07d}.tmp"
    main = dist.get_rank() == 0
    problem = None
    if main:
        try:
            ckpt_root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        except OSError as exc:
            problem = exc
    _agree_on(problem, final)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(local_state(model, optimizer), checkpoint_id=str(tmp))
        if main:
            write_synced(tmp / "state.pt", lambda p: torch.save(train_state, p))
            publish(tmp, final)
    except (OSError, CheckpointException) as exc:  # DCP's carries each rank's error (a BaseException)
        problem = exc
    _agree_on(problem, final, ckpt_root, tmp)
    if main:
        prune(ckpt_root, keep=final)
    return final


def _agree_on(problem: BaseException | None, final: Path, ckpt_root: Path | None = None,
              tmp: Path | None = None) -> None:
    """Every rank learns whether any failed to write; each raises ``CheckpointError`` then."""
    failed = [None] * dist.get_world_size()
    text = None if problem is None else getattr(problem, "strerror", None) or _first_line(problem)
    dist.all_gather_object(failed, text)
    first = next((text for text in failed if text), None)
    if first is None:
        return
    if tmp is not None and dist.get_rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    previous = latest_checkpoint(ckpt_root) if ckpt_root is not None else None
    kept = f"the previous checkpoint {previous} is kept" if previous else "no earlier checkpoint exists"
    raise CheckpointError(f"saving checkpoint {final} failed ({first}); {kept}")


def load_sharded(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
    """Load sharded checkpoint ``path`` into this rank's ``model`` (and ``optimizer``), whatever
    layout wrote it and whatever this one is (collective under torchrun; one process reads it
    alone)."""
    from torch.distributed.checkpoint.state_dict import set_state_dict

    if optimizer is None:
        state = {"model": model.state_dict()}
    else:
        state = local_state(model, optimizer)
    _read(state, path, "does not load into this run's model")
    if optimizer is None:
        model.load_state_dict(state["model"])
    else:
        local, saved = _tied_alias(model)
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=_renamed(state["optimizer"], saved, local), options=_flat_options())


def _read(state: dict, path: Path, failure: str) -> None:
    """DCP's load of ``state`` (in place) from ``path``: collective under torchrun, in this
    process alone otherwise (DCP's warning that it assumes so is expected here, not shown);
    ``CheckpointError`` saying ``failure`` and DCP's first line when it fails."""
    import warnings

    import torch.distributed.checkpoint as dcp

    from torch.distributed.checkpoint.api import CheckpointException

    alone = not dist.is_initialized()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            reader = _reader(path)
            reader.read_metadata()  # here first: DCP would log a refusal and try other files
            dcp.load(state, storage_reader=reader, planner=_planner(), no_dist=alone)
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP's carries each rank's error (a BaseException)
        raise CheckpointError(f"checkpoint {path} {failure} ({_first_line(exc)})") from None


def _first_line(exc: BaseException) -> str:
    """The first line of ``exc``'s message; of the first rank's error for DCP's exception, which
    names only the ranks that failed."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        exc = failures[min(failures)][0]  # (the exception, its traceback)
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:300]


def read_weights(path: Path, config: ModelConfig | None, model: nn.Module | None = None) -> dict:
    """The whole model's weights (name -> CPU tensor) from sharded checkpoint ``path``, read in
    one process: what ``generate``, ``export`` and a comparison's analysis load. The weights
    are those of a ``Transformer`` of ``config``, or (``config`` None) of ``model``, a folder's
    model on the CPU (``train --from``), whose own tensors are overwritten."""
    if config is None:
        if model is None:
            raise CheckpointError(f"{path}: a run that continued a folder's model is read with that model")
    else:
        with torch.device("meta"):
            model = Transformer(config, initialize=False)
        model.to_empty(device="cpu")
        if config.tie_embeddings:
            model.lm_head.weight = model.tok_embeddings.weight
    state = {"model": model.state_dict()}
    _read(state, path, "does not hold the weights of the run's model")
    return state["model"]


def full_optimizer_names(config: ModelConfig | None, optim, model: nn.Module | None = None) -> list[str]:
    """The whole model's parameter names in the order one process's optimizer numbers them
    (``param_groups`` for the ``OptimConfig`` ``optim``: the decaying ones, then the others, then
    any scaled query projections and routing parameters), for a ``Transformer`` of ``config``,
    or (``config`` None) for ``model`` itself, a folder's model every rank holds whole or in
    shards of the same names."""
    if config is not None:
        with torch.device("meta"):
            model = Transformer(config, initialize=False)
    names = {id(p): n for n, p in model.named_parameters()}
    groups = param_groups(model, optim.weight_decay, query_lr_scale=optim.query_lr_scale,
                          routing_lr_scale=optim.routing_lr_scale)
    return [names[id(p)] for group in groups for p in group["params"]]


def load_full(model: nn.Module, optimizer: torch.optim.Optimizer, weights: dict, optim_state: dict,
              config: ModelConfig | None, optim) -> None:
    """Load a one-process checkpoint (the whole model's ``weights`` and its optimizer's
    ``state_dict``, parameters numbered) into this rank's part: the names it holds picked out,
    FSDP2's shards cut from them."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    numbered = full_optimizer_names(config, optim, model)
    local, saved = _tied_alias(model)
    as_held = {saved: local} if local else {}  # a tied embedding this rank knows by the head's name
    name_of = {**{k: n for k, n in enumerate(numbered)}, **{n: n for n in numbered}}  # numbered, or by name
    name_of = {k: as_held.get(n, n) for k, n in name_of.items()}
    local_model, local_optim = get_state_dict(model, optimizer)
    held = set(local_optim["state"]) | {n for g in local_optim["param_groups"] for n in g["params"]}
    saved_state = optim_state["state"]
    if not all(k in name_of for k in saved_state):
        raise CheckpointError("the checkpoint's optimizer state does not name the model's parameters")
    state = {name_of[k]: v for k, v in saved_state.items() if name_of[k] in held}
    try:
        saved_groups = match_param_groups(optim_state["param_groups"], local_optim["param_groups"])
    except ValueError as err:
        raise CheckpointError(str(err)) from None
    groups = [{**saved, "params": local["params"]} for saved, local in zip(saved_groups, local_optim["param_groups"])]
    set_state_dict(model, optimizer, model_state_dict={k: weights[k] for k in local_model},
                   optim_state_dict={"state": state, "param_groups": groups},
                   options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=False))
