"""A run's parts before its first step, each on its own: where this process runs (``Placement``,
``start_processes``: the process group, a pipeline's mesh), the data (``load_data``), the model,
initialized, wrapped and compiled or cut into pipeline stages (``build_model``), the optimizer
(``build_optimizer``) and the autocast of its steps (``autocast_for``). ``trainer.start`` puts
them together in a ``Run``."""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..model import Transformer, param_groups
from . import distributed as dist
from .config import OptimConfig, TrainConfig
from .data import Corpus, check_length, load_corpus
from .folder_model import FolderModel, check_tokens
from .materialize import rank_model
from .parallel_plan import ParallelPlan
from .pipeline import Groups, Pipeline, build_pipeline, pipeline_groups


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


def load_data(cfg: TrainConfig, run_dir: Path, corpus: Corpus | None = None,
              folder: FolderModel | None = None) -> tuple[TrainConfig, Corpus]:
    """``corpus``, or the one ``cfg.data`` names (a BPE tokenizer cached in ``run_dir``; the
    tokenizer of the ``folder`` a run continues, ``data.tokenizer='model'``), and ``cfg`` with
    the corpus's vocabulary size (a folder's model keeps its own, which must hold every token);
    both splits hold a sequence."""
    run_dir.mkdir(parents=True, exist_ok=True)
    if folder is not None:
        corpus = corpus or load_corpus(cfg.data, folder.vocab_size, bpe_dir=run_dir, tokenizer=folder.tokenizer)
        check_tokens(cfg.data, corpus, folder)
    else:
        corpus = corpus or load_corpus(cfg.data, cfg.model.vocab_size, bpe_dir=run_dir)
        if corpus.vocab_size != cfg.model.vocab_size:
            cfg = replace(cfg, model=replace(cfg.model, vocab_size=corpus.vocab_size))
    check_length(corpus.train, cfg.run.seq_len, "training")
    check_length(corpus.val, cfg.run.seq_len, "validation")
    return cfg, corpus


def build_model(cfg: TrainConfig, place: Placement,
                folder: FolderModel | None = None) -> tuple[nn.Module, nn.Module, nn.Module, Pipeline | None]:
    """``(model, wrapped, forward, pipe)``: the model, initialized from ``run.seed`` on this
    process's device (one process's values under every layout; a distributed rank builds it on
    the meta device and materializes only its part, ``materialize.rank_model``); ``wrapped`` in
    DDP/FSDP2 when data parallel (the model itself in a pipeline); ``forward``, what a
    micro-batch's loss runs through (``wrapped``, compiled with ``run.compile``); ``pipe``, this
    rank's stages of the pipeline, or None. A ``folder``'s model (``train --from``) is read
    whole by every rank, with the folder's weights (FSDP2 then keeps each rank's shards)."""
    r, device, plan = cfg.run, place.info.device, place.plan
    if folder is not None:
        torch.manual_seed(r.seed)  # what the folder's model draws (a router's jitter, dropout) follows the seed
        model = folder.build(torch.device("cpu") if plan.wrapping == "fsdp" else device)
        wrapped = dist.wrap(model, plan.wrapping, folder.fsdp_units(model) if plan.wrapping == "fsdp" else None)
        return model, wrapped, torch.compile(wrapped) if r.compile else wrapped, None
    # FSDP2 moves each module it shards to the device and keeps the shard: the part waits on the host
    if plan.pipelined:
        part = plan.part(plan.pipeline_rank(place.info.rank))
        model = rank_model(cfg.model, r.seed, part, "cpu" if plan.shards_stages else device)
        pipe = build_pipeline(model, plan, place.groups, device)
        return model, model, model, pipe
    if place.info.distributed:
        model = rank_model(cfg.model, r.seed, plan.part(0), "cpu" if plan.wrapping == "fsdp" else device)
    else:
        torch.manual_seed(r.seed)
        model = Transformer(cfg.model).to(device)
    wrapped = dist.wrap(model, plan.wrapping)
    return model, wrapped, torch.compile(wrapped) if r.compile else wrapped, None


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
