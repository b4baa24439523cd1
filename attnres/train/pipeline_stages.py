"""A pipeline's stages as modules: ``StageModule`` runs sublayers ``first .. last - 1`` of the
model, taking what the stage before sent and returning what the next one receives, and
``stage_modules`` makes every stage of a ``ParallelPlan``.

Between stages travels ``stream.split_state(state)`` (the completed sources, then the rest), and
the receiving stage rebuilds the state with ``stream.join_state``, preparing the sources again
for its own routing. With the plan's cross-stage cache on (``stage_cache``), the stages of one
rank share its ``SourceCache`` and a hop carries only the completed sources the receiving rank
does not hold.
"""

from __future__ import annotations

import torch
from torch import nn

from ..model import Transformer
from ..moe import ExpertStats
from .parallel_plan import ParallelPlan
from .stage_cache import SourceCache, sources_held


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


def stage_modules(model: Transformer, plan: ParallelPlan) -> list[StageModule]:
    """Every stage of ``model`` as ``plan`` cuts it, in order; with the plan's cache on, the
    stages of one rank share its ``SourceCache`` and each hop carries only the completed sources
    the receiving rank does not hold (``stage_cache.sources_held``)."""
    owner = plan.owners
    n_stages = len(plan.stages)
    completed_after = [boundary_layout(model, stage.last) for stage in plan.stages]
    held = sources_held(list(owner), completed_after) if plan.cache else [0] * n_stages
    caches = [SourceCache() if plan.cache else None for _ in range(plan.pp_size)]
    modules = []
    for stage in plan.stages:
        index = stage.index
        on_rank = [s.index for s in plan.stages_of(stage.rank)]
        reads_later = any(s > index + 1 for s in on_rank)  # a later stage of the rank reads its cache
        modules.append(StageModule(model, stage.first, stage.last, index, caches[stage.rank], held=held[index],
                                   send_from=held[index + 1] if index + 1 < n_stages else 0,
                                   keeps=plan.cache and reads_later, frees=plan.cache and index == on_rank[-1],
                                   completed=completed_after[index - 1] if index else 0))
    return modules
