"""Mixture-of-experts sublayers: a top-k router over SwiGLU experts, with optional shared experts.

For tokens ``x`` ``[N, D]`` (batch and time flattened) and ``E`` routed experts::

    p = softmax(x W_r^T)                          [N, E]   router probabilities (at least fp32, no autocast)
    S = top_k(p + b)                              [N, k]   chosen experts (b: balance bias, 0 for "aux")
    g = p[S] / sum(p[S])  (top-1: g = p[S])       [N, k]   gate weights
    y = shared(x) + sum_j g_j * expert_{S_j}(x)            expert_e(x) = w2_e (silu(w1_e x) * w3_e x)

Two ways keep the experts in use:

- ``aux`` (Switch Transformer): the loss gains ``weight * E * sum_e f_e * P_e``, the mean over
  MoE layers, where ``f_e`` is the fraction of the N*k assignments that went to expert ``e`` and
  ``P_e`` the mean router probability of ``e``; 1.0 when perfectly balanced.
- ``bias`` (auxiliary-loss-free, DeepSeek-V3): after each optimizer step,
  ``b_e += rate * sign(mean_e(load) - load_e)`` with the step's load counted over every
  micro-batch and rank (``Transformer.update_expert_bias``). The bias only chooses experts; the
  gate weights come from ``p`` alone.

With a capacity factor ``c > 0`` each expert takes at most ``ceil(c * N * k / E)`` assignments per
forward in training, first come first served in token order (token ``n`` before ``n + 1``, slot
``j`` before ``j + 1`` within a token); a dropped assignment adds nothing. Evaluation and
generation drop nothing, so a token's output does not depend on the other tokens of its batch.

Top-1 routing keeps ``p`` unnormalized (Switch Transformer): normalized, its one weight would be
1 and the router would get no gradient from the language-model loss.

``MoE.forward`` dispatches sorted by expert (one stable sort, one gather, one SwiGLU per expert
over a contiguous group, one un-sort); ``moe_naive`` is its per-expert loop twin, the reference
the tests compare it with (forward and gradients). Under ``torch.compile`` an MoE sublayer runs
eagerly: its groups have data-dependent sizes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.nn import functional as F

BALANCE = ("aux", "bias")


@dataclass
class ExpertStats:
    """What MoE layers record during one forward, in layer order (pass it as ``experts=`` to
    ``Transformer.forward``): ``counts[l]`` ``[E]`` assignments per expert (detached, before any
    capacity drop), ``dropped[l]`` the assignments the capacity dropped (a detached scalar),
    ``aux[l]`` the layer's balance loss ``E * sum_e f_e P_e`` (a scalar in the autograd graph)."""

    counts: list[torch.Tensor] = field(default_factory=list)
    dropped: list[torch.Tensor] = field(default_factory=list)
    aux: list[torch.Tensor] = field(default_factory=list)

    def aux_loss(self) -> torch.Tensor:
        """The mean of the layers' balance losses (call it after a forward that recorded some)."""
        if not self.aux:
            raise ValueError("no MoE layer recorded a balance loss: pass this ExpertStats to a forward first")
        return torch.stack(self.aux).mean()

    def load(self) -> torch.Tensor:
        """``[L, E]`` counts of the recorded layers."""
        return torch.stack(self.counts)


def expert_load(counts: torch.Tensor) -> torch.Tensor:
    """Fraction of assignments per expert, ``[..., E]`` counts -> ``[..., E]`` fractions summing to 1."""
    return counts / counts.sum(-1, keepdim=True).clamp_min(1)


