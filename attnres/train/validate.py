"""Every check of a run's settings, in one place and on plain values: a ``TrainConfig`` (its
fields read as numbers and strings) and the number of processes the job runs.

``check_run(cfg, processes)`` raises ``ValueError`` naming the field, its value and what it
accepts, before anything is written, allocated or started, and before any process waits on
another. In order:

1. each field's type and range (``FIELDS``);
2. the fields that must agree: the batch and the gradient accumulation, the sequence length and
   the model's context, the device;
3. the pipeline's options (``run.pp_*``): only with ``run.pp_size > 1``, then agreeing with the
   schedule, the sublayers, the batch and the model (``check_pipeline``, ``check_cache``);
4. the residual options, checked by the stream itself on the meta device;
5. with ``processes`` given, the placement: a pipeline dividing the job, the batch dividing over
   the data-parallel ranks and the gradient accumulation.

The pipeline's schedules are named here as plain data (``SCHEDULES``, ``MULTI_STAGE``,
``V_SHAPED``; ``tests/test_validate.py`` checks them against ``train/pipeline.py``'s), so this
module imports neither ``torch.distributed`` machinery nor the pipeline's modules: those import
their checks from here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..streams import build_stream

if TYPE_CHECKING:
    from .config import TrainConfig

#: the pipeline schedules (``torch.distributed.pipelining``'s, named in ``train/pipeline.py``)
SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "zbv", "dualpipev")
#: schedules that run several stages on every rank, and those of them that place two in a V
MULTI_STAGE = ("interleaved1f1b", "loopedbfs", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")
#: schedules whose steady state runs one micro-batch per stage: at least as many as stages
NEEDS_A_MICROBATCH_PER_STAGE = ("1f1b", "dualpipev")
#: the designs whose sources, once completed, never change: what the cross-stage cache can hold
CACHED_RESIDUALS = ("full", "block", "delta", "denseformer")


# -- 1. each field ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Range:
    """The numbers a field accepts: from ``low`` to ``high`` (None: unbounded), each end closed
    unless marked open; whole numbers only for ``integer``; None too for ``none``."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    none: bool = False

    def accepts(self, value) -> bool:
        if value is None:
            return self.none
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (self.integer and not isinstance(value, int)):
            return False
        if not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or (value < self.high or (not self.high_open and value == self.high))

    def __str__(self) -> str:
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        text = f"{'(' if self.low_open or self.low is None else '['}{low}, {high}{')' if self.high_open or self.high is None else ']'}"
        text = ("an integer in " if self.integer else "in ") + text
        return text + (" or None" if self.none else "")


@dataclass(frozen=True)
class Choice:
    """The values a field accepts: one of ``options``."""

    options: tuple

    def accepts(self, value) -> bool:
        return value in self.options

    def __str__(self) -> str:
        return f"one of {self.options}"


def _count(low=1, **kw) -> Range:
    return Range(low, integer=True, **kw)


#: what each field accepts, checked by ``check_run`` before any work (the model's sizes and
#: residual options are checked by ``ModelConfig`` and the streams); docs/RELIABILITY.md lists them
FIELDS: dict[str, Range | Choice] = {
    "model.ffn_dim": _count(),
    "model.rope_theta": Range(0, low_open=True),
    "model.norm_eps": Range(0, low_open=True),
    "model.init_std": Range(0, low_open=True),
    "data.tokenizer": Choice(("byte", "bpe")),
    "data.bpe_vocab_size": _count(257),  # the 256 bytes and at least one merge
    "data.val_fraction": Range(0, 1, low_open=True, high_open=True),
    "data.max_train_tokens": _count(none=True),
    "data.max_val_tokens": _count(none=True),
    "optim.lr": Range(0, low_open=True),
    "optim.weight_decay": Range(0),
    "optim.beta1": Range(0, 1, high_open=True),
    "optim.beta2": Range(0, 1, high_open=True),
    "optim.warmup_steps": _count(0),
    "optim.schedule": Choice(("cosine", "wsd", "constant")),
    "optim.min_lr_ratio": Range(0, 1),
    "optim.decay_fraction": Range(0, 1),
    "optim.grad_clip": Range(0, low_open=True),
    "run.steps": _count(),
    "run.batch_size": _count(),
    "run.seq_len": _count(),
    "run.grad_accum": _count(),
    "run.seed": _count(0),
    "run.eval_every": _count(),
    "run.eval_batches": _count(),
    "run.log_every": _count(),
    "run.ckpt_every": _count(0),
    "run.autocast": Choice(("auto", "none")),
    "run.parallel": Choice(("ddp", "fsdp")),
    "run.pp_size": _count(),
    "run.pp_schedule": Choice(SCHEDULES),
    "run.pp_microbatches": _count(none=True),
    "run.pp_stages_per_rank": _count(none=True),
    "run.pp_cache": Choice(("auto", "on", "off")),
}


