"""Pipeline parallelism for the reference LM on ``torch.distributed.pipelining``: the model cut at
sublayer boundaries into stages, the stream state sent between them as tensors.

A stage runs sublayers ``first .. last - 1``: the first stage embeds the tokens, the last routes
the output and applies the head. Between stages travels ``stream.split_state(state)`` (the
completed sources, then the rest), and the receiving stage rebuilds the state with
``stream.join_state``, preparing the sources again for its own routing.

Each rank holds, initializes and optimizes only what its stages run (``stage_local.Part``: its
sublayers, the embedding with the first stage, the head with the last, and the stream); the
builder removes the rest from the model it is given (``stage_local.trim``). After the schedule's
backward each gradient is divided by the number of micro-batches; the parameters several ranks
hold (the stream's per-site rows, Delta's null source, a tied embedding: ``stage_local
.shared_names``) have their gradients summed over the pipeline, and no other gradient crosses
it. Beside the pipeline, data parallelism runs copies of it on a 2-D device mesh ``(dp, pp)``,
each on its part of the batch: ``run.parallel=ddp`` averages every gradient over the copies;
``fsdp`` shards each held sublayer, the embedding and the head over the ``dp`` ranks with FSDP2
(their gradients reduce-scattered as FSDP2 does) and averages the stream's.

With several stages per rank and the AttnRes family, the cross-stage cache (``stage_cache``)
keeps on each rank the completed sources it has seen, and a hop sends only the others.

Stage placement: one stage per rank for ``gpipe`` and ``1f1b``; ``v >= 2`` for the looped
schedules (``interleaved1f1b``, ``loopedbfs``), rank ``r`` holding stages ``r, r + P, ...``; exactly
two for the V schedules (``zbv``, ``dualpipev``), rank ``r`` holding ``r`` and ``2P - 1 - r``.

The options are checked with the run's other settings, before any process waits on another, in
``validate.py`` (``check_pipeline``, ``stages_per_rank``, ``stage_sizes``); the builder checks
them again for callers that come without a ``TrainConfig``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from ..model import Transformer, lm_loss
from ..moe import ExpertStats, expert_load
from .stage_cache import SourceCache, sources_held, use_cache
from .stage_local import Part, shared_names, shared_parameter, trim
from .validate import MULTI_STAGE, V_SHAPED, check_pipeline, stage_sizes, stages_per_rank

#: each schedule's class in ``torch.distributed.pipelining`` (imported when a pipeline is built);
#: ``validate.SCHEDULES`` names the same, as plain data for the checks
SCHEDULE_CLASSES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved1f1b": "ScheduleInterleaved1F1B",
                    "loopedbfs": "ScheduleLoopedBFS", "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
SCHEDULES = tuple(SCHEDULE_CLASSES)


def stage_bounds(num_sublayers: int, stages: int, split=None) -> list[tuple[int, int]]:
    """``[(first, last), ...]``: the sublayers of each stage, ``split`` (sublayers per stage) or
    as even as they go, the earlier stages taking one more where they do not divide."""
    sizes = stage_sizes(num_sublayers, stages, split)
    ends = [sum(sizes[: k + 1]) for k in range(stages)]
    return list(zip([0, *ends[:-1]], ends))


def stage_indices(schedule: str, rank: int, ranks: int, per_rank: int | None = None) -> list[int]:
    """The stages rank ``rank`` of ``ranks`` holds under ``schedule``, in ascending order."""
    v = stages_per_rank(schedule, per_rank)
    if schedule in V_SHAPED:
        return sorted([rank, 2 * ranks - 1 - rank])
    return [rank + k * ranks for k in range(v)]


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


@torch.no_grad()
def pipeline_groups(pp_size: int) -> Groups:
    """The groups of this rank in a job of ``pp_size`` pipeline ranks times ``world / pp_size``
    copies, on a 2-D device mesh ``(dp, pp)``: rank ``r`` is stage rank ``r % pp_size`` of copy
    ``r // pp_size``."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    device = "cuda" if dist.get_backend() == "nccl" else "cpu"
    mesh = init_device_mesh(device, (world // pp_size, pp_size), mesh_dim_names=("dp", "pp"))
    replicas = mesh["dp"].get_group() if world > pp_size else None
    return Groups(mesh["pp"].get_group(), replicas, mesh["dp"], mesh.get_local_rank("dp"), world // pp_size)


def rank_part(config, schedule: str, rank: int, ranks: int, per_rank: int | None = None, split=None) -> Part:
    """What pipeline rank ``rank`` of ``ranks`` holds under ``schedule`` (``stage_local.Part``)."""
    n_stages = ranks * stages_per_rank(schedule, per_rank)
    bounds = stage_bounds(config.num_sublayers, n_stages, split)
    return Part.of_stages([bounds[s] for s in stage_indices(schedule, rank, ranks, per_rank)], config.num_sublayers)


def boundary_layout(model: Transformer, cut: int) -> int:
    """How many of the tensors that cross the boundary before sublayer ``cut`` are completed
    sources (``split_state``'s first part), found by running the stream on one zero token."""
    stream = model.stream
    like = next(iter(stream.parameters()), torch.zeros(()))
    e = torch.zeros(1, 1, model.config.dim, dtype=like.dtype, device=like.device)
    state = stream.init(e)
    for i in range(cut):
        state = stream.write(state, i, torch.zeros_like(e))
    return len(stream.split_state(state)[0])


class _WithBalanceLoss(torch.autograd.Function):
    """Identity on a stage's output ``x``; its backward also gives ``loss`` (the stage's part of
    the weighted MoE balance loss) the gradient 1, as adding it to the micro-batch's loss
    would: the balance loss of a stage before the last reaches its routers this way."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, loss: torch.Tensor) -> torch.Tensor:
        ctx.like = loss.new_ones(())
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, ctx.like


class StageModule(nn.Module):
    """Sublayers ``first .. last - 1`` of ``model``; its forward takes the tokens ``[B, T]``
    (the first stage) or the tensors the stage before sent, and returns the logits (the last
    stage) or the tensors to send on.

    With a ``cache`` (``stage_cache.SourceCache``, one per rank): the stage reads completed
    sources ``0 .. held - 1`` from the rank's cache instead of receiving them, sends sources from
    ``send_from`` on, registers the sources that enter the rank here when a later stage of the
    rank will read them (``keeps``) and frees the micro-batch's cache after reading it
    (``frees``, the rank's last stage). The forward then takes ``microbatch``, the index of the
    micro-batch (a one-element tensor, which the schedule splits like the batch).

    In a mixture-of-experts model each training forward records its routing in ``expert_log``
    (``(stage, layers, ExpertStats)``: the indices of the stage's MoE layers and what they recorded) and
    attaches the stage's part of the weighted balance loss, ``moe_aux_weight * sum of its layers'
    / n_layers``, to its first output (``_WithBalanceLoss``)."""

    def __init__(self, model: Transformer, first: int, last: int, index: int = 0, cache: SourceCache | None = None,
                 held: int = 0, send_from: int = 0, keeps: bool = False, frees: bool = False,
                 completed: int | None = None):
        super().__init__()
        self.model, self.first, self.last, self.index = model, first, last, index
        self.is_first, self.is_last = first == 0, last == model.config.num_sublayers
        #: the completed sources the state holds before ``first`` (``boundary_layout``)
        self.completed = completed if completed is not None else 0 if self.is_first else boundary_layout(model, first)
        self.cache, self.held, self.send_from, self.keeps, self.frees = cache, held, send_from, keeps, frees
        #: the layers whose MLP this stage runs, and where a training forward logs their routing
        self.moe_layers = [i >> 1 for i in range(first, last) if i % 2 == 1] if model.config.moe_experts else []
        self.expert_log: list | None = None

    def forward(self, *inputs: torch.Tensor, microbatch: torch.Tensor | None = None):
        model, stream, cache = self.model, self.model.stream, self.cache
        if cache is not None and microbatch is None:
            raise ValueError(f"stage {self.index} reads and fills its rank's cache of sources: call it with "
                             f"microbatch=<the micro-batch's index>, as Pipeline.step does")
        mb = int(microbatch) if cache is not None else None
        if self.is_first:
            (tokens,) = inputs
            state = stream.init(model.tok_embeddings(tokens))
        else:
            n = self.completed - self.held
            received = inputs[:n]
            if self.keeps:
                received = cache.own(mb, self.held, received)
            cached = cache.read(mb, self.held, self.index) if self.held else ()
            state = stream.join_state((*cached, *received), inputs[n:], self.first)
        if cache is not None and self.frees:
            cache.drop(mb)
        T = inputs[0].shape[1]
        experts = ExpertStats() if self.moe_layers else None
        state = model.run_sublayers(state, self.first, self.last, model.rope_cos[:T], model.rope_sin[:T],
                                    experts=experts)
        if self.is_last:
            return self._balanced(model.lm_head(stream.output(state)), experts)
        completed, rest = stream.split_state(state)
        if self.keeps:  # the sources completed here, in place (the earlier ones are registered)
            completed = (*completed[:self.completed], *cache.own(mb, self.completed, completed[self.completed:]))
        out = (*completed[self.send_from:], *rest)
        return (self._balanced(out[0], experts), *out[1:])

    def _balanced(self, x: torch.Tensor, experts: ExpertStats | None) -> torch.Tensor:
        """``x``, carrying the stage's part of the balance loss in a training forward (its
        routing logged); ``x`` itself otherwise."""
        if experts is None or not torch.is_grad_enabled() or x.is_meta:  # the engine's shape inference: no step
            return x
        if self.expert_log is not None:
            self.expert_log.append((self.index, self.moe_layers, experts))
        c = self.model.config
        if c.moe_balance != "aux" or not experts.aux:
            return x
        return _WithBalanceLoss.apply(x, c.moe_aux_weight * torch.stack(experts.aux).sum() / c.n_layers)


def stage_modules(model: Transformer, schedule: str, ranks: int, per_rank: int | None = None, split=None,
                  caching: bool = False) -> list[StageModule]:
    """Every stage of ``model`` pipelined over ``ranks`` ranks under ``schedule``, in order; with
    ``caching``, the stages of one rank share its ``SourceCache`` and each hop carries only the
    completed sources the receiving rank does not hold (``stage_cache.sources_held``)."""
    n_stages = ranks * stages_per_rank(schedule, per_rank)
    bounds = stage_bounds(model.config.num_sublayers, n_stages, split)
    placed = {s: r for r in range(ranks) for s in stage_indices(schedule, r, ranks, per_rank)}
    owner = [placed[s] for s in range(n_stages)]
    completed_after = [boundary_layout(model, last) for _, last in bounds]
    held = sources_held(owner, completed_after) if caching else [0] * n_stages
    caches = [SourceCache() if caching else None for _ in range(ranks)]
    modules = []
    for index, (first, last) in enumerate(bounds):
        on_rank = [s for s in range(n_stages) if owner[s] == owner[index]]
        reads_later = any(s > index + 1 for s in on_rank)  # a later stage of the rank reads its cache
        modules.append(StageModule(model, first, last, index, caches[owner[index]], held=held[index],
                                   send_from=held[index + 1] if index + 1 < n_stages else 0,
                                   keeps=caching and reads_later, frees=caching and index == on_rank[-1],
                                   completed=completed_after[index - 1] if index else 0))
    return modules


@dataclass
class Pipeline:
    """One rank's part of a pipelined model: its stages and the schedule that runs them."""

    model: Transformer
    schedule: object
    stages: list
    microbatches: int
    group: dist.ProcessGroup | None
    #: the replicas of this pipeline (data parallelism beside it), or None
    replicas: dist.ProcessGroup | None = None
    #: this rank's cross-stage cache of completed sources, or None
    cache: SourceCache | None = None
    #: the entries the cache still held when the last step's schedule ended (0: each
    #: micro-batch's were freed by its rank's last stage)
    held_after_step: int = 0
    #: the parameters several pipeline ranks hold (``stage_local.shared_names``), on every rank
    shared: tuple[str, ...] = ()
    #: the names of the parameters FSDP2 shards over ``replicas`` (reduced by it), or empty
    sharded: frozenset[str] = frozenset()
    #: the pipeline rank of each stage
    owners: tuple[int, ...] = ()
    #: a mixture-of-experts model's routing in the last step's forwards (``StageModule.expert_log``)
    expert_log: list = field(default_factory=list)
    #: the shared parameters whose squares this rank counts in the norm (``_counted_shared``)
    counted: set[str] | None = None

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


def build_pipeline(model: Transformer, schedule: str, microbatches: int | None = None, *, per_rank: int | None = None,
                   split=None, group: dist.ProcessGroup | None = None, replicas: dist.ProcessGroup | None = None,
                   device: torch.device | None = None, cache: str = "auto", dp_mesh=None) -> Pipeline:
    """This rank's stages of ``model`` over the ranks of ``group`` (default: every rank) and
    ``schedule`` (one of ``SCHEDULES``) over ``microbatches`` micro-batches per step (default: one
    per stage). ``model`` loses the parts the rank does not hold (``stage_local.trim``; a model
    built for the rank, ``materialize.rank_model``, has none of them). ``replicas``: the ranks
    holding the same stages in the other copies of the pipeline (data parallelism beside it;
    each feeds its own part of the batch), whose gradients are averaged; with ``dp_mesh`` (the
    1-D mesh of the replicas), FSDP2 shards the rank's modules over them instead.
    ``per_rank``: stages per rank (``stages_per_rank``); ``split``: sublayers per stage
    (default: as even as they go); ``cache``: the cross-stage cache of completed sources
    (``stage_cache``), ``auto`` (on for the AttnRes family with several stages per rank),
    ``on`` or ``off``."""
    from torch.distributed import pipelining as pp

    ranks, rank = dist.get_world_size(group), dist.get_rank(group)
    n_stages, microbatches = check_pipeline(schedule, ranks, model.config.num_sublayers, None, microbatches,
                                            per_rank, split)
    parts = [rank_part(model.config, schedule, r, ranks, per_rank, split) for r in range(ranks)]
    trim(model, parts[rank])
    sharded = shard_stages(model, dp_mesh) if dp_mesh is not None else frozenset()
    device = device or next(model.parameters()).device
    model.to(device)  # what FSDP2 did not move (the stream, the RoPE tables); nothing if all is there
    caching = use_cache(cache, model.config.residual, stages_per_rank(schedule, per_rank))
    modules = stage_modules(model, schedule, ranks, per_rank, split, caching)
    indices = stage_indices(schedule, rank, ranks, per_rank)
    stages = []
    for index in indices:
        module = modules[index]
        kwargs = {}
        if schedule in V_SHAPED:
            # these schedules split each backward into an input and a weight part; a stage that
            # reads one parameter at several points (the stream's per-site rows) cannot run the
            # weight part alone here, so the whole backward runs in the input part
            kwargs["dw_builder"] = lambda: (lambda: None)
        stages.append(pp.PipelineStage(module, index, n_stages, device, group=group, **kwargs))
    cls = getattr(pp, SCHEDULE_CLASSES[schedule])
    # the gradients are scaled once, after the step: two local stages share the model's parameters
    run = cls(stages if schedule in MULTI_STAGE else stages[0], n_microbatches=microbatches, loss_fn=lm_loss,
              scale_grads=False)
    owners = tuple(r for s in range(n_stages) for r in range(ranks) if s in stage_indices(schedule, r, ranks, per_rank))
    pipe = Pipeline(model, run, stages, microbatches, group, replicas, modules[indices[0]].cache,
                    shared=tuple(shared_names(model.config, parts)), sharded=sharded, owners=owners)
    for index in indices:
        modules[index].expert_log = pipe.expert_log
    return pipe
