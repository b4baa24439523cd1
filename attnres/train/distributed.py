"""Everything that touches ``torch.distributed`` outside the pipeline and the sharded
checkpoints: process group, DDP/FSDP2 wrapping, reductions. Model code stays single-device;
parallelism is applied from outside.

Under ``torchrun`` (``WORLD_SIZE > 1``) the process group starts with NCCL on CUDA and gloo on the
CPU. Wrapping order: FSDP2 ``fully_shard`` on each sublayer (attention, MLP), then on the root (which
holds embeddings, the stream and the head); or DDP around the whole model.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: torch.device = torch.device("cpu")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1


def pick_device(preference: str) -> torch.device:
    """The device ``run.device`` names, refused unless training can run there: ``auto``,
    ``cpu``, or ``cuda``/``cuda:N`` with that GPU present (``mps`` where it is available)."""
    if preference == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(preference)
    except (RuntimeError, TypeError):
        raise ValueError(f"run.device={preference!r} is not a device ('auto', 'cpu', 'cuda', 'cuda:1', ...)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"run.device={preference!r} but CUDA is not available")
    if device.type == "cuda" and device.index is not None and device.index >= torch.cuda.device_count():
        raise ValueError(f"run.device={preference!r}: this machine has {torch.cuda.device_count()} GPU(s), "
                         f"cuda:0 to cuda:{torch.cuda.device_count() - 1}")
    mps = device.type == "mps" and torch.backends.mps.is_available()
    if device.type not in ("cpu", "cuda") and not mps:
        raise ValueError(f"run.device={preference!r} is not a device training runs on here: 'auto', 'cpu' or "
                         f"'cuda[:N]'")
    if device.type == "cpu" and device.index not in (None, 0):
        raise ValueError(f"run.device={preference!r}: the CPU is one device, 'cpu'")
    return device


def launched_rank() -> int:
    """This process's rank as torchrun launched it (0 without torchrun), known before the
    process group starts."""
    return int(os.environ.get("RANK", "0"))


def launched_world_size() -> int:
    """How many processes torchrun started for this job (1 without torchrun), known before the
    process group starts."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def setup(device_preference: str = "auto") -> DistInfo:
    """Start the process group when launched by torchrun; otherwise a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    device = pick_device(device_preference)
    if world <= 1:
        return DistInfo(device=device)
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return DistInfo(rank, world, local_rank, device)


def agree(problem: Exception | None, info: DistInfo) -> None:
    """Every rank learns whether any rank refused to start: a rank with ``problem`` raises it,
    the others raise ``ValueError`` quoting the first refusal (so that no rank waits on one that
    left). Without torchrun, raises ``problem`` when given."""
    if not info.distributed:
        if problem is not None:
            raise problem
        return
    messages = [None] * info.world_size
    dist.all_gather_object(messages, None if problem is None else str(problem))
    if problem is not None:
        raise problem
    refused = [(rank, text) for rank, text in enumerate(messages) if text]
    if refused:
        rank, text = refused[0]
        raise ValueError(f"rank {rank} refused to start: {text}")


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def wrap(model: nn.Module, wrapping: str, units: list[nn.Module] | None = None) -> nn.Module:
    """``model`` as a plan's ``wrapping`` says (``parallel_plan.ParallelPlan.wrapping``): in DDP
    or FSDP2 over every process; the model itself for ``none`` (one process). FSDP2 shards
    ``units`` one by one before the whole (default: the ``Transformer``'s sublayers)."""
    if wrapping == "none":
        return model
    if wrapping == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        device = next(model.parameters()).device
        return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    if wrapping == "fsdp":
        from torch.distributed.fsdp import fully_shard

        # the sublayers are the modules whose forward runs (a Layer only groups them), so they
        # are the units whose parameters are gathered just in time
        if units is None:
            units = [m for layer in model.layers for m in (layer.attn, layer.mlp)]
        for unit in units:
            fully_shard(unit)
        fully_shard(model)
        return model
    raise ValueError(f"wrapping {wrapping!r} is not one of ('none', 'ddp', 'fsdp'); a pipeline wraps its stages itself")


def no_sync(wrapped: nn.Module, enabled: bool):
    """Skip DDP's gradient all-reduce on the micro-steps before the last one."""
    import contextlib

    if enabled and hasattr(wrapped, "no_sync"):
        return wrapped.no_sync()
    return contextlib.nullcontext()


def mean_across_ranks(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= dist.get_world_size()
    return value


def sum_across_ranks(value: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
    return value


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