def check_fields(cfg: TrainConfig) -> None:
    """Every field of ``FIELDS`` within what it accepts."""
    for key, accepted in FIELDS.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if not accepted.accepts(value):
            raise ValueError(f"{key}={value!r} must be {accepted}")


# -- 2. the fields that must agree -----------------------------------------------------------

def check_agreement(cfg: TrainConfig) -> None:
    """The batch splits into the micro-steps, a sequence fits the model's context, the device
    is one torch knows."""
    r, m = cfg.run, cfg.model
    if r.batch_size % r.grad_accum:
        raise ValueError(f"run.batch_size={r.batch_size} must be divisible by run.grad_accum={r.grad_accum}")
    if r.seq_len > m.max_seq_len:
        raise ValueError(f"run.seq_len={r.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if r.device != "auto":
        try:
            torch.device(r.device)
        except RuntimeError:
            raise ValueError(f"run.device={r.device!r} must be 'auto' or a torch device such as 'cpu' or 'cuda:0'") from None


# -- 3. the pipeline -------------------------------------------------------------------------

def stages_per_rank(schedule: str, given: int | None = None) -> int:
    """Stages on each rank under ``schedule``: ``given``, or 1 for ``gpipe``/``1f1b`` and 2 for
    the others; refused where the schedule cannot run it."""
    if schedule not in SCHEDULES:
        raise ValueError(f"pipeline schedule {schedule!r} is not one of {SCHEDULES}")
    v = given if given is not None else (2 if schedule in MULTI_STAGE else 1)
    if schedule in V_SHAPED and v != 2:
        raise ValueError(f"schedule {schedule!r} runs exactly 2 stages per rank, given {v}")
    if schedule in MULTI_STAGE and (type(v) is not int or v < 2):
        raise ValueError(f"schedule {schedule!r} runs 2 or more stages per rank, given {v!r}")
    if schedule not in MULTI_STAGE and v != 1:
        raise ValueError(f"schedule {schedule!r} runs one stage per rank, given {v!r}; the looped schedules "
                         f"(interleaved1f1b, loopedbfs) run several")
    return v


def stage_sizes(num_sublayers: int, stages: int, split=None) -> list[int]:
    """The sublayers in each of ``stages`` stages: ``split``, checked to cover the sublayers, or
    as even as they go, the earlier stages taking one more where they do not divide."""
    if type(stages) is not int or not 1 <= stages <= num_sublayers:
        raise ValueError(f"{stages!r} stages for {num_sublayers} sublayers: a stage needs at least one sublayer")
    if split is None:
        base, extra = divmod(num_sublayers, stages)
        split = [base + (k < extra) for k in range(stages)]
    split = list(split)
    if len(split) != stages or any(type(n) is not int or n < 1 for n in split) or sum(split) != num_sublayers:
        raise ValueError(f"split={split} must be {stages} positive sublayer counts summing to {num_sublayers}")
    return split


def check_pipeline(schedule: str, ranks: int, num_sublayers: int, batch: int | None, microbatches: int | None = None,
                   per_rank: int | None = None, split=None) -> tuple[int, int]:
    """``(stages, microbatches)`` of a pipeline over ``ranks`` ranks, every option checked
    (before any process waits on another): ``microbatches`` (default: the number of stages)
    dividing ``batch`` (when given), at least the number of stages where the schedule needs it,
    and the split covering the sublayers."""
    stages = ranks * stages_per_rank(schedule, per_rank)
    stage_sizes(num_sublayers, stages, split)
    mb = stages if microbatches is None else microbatches
    if type(mb) is not int or mb < 1 or (batch is not None and batch % mb):
        raise ValueError(f"{mb!r} micro-batches must be a positive integer dividing the batch of {batch}")
    if schedule in NEEDS_A_MICROBATCH_PER_STAGE and mb < stages:
        raise ValueError(f"schedule {schedule!r} needs at least as many micro-batches as stages ({stages}), given {mb}")
    return stages, mb


def check_cache(setting: str, residual: str, per_rank: int) -> None:
    """``run.pp_cache``: ``auto``, ``on`` or ``off``; ``on`` only for a design with completed
    sources (``CACHED_RESIDUALS``) and a placement of several stages per rank (``per_rank``)."""
    if setting not in ("auto", "on", "off"):
        raise ValueError(f"run.pp_cache={setting!r} must be one of ('auto', 'on', 'off')")
    if setting == "on" and residual not in CACHED_RESIDUALS:
        raise ValueError(f"run.pp_cache='on' keeps the completed sources of the designs that store them {CACHED_RESIDUALS}; "
                         f"model.residual={residual!r} sends one state that changes at every sublayer")
    if setting == "on" and per_rank < 2:
        raise ValueError(f"run.pp_cache='on' keeps what a rank saw at its earlier stages; with {per_rank} "
                         f"stage per rank there are none (the looped and V schedules run several)")


def _pipeline_options_unset(cfg: TrainConfig) -> None:
    """Without a pipeline, no ``run.pp_*`` option but ``pp_size`` and ``pp_schedule`` is set."""
    r = cfg.run
    given = [f"run.{name}={value!r}" for name, value, default in (
        ("pp_split", r.pp_split, None), ("pp_microbatches", r.pp_microbatches, None),
        ("pp_stages_per_rank", r.pp_stages_per_rank, None), ("pp_cache", r.pp_cache, "auto"))
        if value != default]
    if given:
        raise ValueError(f"{', '.join(given)}: run.pp_split, run.pp_microbatches, run.pp_stages_per_rank and "
                         f"run.pp_cache apply to a pipelined run: set run.pp_size > 1")


def _pipeline_layout(cfg: TrainConfig, batch: int, note: str = "") -> None:
    """The schedule's stages, split and micro-batches for a pipeline fed ``batch`` rows, and the
    cache, each refusal prefixed with the pipeline's size and schedule (and ``note``)."""
    r, m = cfg.run, cfg.model
    try:
        check_pipeline(r.pp_schedule, r.pp_size, m.num_sublayers, batch, r.pp_microbatches, r.pp_stages_per_rank,
                       r.pp_split)
        check_cache(r.pp_cache, m.residual, stages_per_rank(r.pp_schedule, r.pp_stages_per_rank))
    except ValueError as err:
        raise ValueError(f"run.pp_size={r.pp_size}, run.pp_schedule={r.pp_schedule!r}: {err}{note}") from None


def check_pipeline_settings(cfg: TrainConfig) -> None:
    """With ``run.pp_size > 1``: no gradient accumulation or compilation, and a layout the
    schedule can run on the whole batch; without: no other ``run.pp_*`` option."""
    r = cfg.run
    if r.pp_size == 1:
        _pipeline_options_unset(cfg)
        return
    for name, clash in (("grad_accum", r.grad_accum != 1), ("compile", r.compile)):
        if clash:
            raise ValueError(f"run.pp_size={r.pp_size}: a pipelined run takes its micro-batches from "
                             f"run.pp_microbatches and runs eagerly; {name} is not supported with it")
    _pipeline_layout(cfg, r.batch_size)


# -- 4. the residual options -----------------------------------------------------------------

def check_residual(cfg: TrainConfig) -> None:
    """The residual options, checked by the stream that takes them, built on no memory."""
    m = cfg.model
    with torch.device("meta"):
        build_stream(m.residual, dim=m.dim, num_sublayers=m.num_sublayers, eps=m.stream_eps, **m.stream_options())


# -- 5. the placement over the job's processes -----------------------------------------------

def check_processes(cfg: TrainConfig, processes: int) -> None:
    """The run on ``processes`` processes (torchrun's world size, 1 without it): a pipeline's
    ranks dividing them, each copy of the pipeline taking an equal part of the batch that its
    micro-batches divide; without one, the batch dividing over the ranks
    and the micro-steps."""
    r = cfg.run
    if r.pp_size == 1:
        if r.batch_size % (processes * r.grad_accum):
            raise ValueError(f"run.batch_size={r.batch_size} must be divisible by world size {processes} x "
                             f"run.grad_accum={r.grad_accum}")
        return
    if processes % r.pp_size:
        raise ValueError(f"run.pp_size={r.pp_size} must divide the job's {processes} processes (torchrun "
                         f"--nproc_per_node=N, N a multiple of {r.pp_size}: the pipelines run side by side)")
    copies = processes // r.pp_size
    if r.batch_size % copies:
        raise ValueError(f"run.batch_size={r.batch_size} must be divisible by the {copies} copies of the pipeline")
    if copies > 1:  # each copy splits its part of the batch into the micro-batches
        _pipeline_layout(cfg, r.batch_size // copies, f" (each of the {copies} copies of the pipeline takes "
                                                      f"{r.batch_size // copies} of run.batch_size={r.batch_size})")


def check_run(cfg: TrainConfig, processes: int | None = None) -> None:
    """Every check of ``cfg`` (and, given ``processes``, of its placement on them), in the order
    of the module's docstring; the first that fails raises ``ValueError``."""
    check_fields(cfg)
    check_agreement(cfg)
    check_pipeline_settings(cfg)
    check_residual(cfg)
    if processes is not None:
        if type(processes) is not int or processes < 1:
            raise ValueError(f"processes={processes!r} must be a positive integer (the job's world size)")
        check_processes(cfg, processes)
