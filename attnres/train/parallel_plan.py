"""The parallel layout of a run, decided once: ``ParallelPlan``, built and checked by
``plan_parallel`` from the settings and the number of processes, and read by everything that
builds, shards, materializes, checkpoints or reports a distributed run.

A job of ``processes`` ranks is a 2-D device mesh ``(dp, pp)``: ``pp_size`` pipeline ranks times
``dp_size = processes / pp_size`` copies of the pipeline, rank ``r`` being pipeline rank
``r % pp_size`` of copy ``r // pp_size``. Without a pipeline (``pp_size == 1``) every rank holds
the whole model as one stage, and the copies share their gradients by DDP or FSDP2
(``run.parallel``). In a pipeline, the model is cut at sublayer boundaries into stages:

- the stages' sublayers: ``run.pp_split`` (sublayers per stage) or as even as they go, the
  earlier stages taking one more where they do not divide;
- their placement: one stage per rank for ``gpipe`` and ``1f1b``; ``v >= 2`` for the looped
  schedules (``interleaved1f1b``, ``loopedbfs``), rank ``r`` holding stages ``r, r + P, ...``;
  exactly two for the V schedules (``zbv``, ``dualpipev``), rank ``r`` holding ``r`` and
  ``2P - 1 - r``;
- the micro-batches per step (default: one per stage), dividing each copy's part of the batch;
- the cross-stage cache of completed sources (``stage_cache``): ``auto`` turns it on for the
  designs whose completed sources never change, with several stages per rank;
- the parameters several pipeline ranks hold (the stream's, a tied embedding held by two ranks;
  ``stage_local.shared_names``), whose gradients are summed over the pipeline;
- the wrapping: in a pipeline with ``run.parallel=fsdp`` and several copies, FSDP2 shards each
  held sublayer, the embedding and the head over the copies; with ``ddp``, every gradient is
  averaged over them.

The layout helpers below (``_stages_per_rank``, ``_stage_sizes``, ``_stage_bounds``,
``_stage_ranks``) are called by ``plan_parallel`` alone (``tests/test_parallel_plan.py`` checks
it): nothing else re-derives a layout from the schedule's name.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..model import ModelConfig
from .config import TrainConfig
from .stage_local import Part, shared_names

#: the pipeline schedules (``torch.distributed.pipelining``'s, their classes named in ``train/pipeline.py``)
SCHEDULES = ("gpipe", "1f1b", "interleaved1f1b", "loopedbfs", "zbv", "dualpipev")
#: schedules that run several stages on every rank, and those of them that place two in a V
MULTI_STAGE = ("interleaved1f1b", "loopedbfs", "zbv", "dualpipev")
V_SHAPED = ("zbv", "dualpipev")
#: schedules whose steady state runs one micro-batch per stage: at least as many as stages
NEEDS_A_MICROBATCH_PER_STAGE = ("1f1b", "dualpipev")
#: the designs whose sources, once completed, never change: what the cross-stage cache can hold
CACHED_RESIDUALS = ("full", "block", "delta", "denseformer")
#: how the copies of the model share their gradients
PARALLEL_MODES = ("ddp", "fsdp")
CACHE_SETTINGS = ("auto", "on", "off")
#: the names of the device mesh's dimensions, copies then pipeline ranks
MESH_DIMS = ("dp", "pp")


@dataclass(frozen=True)
class Stage:
    """Pipeline stage ``index``: sublayers ``first .. last - 1``, held by pipeline rank ``rank``."""

    index: int
    first: int
    last: int
    rank: int


@dataclass(frozen=True)
class ParallelPlan:
    """Which rank holds what, and how the ranks share their work (see the module's docstring).

    ``stages`` lists every stage in order (one stage of every sublayer without a pipeline);
    ``microbatches`` is the pipeline's per step (1 without one: gradient accumulation is
    ``run.grad_accum``'s); ``cache``, whether the cross-stage cache is on; ``shared``, the
    parameters several pipeline ranks hold, the same tuple on every rank."""

    processes: int
    pp_size: int
    parallel: str
    schedule: str | None
    stages: tuple[Stage, ...]
    microbatches: int
    cache: bool
    shared: tuple[str, ...]
    num_sublayers: int

    @property
    def pipelined(self) -> bool:
        return self.pp_size > 1

    @property
    def dp_size(self) -> int:
        """The copies of the model (of the pipeline), each fed its own part of the batch."""
        return self.processes // self.pp_size

    @property
    def mesh_shape(self) -> tuple[int, int]:
        """The device mesh's shape, ``(dp_size, pp_size)`` over ``MESH_DIMS``."""
        return self.dp_size, self.pp_size

    @property
    def stages_per_rank(self) -> int:
        return len(self.stages) // self.pp_size

    @property
    def owners(self) -> tuple[int, ...]:
        """The pipeline rank of each stage, in stage order."""
        return tuple(stage.rank for stage in self.stages)

    @property
    def shards_stages(self) -> bool:
        """Whether FSDP2 shards a pipeline rank's modules over the copies (else the copies
        average their gradients); without a pipeline ``run.parallel`` wraps the whole model."""
        return self.pipelined and self.parallel == "fsdp" and self.dp_size > 1

    @property
    def model_shards(self) -> int:
        """Into how many parts the job splits the model's parameters (and their gradients and
        optimizer state): every process under FSDP2 (beside a pipeline too: ``pp_size`` times
        its copies), else the pipeline's ranks."""
        return self.processes if self.parallel == "fsdp" else self.pp_size

    @property
    def wrapping(self) -> str:
        """What wraps each rank's model: ``none`` (one process), ``ddp`` or ``fsdp`` (copies of
        the whole model), ``pipeline`` (one pipeline), ``pipeline+ddp`` or ``pipeline+fsdp``."""
        if not self.pipelined:
            return "none" if self.processes == 1 else self.parallel
        return "pipeline" if self.dp_size == 1 else f"pipeline+{self.parallel}"

    def pipeline_rank(self, rank: int) -> int:
        """The pipeline rank of global rank ``rank`` (rank ``r % pp_size`` of copy ``r // pp_size``)."""
        return rank % self.pp_size

    def copy_index(self, rank: int) -> int:
        """The copy (data-parallel index) of global rank ``rank``."""
        return rank // self.pp_size

    def stages_of(self, pp_rank: int) -> tuple[Stage, ...]:
        """The stages pipeline rank ``pp_rank`` holds, in ascending order."""
        return tuple(stage for stage in self.stages if stage.rank == pp_rank)

    def part(self, pp_rank: int) -> Part:
        """What pipeline rank ``pp_rank`` holds of the model (``stage_local.Part``)."""
        return Part.of_stages([(s.first, s.last) for s in self.stages_of(pp_rank)], self.num_sublayers)

    def describe(self) -> dict:
        """The plan as plain data (for ``summary.json`` and reports)."""
        return dict(processes=self.processes, mesh=dict(zip(MESH_DIMS, self.mesh_shape)), wrapping=self.wrapping,
                    schedule=self.schedule, microbatches=self.microbatches, cache=self.cache,
                    stages=[dict(index=s.index, sublayers=[s.first, s.last], rank=s.rank) for s in self.stages])


# -- the layout helpers, called by plan_parallel alone ---------------------------------------

def _stages_per_rank(schedule: str, given: int | None) -> int:
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


def _stage_sizes(num_sublayers: int, stages: int, split) -> list[int]:
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


def _stage_bounds(sizes: list[int]) -> list[tuple[int, int]]:
    """``[(first, last), ...]`` of consecutive stages of ``sizes`` sublayers."""
    ends = [sum(sizes[: k + 1]) for k in range(len(sizes))]
    return list(zip([0, *ends[:-1]], ends))


def _stage_ranks(schedule: str, ranks: int, per_rank: int) -> list[int]:
    """The pipeline rank of each of the ``ranks * per_rank`` stages under ``schedule``."""
    if schedule in V_SHAPED:  # rank r holds r and 2P - 1 - r
        return [s if s < ranks else 2 * ranks - 1 - s for s in range(2 * ranks)]
    return [s % ranks for s in range(ranks * per_rank)]  # looped: r, r + P, ...


def _check_cache(setting: str, residual: str, per_rank: int) -> bool:
    """Whether the cross-stage cache is on: ``on``, ``off``, or ``auto`` (the designs of
    ``CACHED_RESIDUALS`` with more than one stage per rank); ``on`` refused where it cannot
    serve."""
    if setting not in CACHE_SETTINGS:
        raise ValueError(f"run.pp_cache={setting!r} must be one of {CACHE_SETTINGS}")
    if setting == "on" and residual not in CACHED_RESIDUALS:
        raise ValueError(f"run.pp_cache='on' keeps the completed sources of the designs that store them {CACHED_RESIDUALS}; "
                         f"model.residual={residual!r} sends one state that changes at every sublayer")
    if setting == "on" and per_rank < 2:
        raise ValueError(f"run.pp_cache='on' keeps what a rank saw at its earlier stages; with {per_rank} "
                         f"stage per rank there are none (the looped and V schedules run several)")
    if setting == "auto":
        return residual in CACHED_RESIDUALS and per_rank > 1
    return setting == "on"


def plan_parallel(config: ModelConfig | None, processes: int = 1, *, pp_size: int = 1, schedule: str = "1f1b",
                  stages_per_rank: int | None = None, split=None, microbatches: int | None = None,
                  cache: str = "auto", parallel: str = "ddp", batch: int | None = None) -> ParallelPlan:
    """The plan of a job of ``processes`` ranks for a model of ``config`` (None: a model read
    from a folder, ``train --from``, whose one stage the plan does not count in sublayers), every option checked
    before any process waits on another (``ValueError`` naming the option, its value and what
    it accepts): ``pp_size`` ranks per pipeline dividing the processes; ``schedule``,
    ``stages_per_rank``, ``split`` (sublayers per stage), ``microbatches`` (per step, default one
    per stage) and ``cache`` (``auto``, ``on``, ``off``) for a pipeline; ``parallel`` (``ddp`` or
    ``fsdp``) for the copies; ``batch`` (the global batch, when known) dividing over the copies
    and each copy's part over the micro-batches."""
    if type(processes) is not int or processes < 1:
        raise ValueError(f"processes={processes!r} must be a positive integer (the job's world size)")
    if parallel not in PARALLEL_MODES:
        raise ValueError(f"run.parallel={parallel!r} is not one of {PARALLEL_MODES}")
    if config is None and pp_size != 1:  # a folder's model (train --from): its layers are not cut
        raise ValueError(f"run.pp_size={pp_size}: a model read from a folder is not pipelined")
    n = 0 if config is None else config.num_sublayers
    if pp_size == 1:
        whole = (Stage(0, 0, n, 0),)
        return ParallelPlan(processes, 1, parallel, None, whole, 1, False, (), n)
    if type(pp_size) is not int or pp_size < 1:
        raise ValueError(f"run.pp_size={pp_size!r} must be a positive integer")
    if processes % pp_size:
        raise ValueError(f"run.pp_size={pp_size} must divide the job's {processes} processes (torchrun "
                         f"--nproc_per_node=N, N a multiple of {pp_size}: the pipelines run side by side)")
    copies = processes // pp_size
    if batch is not None and batch % copies:
        raise ValueError(f"run.batch_size={batch} must be divisible by the {copies} copies of the pipeline")
    rows = None if batch is None else batch // copies
    try:
        per_rank = _stages_per_rank(schedule, stages_per_rank)
        n_stages = pp_size * per_rank
        bounds = _stage_bounds(_stage_sizes(n, n_stages, split))
        owners = _stage_ranks(schedule, pp_size, per_rank)
        mb = n_stages if microbatches is None else microbatches
        if type(mb) is not int or mb < 1 or (rows is not None and rows % mb):
            raise ValueError(f"{mb!r} micro-batches must be a positive integer dividing the batch of {rows}")
        if schedule in NEEDS_A_MICROBATCH_PER_STAGE and mb < n_stages:
            raise ValueError(f"schedule {schedule!r} needs at least as many micro-batches as stages ({n_stages}), "
                             f"given {mb}")
        caching = _check_cache(cache, config.residual, per_rank)
    except ValueError as err:  # each refusal names the pipeline it was asked of
        note = (f" (each of the {copies} copies of the pipeline takes {rows} of run.batch_size={batch})"
                if copies > 1 and batch is not None else "")
        raise ValueError(f"run.pp_size={pp_size}, run.pp_schedule={schedule!r}: {err}{note}") from None
    stages = tuple(Stage(s, first, last, owners[s]) for s, (first, last) in enumerate(bounds))
    parts = [Part.of_stages([(s.first, s.last) for s in stages if s.rank == r], n) for r in range(pp_size)]
    return ParallelPlan(processes, pp_size, parallel, schedule, stages, mb, caching,
                        tuple(shared_names(config, parts)), n)


def run_plan(cfg: TrainConfig, processes: int | None = None) -> ParallelPlan:
    """``plan_parallel`` with a run's settings (``run.pp_*``, ``run.parallel``, the global batch)
    on ``processes`` processes (default: as many as one pipeline needs)."""
    r = cfg.run
    return plan_parallel(cfg.model, r.pp_size if processes is None else processes, pp_size=r.pp_size,
                         schedule=r.pp_schedule, stages_per_rank=r.pp_stages_per_rank, split=r.pp_split,
                         microbatches=r.pp_microbatches, cache=r.pp_cache, parallel=r.parallel, batch=r.batch_size)
