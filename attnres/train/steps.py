"""What one optimizer step computes, wherever it runs: the learning rate, the gradients of its
micro-batches, the per-layer gradient norms the summary averages, and for a mixture-of-experts
model the routing statistics, the balance bias and the log's expert fields."""

from __future__ import annotations

import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass

import torch

from ..model import Transformer, lm_loss
from ..moe import ExpertStats, expert_load
from . import distributed as dist
from .config import OptimConfig


def lr_at(step: int, total: int, cfg: OptimConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based) out of ``total``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    decay_start = int(total * (1 - cfg.decay_fraction))  # wsd: warmup, stable, linear decay
    if step < decay_start:
        return cfg.lr
    return cfg.lr + (floor - cfg.lr) * (step - decay_start + 1) / max(1, total - decay_start)


def accumulate_gradients(loss_of, x: torch.Tensor, y: torch.Tensor, grad_accum: int = 1,
                         context=lambda k: nullcontext()) -> torch.Tensor:
    """The gradients of one optimizer step: ``x, y`` ``[B, T]`` split into ``grad_accum`` equal
    micro-batches, each ``loss_of(xs, ys) / grad_accum`` backpropagated inside ``context(k)``
    (``k``: the micro-batch). Returns the step's loss, a detached scalar. The caller zeroes the
    gradients before and clips and steps after."""
    micro = x.shape[0] // grad_accum
    total = torch.zeros((), device=x.device)
    for k in range(grad_accum):
        with context(k):
            loss = loss_of(x[k * micro : (k + 1) * micro], y[k * micro : (k + 1) * micro]) / grad_accum
        loss.backward()
        total += loss.detach()
    return total


@contextmanager
def micro_step(wrapped, no_sync: bool, autocast):
    """A micro-batch's forward: gradient synchronization held back until the last one, autocast."""
    with dist.no_sync(wrapped, no_sync), autocast():
        yield


def layer_grad_norms(model: Transformer) -> list[float]:
    """L2 norm of each transformer layer's parameter gradients."""
    norms = []
    for layer in model.layers:
        sq = sum(float(p.grad.detach().float().pow(2).sum()) for p in layer.parameters() if p.grad is not None)
        norms.append(math.sqrt(sq))
    return norms


@dataclass
class LayerGradNorms:
    """Each layer's gradient norm summed over the recorded steps (``sums``, None before the
    first) and how many were recorded: the summary's ``layer_grad_norms`` is their mean. A
    checkpoint carries them (``state``, ``from_state``) so that a resumed run averages the same
    steps."""

    sums: list[float] | None = None
    count: int = 0

    def add(self, model: Transformer) -> None:
        norms = layer_grad_norms(model)
        self.sums = norms if self.sums is None else [a + b for a, b in zip(self.sums, norms)]
        self.count += 1

    def mean(self) -> list[float] | None:
        return [s / self.count for s in self.sums] if self.count else None

    def state(self) -> dict:
        return dict(grad_norm_sums=torch.tensor(self.sums) if self.sums is not None else None,
                    grad_norm_count=self.count)

    @classmethod
    def from_state(cls, state: dict) -> LayerGradNorms:
        sums = state.get("grad_norm_sums")
        return cls(sums.tolist() if sums is not None else None, int(state.get("grad_norm_count", 0)))


def step_counts(stats: list[ExpertStats]) -> torch.Tensor:
    """One optimizer step's assignments per MoE layer and expert ``[L, E]``, summed over its
    micro-batches' ``stats`` and over ranks."""
    return dist.sum_across_ranks(torch.stack([s.load() for s in stats]).sum(0))


def expert_record(stats: list[ExpertStats], counts: torch.Tensor) -> dict:
    """The log's MoE fields for one optimizer step (``counts`` from ``step_counts``):
    ``expert_load`` (the fraction of assignments per expert, per MoE layer),
    ``expert_imbalance`` (the most loaded expert's fraction times E, mean over layers; 1.0 is
    balanced), ``moe_aux_loss`` (the balance loss before its weight) and, with a capacity,
    ``expert_dropped`` (the fraction of assignments dropped)."""
    load = expert_load(counts)
    record = dict(expert_load=[[round(float(f), 6) for f in row] for row in load],
                  expert_imbalance=float((load.max(-1).values * load.shape[-1]).mean()),
                  moe_aux_loss=float(dist.mean_across_ranks(torch.stack([s.aux_loss().detach() for s in stats]).mean())))
    if stats[0].dropped:
        dropped = dist.sum_across_ranks(torch.stack([torch.stack(s.dropped).sum() for s in stats]).sum())
        record["expert_dropped"] = float(dropped / counts.sum())
    return record


class ExpertSteps:
    """The mixture-of-experts side of each optimizer step of ``model``: ``start`` it, compute
    each micro-batch's ``loss`` through it (the language model's plus the weighted balance loss,
    the routing recorded), read the step's language-model loss (``lm``, what the log reports;
    the balance loss is logged apart) and ``finish`` it after the optimizer step."""

    def __init__(self, model: Transformer, grad_accum: int, device: torch.device):
        self.model, self.grad_accum = model, grad_accum
        self.stats: list[ExpertStats] = []  # the routing of the current step's micro-batches
        self.lm = torch.zeros((), device=device)  # the step's loss without the balance loss

    def start(self) -> None:
        self.stats.clear()
        self.lm.zero_()

    def loss(self, forward, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss through ``forward`` (the wrapped model), its routing recorded."""
        experts = ExpertStats()
        self.stats.append(experts)
        lm = lm_loss(forward(xs, experts=experts), ys)
        self.lm.add_(lm.detach() / self.grad_accum)
        return lm + self.model.moe_aux_loss(experts)

    def finish(self, logging: bool) -> dict:
        """After the optimizer step: the balance bias moved (``bias`` balance; nothing for
        ``aux``) and, when the step is ``logging``, the log's expert fields (else ``{}``). The
        counts are summed over ranks only when one of them needs them."""
        if not (logging or self.model.config.moe_balance == "bias"):
            return {}
        counts = step_counts(self.stats)
        self.model.update_expert_bias(counts)
        return expert_record(self.stats, counts) if logging else {}