def expert_swiglu(x: torch.Tensor, w1: torch.Tensor, w3: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    """One expert's SwiGLU ``w2 (silu(w1 x) * w3 x)`` for ``x`` ``[n, D]``, ``w1``/``w3``
    ``[H, D]``, ``w2`` ``[D, H]``."""
    return F.linear(F.silu(F.linear(x, w1)) * F.linear(x, w3), w2)


def capacity_of(capacity: float, assignments: int, experts: int) -> int | None:
    """Assignments an expert takes per forward: ``ceil(capacity * assignments / experts)``, or
    None (no limit) for ``capacity == 0``."""
    if not capacity >= 0 or math.isinf(capacity):
        raise ValueError(f"capacity={capacity} must be a finite number >= 0 (0: no limit)")
    # rounded first, so that a share that is whole up to float error (1.1 * 100 / 11) is not lifted
    return math.ceil(round(capacity * assignments / experts, 9)) if capacity > 0 else None


class MoE(nn.Module):
    """A routed mixture of SwiGLU experts (``[E, H, D]`` weights ``w1``, ``w3``; ``[E, D, H]``
    ``w2``), a router ``gate`` ``[E, D]``, and ``shared`` experts as one SwiGLU of width
    ``shared_experts * H`` that every token passes through (independent experts summed equal one
    expert of their joint width). ``expert_bias`` ``[E]`` is the ``bias`` balance's state: saved
    with the weights, never trained by gradients."""

    def __init__(self, dim: int, experts: int, top_k: int, hidden: int, *, shared_experts: int = 0,
                 balance: str = "aux", bias_rate: float = 1e-3, capacity: float = 0.0, normalize_top_k: bool = True):
        super().__init__()
        if not 1 <= top_k <= experts:
            raise ValueError(f"top_k={top_k} must be in [1, experts={experts}]")
        capacity_of(capacity, 1, 1)  # refuses a negative or non-finite capacity
        if balance not in BALANCE:
            raise ValueError(f"balance={balance!r} is not one of {BALANCE}")
        self.experts, self.top_k, self.hidden = experts, top_k, hidden
        self.balance, self.bias_rate, self.capacity = balance, bias_rate, capacity
        self.normalize_top_k = normalize_top_k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, dim))
        self.w2 = nn.Parameter(torch.empty(experts, dim, hidden))
        self.shared = SwiGLU(dim, shared_experts * hidden) if shared_experts else None
        self.register_buffer("expert_bias", torch.zeros(experts))

    def _apply(self, fn, recurse=True):
        # the bias stays fp32 when the model is cast: in bf16, steps of 1e-3 are lost once |b| > 0.25
        super()._apply(fn, recurse)
        self.expert_bias = self.expert_bias.float()
        return self

    def route(self, x: torch.Tensor, stats: ExpertStats | None = None):
        """Router probabilities ``[N, E]`` (fp32, or fp64 for fp64 inputs), chosen experts
        ``[N, k]`` and gate weights ``[N, k]`` for ``x`` ``[N, D]``; records the counts and the
        balance loss."""
        dtype = torch.promote_types(x.dtype, torch.float32)
        with torch.autocast(x.device.type, enabled=False):  # choices from full-precision logits
            logits = F.linear(x.to(dtype), self.gate.weight.to(dtype))
        probs = torch.softmax(logits, dim=-1)
        choice = probs + self.expert_bias if self.balance == "bias" else probs
        chosen = choice.topk(self.top_k, dim=-1).indices
        weights = probs.gather(1, chosen)
        if self.normalize_top_k and self.top_k > 1:
            weights = weights / weights.sum(-1, keepdim=True)
        if stats is not None:
            counts = torch.bincount(chosen.flatten(), minlength=self.experts).to(probs.dtype)
            stats.counts.append(counts.detach())
            f = counts / chosen.numel()
            stats.aux.append(self.experts * (f * probs.mean(0)).sum())
        return probs, chosen, weights

    def _capacity(self, assignments: int) -> int | None:
        return capacity_of(self.capacity, assignments, self.experts) if self.training else None

    @torch.compiler.disable
    def forward(self, x: torch.Tensor, stats: ExpertStats | None = None) -> torch.Tensor:
        """``x`` ``[..., D]`` -> ``[..., D]``, dispatched sorted by expert."""
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        N, k = x.shape[0], self.top_k
        _, chosen, weights = self.route(x, stats)
        flat = chosen.flatten()  # [N*k], assignment a = token a // k, slot a % k
        order = torch.argsort(flat, stable=True)  # grouped by expert, token order within a group
        group_sizes = torch.bincount(flat, minlength=self.experts)
        counts = group_sizes.tolist()  # the one host sync: the groups' sizes
        limit = self._capacity(N * k)
        gathered = x[order // k]  # [N*k, D]
        outputs = []
        for e, group in enumerate(gathered.split(counts)):
            kept = group[:limit]  # a group is in token order: the first `limit` are kept
            outputs.append(expert_swiglu(kept, self.w1[e], self.w3[e], self.w2[e]))
            if kept.shape[0] < group.shape[0]:
                outputs.append(group.new_zeros(group.shape[0] - kept.shape[0], group.shape[1]))
        if stats is not None and limit is not None:
            stats.dropped.append((group_sizes - limit).clamp_min(0).sum().to(torch.float32))
        y_sorted = torch.cat(outputs) * weights.flatten()[order, None].to(x.dtype)
        y = torch.empty_like(y_sorted).index_copy(0, order, y_sorted)  # back to assignment order
        y = y.view(N, k, -1).sum(1)
        if self.shared is not None:
            y = y + self.shared(x)
        return y.view(shape)

    @torch.no_grad()
    def update_bias(self, counts: torch.Tensor) -> None:
        """``b_e += rate * sign(mean(counts) - counts_e)`` for one optimizer step's ``counts`` ``[E]``."""
        self.expert_bias += self.bias_rate * torch.sign(counts.float().mean() - counts.float())


def moe_naive(moe: MoE, x: torch.Tensor, stats: ExpertStats | None = None) -> torch.Tensor:
    """``MoE.forward`` written as a loop over experts and slots: for each expert, the tokens that
    chose it, in token order, up to its capacity; the reference for the sorted dispatch."""
    shape = x.shape
    x = x.reshape(-1, shape[-1])
    N, k = x.shape[0], moe.top_k
    _, chosen, weights = moe.route(x, stats)
    limit = moe._capacity(N * k)
    y = torch.zeros_like(x)
    dropped = torch.zeros((), device=x.device)
    for e in range(moe.experts):
        mask = chosen == e  # [N, k]; a token chooses an expert at most once
        if limit is not None:  # the first `limit` assignments in token, then slot, order
            kept = mask & (mask.flatten().cumsum(0) <= limit).view(N, k)
            dropped = dropped + (mask.sum() - kept.sum())
            mask = kept
        rows, slots = mask.nonzero(as_tuple=True)
        out = expert_swiglu(x[rows], moe.w1[e], moe.w3[e], moe.w2[e])
        y = y.index_add(0, rows, out * weights[rows, slots, None].to(x.dtype))
    if stats is not None and limit is not None:
        stats.dropped.append(dropped.to(torch.float32))
    if moe.shared is not None:
        y = y + moe.shared(x)
    return y.view(shape)


class SwiGLU(nn.Module):
    """``w2(silu(w1 x) * w3 x)``: the dense MLP, and the shared experts of an MoE sublayer."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)

    def forward(self, x, stats: ExpertStats | None = None):
        """``x`` ``[..., D]``; ``stats`` is accepted so dense and MoE sublayers are called alike."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
