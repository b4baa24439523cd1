"""A run's parts before its first step, each on its own: where this process runs (``Placement``,
``start_processes``: the process group, a pipeline's mesh), the optimizer (``build_optimizer``)
and the autocast of its steps (``autocast_for``). ``trainer.start`` puts them together with the
data (``run_model.load_data``) and the model (``RunModel.instantiate``) in a ``Run``."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from ..model import Transformer, param_groups
from . import distributed as dist
from .config import OptimConfig, TrainConfig
from .parallel_plan import ParallelPlan
from .pipeline import Groups, pipeline_groups


@dataclass
class Placement:
    """Where this process runs: the job's ``plan`` (``parallel_plan.ParallelPlan``), this
    process's rank and device (``info``) and its part of every batch, data-parallel rank
    ``dp_rank`` of ``dp_size`` (the ranks of one pipeline share their copy's part); in a
    pipeline, its groups on the plan's ``(dp, pp)`` mesh (``pipeline.Groups``)."""

    plan: ParallelPlan
    info: dist.DistInfo
    dp_rank: int
    dp_size: int
    groups: Groups | None = None


def start_processes(cfg: TrainConfig, plan: ParallelPlan) -> Placement:
    """The process group (under torchrun) and, for a pipeline, the plan's device mesh."""
    info = dist.setup(cfg.run.device)
    if not plan.pipelined:
        return Placement(plan, info, info.rank, info.world_size)
    groups = pipeline_groups(plan, "cuda" if torch.distributed.get_backend() == "nccl" else "cpu")
    return Placement(plan, info, groups.replica_index, groups.replica_count, groups)


def build_optimizer(cfg: OptimConfig, model: Transformer) -> torch.optim.Optimizer:
    """AdamW over ``param_groups`` (no weight decay on norms, biases and routing vectors; the
    input-dependent queries' projections in a group of their own when their learning rate is
    scaled)."""
    return torch.optim.AdamW(param_groups(model, cfg.weight_decay, query_lr_scale=cfg.query_lr_scale,
                                          routing_lr_scale=cfg.routing_lr_scale), lr=cfg.lr,
                             betas=(cfg.beta1, cfg.beta2))


def autocast_for(device: torch.device, setting: str) -> Callable:
    """A context factory: bf16 autocast on CUDA with ``run.autocast=auto``, nothing otherwise."""
    if device.type == "cuda" and setting == "auto":
        return lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext
