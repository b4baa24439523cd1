"""Pipeline parallelism for the reference LM on ``torch.distributed.pipelining``: the model cut at
sublayer boundaries into stages (``pipeline_stages.StageModule``), as the run's
``ParallelPlan`` places them, the stream state sent between them as tensors.

Each rank holds, initializes and optimizes only what its stages run (``plan.part``: its
sublayers, the embedding with the first stage, the head with the last, and the stream); the
builder removes the rest from the model it is given (``stage_local.trim``). After the schedule's
backward each gradient is divided by the number of micro-batches; the parameters several ranks
hold (``plan.shared``: the stream's per-site rows, Delta's null source, a tied embedding) have
their gradients summed over the pipeline, and no other gradient crosses it. Beside the
pipeline, data parallelism runs copies of it on the plan's 2-D device mesh ``(dp, pp)``, each on
its part of the batch: ``run.parallel=ddp`` averages every gradient over the copies; ``fsdp``
shards each held sublayer, the embedding and the head over the ``dp`` ranks with FSDP2 (their
gradients reduce-scattered as FSDP2 does) and averages the stream's.

The layout (which stage holds which sublayers, which rank holds which stages, the
micro-batches, the cache) is the plan's, checked where it is built (``parallel_plan``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from ..model import Transformer, lm_loss
from ..moe import expert_load
from .parallel_plan import MESH_DIMS, MULTI_STAGE, V_SHAPED, ParallelPlan
from .pipeline_stages import stage_modules
from .stage_cache import SourceCache
from .stage_local import shared_parameter, trim

#: each schedule's class in ``torch.distributed.pipelining`` (imported when a pipeline is built),
#: for each of ``parallel_plan.SCHEDULES``
SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved1f1b": "ScheduleInterleaved1F1B",
                    "loopedbfs": "ScheduleLoopedBFS", "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}


@dataclass
class Groups:
    """This rank's place on the ``(dp, pp)`` device mesh: ``pipeline``, the group of its
    pipeline's ranks; ``replicas``, the ranks holding the same stages in the other copies (None
    with one copy); ``dp_mesh``, the 1-D mesh of those (what FSDP2 shards over); the copy's index
    and the number of copies."""

    pipeline: dist.ProcessGroup
    replicas: dist.ProcessGroup | None
    dp_mesh: object
    replica_index: int
    replica_count: int


def pipeline_groups(plan: ParallelPlan, device_type: str) -> Groups:
    """This rank's groups on the plan's device mesh ``(dp, pp)`` (``plan.mesh_shape``): rank
    ``r`` is pipeline rank ``r % pp_size`` of copy ``r // pp_size``."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, plan.mesh_shape, mesh_dim_names=MESH_DIMS)
    replicas = mesh["dp"].get_group() if plan.dp_size > 1 else None
    return Groups(mesh["pp"].get_group(), replicas, mesh["dp"], mesh.get_local_rank("dp"), plan.dp_size)


@dataclass
class Pipeline:
    """One rank's part of a pipelined model: its stages and the schedule that runs them, as
    ``plan`` lays them out."""

    model: Transformer
    plan: ParallelPlan
    schedule: object
    stages: list
    group: dist.ProcessGroup | None
    #: the replicas of this pipeline (data parallelism beside it), or None
    replicas: dist.ProcessGroup | None = None
    #: this rank's cross-stage cache of completed sources, or None
    cache: SourceCache | None = None
    #: the entries the cache still held when the last step's schedule ended (0: each
    #: micro-batch's were freed by its rank's last stage)
    held_after_step: int = 0
    #: the names of the parameters FSDP2 shards over ``replicas`` (reduced by it), or empty
    sharded: frozenset[str] = frozenset()
    #: a mixture-of-experts model's routing in the last step's forwards (``StageModule.expert_log``)
    expert_log: list = field(default_factory=list)
    #: the shared parameters whose squares this rank counts in the norm (``_counted_shared``)
    counted: set[str] | None = None

    @property
    def microbatches(self) -> int:
        return self.plan.microbatches

    @property
    def owners(self) -> tuple[int, ...]:
        """The pipeline rank of each stage."""
        return self.plan.owners

    @property
    def shared(self) -> tuple[str, ...]:
        """The parameters several pipeline ranks hold (``plan.shared``), on every rank."""
        return self.plan.shared

    @property
    def has_first(self) -> bool:
        return any(s.is_first for s in self.stages)

    @property
    def has_last(self) -> bool:
        return any(s.is_last for s in self.stages)

    @property
    def stage_indices(self) -> list[int]:
        return [s.stage_index for s in self.stages]

    def _kwargs(self, y: torch.Tensor, losses: list) -> dict:
        kwargs = dict(target=y, losses=losses) if self.has_last else {}
        if self.cache is not None:  # every stage learns which micro-batch it runs (on the host: no sync)
            kwargs["microbatch"] = torch.arange(self.microbatches)
            self.cache.clear()
        return kwargs

    def step(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one optimizer step's batch ``x, y`` ``[B, T]`` (the same on
        every rank of the pipeline; each replica its own) in ``microbatches`` micro-batches;
        returns the mean loss (a detached scalar, on every rank). Afterwards every parameter
        this rank holds has as gradient the mean over the micro-batches (and the replicas) of
        one process's, as ``accumulate_gradients`` over all of those micro-batches gives."""
        losses: list[torch.Tensor] = []
        args = (x,) if self.has_first else ()
        kwargs = self._kwargs(y, losses)
        self.expert_log.clear()
        if self.has_last:
            kwargs["return_outputs"] = False
        self.schedule.step(*args, **kwargs)
        if self.cache is not None:
            self.held_after_step = len(self.cache)
            self.cache.check_delivered()
            self.cache.clear()
        self._reduce_gradients()
        return self._mean_loss(losses, x.device)

    @torch.no_grad()
    def evaluate(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The loss of ``x, y`` ``[B, T]`` through the pipeline, forward only, the batch as one
        micro-batch: every rank walks the stages in order, running its own and passing each
        result to the next stage's rank. Returns the loss on every rank of the pipeline (this
        copy's; the caller averages the copies)."""
        me = dist.get_rank(self.group)
        modules = {s.stage_index: s.submod for s in self.stages}
        kwargs = {"microbatch": torch.zeros(1, dtype=torch.long)} if self.cache is not None else {}
        loss = torch.zeros((), device=x.device)
        held = None
        for s, rank in enumerate(self.owners):
            if rank != me:
                continue
            if s == 0:
                inputs = (x,)
            elif self.owners[s - 1] == me:
                inputs = held
            else:
                inputs = _receive(self.group, self.owners[s - 1], x.device)
            out = modules[s](*inputs, **kwargs)
            if s == len(self.owners) - 1:
                loss = lm_loss(out, y)
            elif self.owners[s + 1] == me:
                held = out
            else:
                _send(out, self.group, self.owners[s + 1])
        if self.cache is not None:
            self.cache.clear()
        dist.all_reduce(loss, group=self.group)  # from the rank that holds the last stage
        return loss

    def _mean_loss(self, losses: list, device) -> torch.Tensor:
        loss = torch.stack(losses).mean().detach() if losses else torch.zeros((), device=device)
        dist.all_reduce(loss, group=self.group)  # from the rank that holds the last stage
        if self.replicas is not None:
            dist.all_reduce(loss, group=self.replicas)
            loss /= self._replica_count
        return loss

    def _reduce_gradients(self) -> None:
        """Each held gradient divided by the micro-batches; the shared ones summed over the
        pipeline (a rank that does not hold one sends zeros); the others averaged over the
        replicas unless FSDP2 already reduced them."""
        named = dict(self.model.named_parameters())
        for name, p in named.items():
            if p.requires_grad:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.grad.div_(self.microbatches)
        for name in self.shared:
            p = shared_parameter(self.model, name)
            if p is None:
                grad = torch.zeros(_local_shape(self, name), device=self._device)
            else:
                grad = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            dist.all_reduce(grad, group=self.group)
        if self.replicas is None:
            return
        for name, p in named.items():
            if p.requires_grad and name not in self.sharded:
                dist.all_reduce(p.grad, group=self.replicas)
                p.grad.div_(self._replica_count)

    def finish_experts(self, logging: bool) -> dict:
        """For a mixture-of-experts model, after the optimizer step: the step's assignments per
        layer and expert ``[L, E]`` summed over the micro-batches, the pipeline (each rank fills
        its layers' rows) and the replicas; the balance bias moved (``bias``) and, when
        ``logging``, the log's expert fields as ``steps.expert_record`` gives them in one
        process (else ``{}``)."""
        c = self.model.config
        if not (logging or c.moe_balance == "bias"):
            return {}
        counts = torch.zeros(c.n_layers, c.moe_experts, device=self._device)
        # the balance loss summed over the logged layers, the dropped assignments, how many layers
        sums = torch.zeros(3, device=self._device)
        for layers, stats in self._step_routing():
            counts[layers] += stats.load().to(counts.dtype)
            sums[0] += torch.stack(stats.aux).sum().detach() if stats.aux else 0.0
            sums[1] += torch.stack(stats.dropped).sum() if stats.dropped else 0.0
            sums[2] += len(layers)
        for group in (self.group, self.replicas):
            if group is not None:
                dist.all_reduce(counts, group=group)
                dist.all_reduce(sums, group=group)
        self.model.update_expert_bias(counts)
        if not logging:
            return {}
        load = expert_load(counts)
        record = dict(expert_load=[[round(float(f), 6) for f in row] for row in load],
                      expert_imbalance=float((load.max(-1).values * load.shape[-1]).mean()),
                      moe_aux_loss=float(sums[0] / sums[2]))
        if c.moe_capacity:
            record["expert_dropped"] = float(sums[1] / counts.sum())
        return record

    def _step_routing(self) -> list:
        """``(layers, ExpertStats)`` of each micro-batch's forward through each of this rank's
        stages in the last step: the last ``microbatches`` logged per stage (on its first step the
        engine also runs each stage once on placeholder tensors, to learn the shapes it sends)."""
        per_stage: dict[int, list] = {}
        for index, layers, stats in self.expert_log:
            per_stage.setdefault(index, []).append((layers, stats))
        return [entry for entries in per_stage.values() for entry in entries[-self.microbatches:]]

    @property
    def _device(self) -> torch.device:
        return self.stages[0].device

    @property
    def _replica_count(self) -> int:
        return 1 if self.replicas is None else dist.get_world_size(self.replicas)

    @torch.no_grad()
    def clip_gradients(self, max_norm: float) -> float:
        """Scale every gradient so that the whole model's L2 norm is at most ``max_norm``;
        returns the norm before. The squares of each rank's gradients are summed over the
        pipeline, a shared parameter counted once (by the first pipeline rank that holds it),
        FSDP2's shards over the replicas."""
        counted = self._counted_shared()
        shared = {id(shared_parameter(self.model, n)): n for n in self.shared}
        plain = torch.zeros((), dtype=torch.float64, device=self._device)
        sharded = torch.zeros((), dtype=torch.float64, device=self._device)
        params = []
        for name, p in self.model.named_parameters():
            if p.grad is None:
                continue
            params.append(p)
            if id(p) in shared and shared[id(p)] not in counted:
                continue
            if name in self.sharded:
                sharded += p.grad.to_local().double().pow(2).sum()
            else:
                plain += p.grad.double().pow(2).sum()
        if self.replicas is not None and self.sharded:
            dist.all_reduce(sharded, group=self.replicas)
        total = plain + sharded
        dist.all_reduce(total, group=self.group)
        norm = float(total.sqrt())
        scale = max_norm / (norm + 1e-6)
        if scale < 1:
            for p in params:
                p.grad.mul_(scale)
        return norm

    def _counted_shared(self) -> set[str]:
        """The shared parameters whose squares this rank counts: those it holds where no lower
        pipeline rank does (learned from the other ranks once, then kept)."""
        if self.counted is None:
            rank, ranks = dist.get_rank(self.group), dist.get_world_size(self.group)
            held = torch.tensor([float(shared_parameter(self.model, n) is not None) for n in self.shared],
                                device=self._device)  # on the device: NCCL reduces nothing else
            every = [torch.zeros_like(held) for _ in range(ranks)]
            dist.all_gather(every, held, group=self.group)
            self.counted = {n for k, n in enumerate(self.shared)
                            if held[k] and not any(every[r][k] for r in range(rank))}
        return self.counted


def _send(tensors, group, rank: int) -> None:
    """``tensors`` to pipeline rank ``rank``, their shapes and dtypes first."""
    dst = rank if group is None else dist.get_global_rank(group, rank)
    dist.send_object_list([[(tuple(t.shape), t.dtype) for t in tensors]], dst=dst, group=group)
    for t in tensors:
        dist.send(t.contiguous(), dst=dst, group=group)


def _receive(group, rank: int, device) -> tuple[torch.Tensor, ...]:
    """What ``_send`` sent from pipeline rank ``rank``."""
    src = rank if group is None else dist.get_global_rank(group, rank)
    header = [None]
    dist.recv_object_list(header, src=src, group=group)
    tensors = tuple(torch.empty(shape, dtype=dtype, device=device) for shape, dtype in header[0])
    for t in tensors:
        dist.recv(t, src=src, group=group)
    return tensors


def _local_shape(pipe: Pipeline, name: str) -> tuple[int, ...]:
    """The shape of shared parameter ``name``'s gradient on a rank that holds it: a tied
    embedding ``[V, D]``, or its FSDP2 shard of rows (``torch.chunk`` over the replicas)."""
    c = pipe.model.config
    rows = c.vocab_size
    if pipe.sharded:  # FSDP2 shards the holders' embedding and head
        chunk = -(-rows // pipe._replica_count)
        index = dist.get_rank(pipe.replicas)
        rows = max(0, min(chunk, rows - index * chunk))
    return (rows, c.dim)


def shard_stages(model: Transformer, dp_mesh) -> frozenset[str]:
    """FSDP2 over ``dp_mesh`` on each module of this rank's part that runs its own forward (the
    sublayers, the embedding, the head); the stream's parameters, read by the stages piece by
    piece, stay whole. Returns the names of the sharded parameters (DTensors)."""
    from torch.distributed.fsdp import fully_shard

    modules = [m for layer in model.layers for m in (layer.attn, layer.mlp) if m is not None]
    ends = [m for m in (model.tok_embeddings, model.lm_head) if m is not None]
    # a tied embedding held with the head (both ends on this rank) is one parameter of two
    # modules, which FSDP2 cannot shard as two roots: it stays whole, averaged like the stream
    if not (model.config.tie_embeddings and len(ends) == 2):
        modules += ends
    for module in modules:  # each its own root: resharded after its forward, or it stays whole
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=True)
    return frozenset(name for name, p in model.named_parameters() if hasattr(p, "to_local"))


def build_pipeline(model: Transformer, plan: ParallelPlan, groups: Groups | None = None,
                   device: torch.device | None = None) -> Pipeline:
    """This rank's stages of ``model`` as ``plan`` (``parallel_plan.plan_parallel``, a pipelined
    one) lays them out, run by the plan's schedule. ``groups``: this rank's groups on the plan's
    mesh (``pipeline_groups``; default: every rank is one pipeline, without copies); with the plan's
    FSDP2 sharding (``plan.shards_stages``) the rank's modules are sharded over the copies,
    else the copies average their gradients. ``model`` loses the parts the rank does not hold
    (``stage_local.trim``; a model built for the rank, ``materialize.rank_model``, has none of
    them)."""
    from torch.distributed import pipelining as pp

    group, replicas = (groups.pipeline, groups.replicas) if groups is not None else (None, None)
    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    if not plan.pipelined or ranks != plan.pp_size:
        raise ValueError(f"a pipeline of {plan.pp_size} ranks (the plan's run.pp_size) runs on a group of {ranks} "
                         f"ranks: build the plan for this group")
    if plan.dp_size > 1 and groups is None:
        raise ValueError(f"a plan of {plan.dp_size} copies of the pipeline needs this rank's groups on its mesh "
                         f"(pipeline_groups)")
    trim(model, plan.part(rank))
    sharded = shard_stages(model, groups.dp_mesh) if plan.shards_stages else frozenset()
    device = device or next(model.parameters()).device
    model.to(device)  # what FSDP2 did not move (the stream, the RoPE tables); nothing if all is there
    modules = stage_modules(model, plan)
    held = plan.stages_of(rank)
    stages = []
    for stage in held:
        kwargs = {}
        if plan.schedule in V_SHAPED:
            # these schedules split each backward into an input and a weight part; a stage that
            # reads one parameter at several points (the stream's per-site rows) cannot run the
            # weight part alone here, so the whole backward runs in the input part
            kwargs["dw_builder"] = lambda: (lambda: None)
        stages.append(pp.PipelineStage(modules[stage.index], stage.index, len(plan.stages), device, group=group,
                                       **kwargs))
    cls = getattr(pp, SCHEDULE_CLASSES[plan.schedule])
    # the gradients are scaled once, after the step: two local stages share the model's parameters
    run = cls(stages if plan.schedule in MULTI_STAGE else stages[0], n_microbatches=plan.microbatches,
              loss_fn=lm_loss, scale_grads=False)
    pipe = Pipeline(model, plan, run, stages, group, replicas, modules[held[0].index].cache, sharded=sharded)
    for stage in held:
        modules[stage.index].expert_log = pipe.expert_log
    return pipe
