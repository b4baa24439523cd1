"""The cross-stage cache of completed sources, for a pipeline whose ranks hold several stages.

A rank that holds stages ``p < s`` meets every micro-batch twice; when stage ``s`` runs, the rank
already holds every source completed before ``p`` ended. So a hop into ``s`` carries only the
sources completed since (and the rest of the state: the partial sum, Delta's ``h``): for Block
AttnRes in 8 interleaved stages on 4 ranks (rank ``r`` holding ``r`` and ``r + 4``), a hop into a
rank's second stage carries the blocks of the three stages since its first, not all of them.

Per micro-batch, ``SourceCache`` keeps one ``Entry`` per completed source the rank has produced
or received: its value and the gradient that the rank's later stages compute for it. The stage
where a source entered the rank owns its entry; a later stage reads the value as a fresh leaf
whose gradient is added to the entry. In the owner's backward (which runs after every later
stage's, the gradients flowing back through them), the entry's gradient joins the source's, and
the sum goes back to the stage before once, as any input gradient does.

Summed this way, a cached source's gradient adds the rank's later stages' part to the rest in
another order than one process does; fp32 addition is not associative, so the result agrees
with ``pp_cache=off`` to round-off, not bit for bit (measured in ``tests/test_pipeline.py``).

Whether a pipeline caches is its ``ParallelPlan``'s ``cache`` (``run.pp_cache``).
"""

from __future__ import annotations

import torch


def sources_held(owner: list[int], completed_after: list[int]) -> list[int]:
    """For each stage ``s``, how many leading completed sources its rank holds when ``s`` runs:
    all those completed by the end of the rank's latest stage before ``s - 1`` (0 if none).
    ``owner[s]``: the rank of stage ``s``; ``completed_after[s]``: the completed sources at its
    end. A stage ``s - 1`` on the same rank (the turn of a V) is not counted: that hop hands its
    tensors over in memory and costs nothing to send whole."""
    held = []
    for s, rank in enumerate(owner):
        earlier = [p for p in range(s - 1) if owner[p] == rank]
        held.append(completed_after[earlier[-1]] if earlier else 0)
    return held


class Entry:
    """A cached source: ``value`` (detached; None once no later stage will read it),
    ``needs_grad`` (whether the source takes a gradient) and ``grad``, the sum of the gradients
    the rank's later stages computed for it (None until one did)."""

    __slots__ = ("value", "needs_grad", "grad")

    def __init__(self, value: torch.Tensor, needs_grad: bool):
        self.value, self.needs_grad, self.grad = value, needs_grad, None

    def add(self, grad: torch.Tensor) -> None:
        self.grad = grad if self.grad is None else self.grad + grad

    def take_from(self, leaf: torch.Tensor) -> None:
        """Add a reading leaf's gradient, and free the leaf's copy of it."""
        self.add(leaf.grad)
        leaf.grad = None

    def take(self) -> torch.Tensor | None:
        grad, self.grad = self.grad, None
        return grad


class _WithHeldGradient(torch.autograd.Function):
    """Identity forward; the backward adds what the rank's later stages left in the entry."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, entry: Entry) -> torch.Tensor:
        ctx.entry = entry
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        held = ctx.entry.take()
        return (grad if held is None else grad + held), None


class SourceCache:
    """The completed sources one rank holds, per micro-batch: ``own`` registers the sources
    that enter the rank at a stage, ``read`` gives a later stage the first ``count``, ``drop``
    frees a micro-batch's after its last stage on the rank has read them."""

    def __init__(self):
        self._held: dict[int, dict[int, Entry]] = {}
        self._made: list[Entry] = []  # the step's entries that take a gradient (values freed by drop)

    def clear(self) -> None:
        self._held.clear()
        self._made.clear()

    def check_delivered(self) -> None:
        """Raise if a gradient the rank's later stages left for a source was not added to it
        (its owner's backward never reached the source): the step's gradients would be wrong."""
        left = sum(entry.grad is not None for entry in self._made)
        if left:
            raise RuntimeError(f"{left} cached source(s) kept a gradient their owning stage never took: the step's "
                               f"gradients are incomplete")

    def own(self, microbatch: int, first: int, sources) -> list[torch.Tensor]:
        """Register ``sources`` as completed sources ``first, first + 1, ...`` of
        ``microbatch``; returns them to be used in their place (their backward adds the
        gradients of the rank's later stages)."""
        held = self._held.setdefault(microbatch, {})
        used = []
        for j, source in enumerate(sources, first):
            if j in held:  # a later stage of the rank received it again: it reads the new entry
                held[j].value = None
            entry = held[j] = Entry(source.detach(), source.requires_grad)
            if entry.needs_grad:
                self._made.append(entry)
            used.append(_WithHeldGradient.apply(source, entry) if entry.needs_grad else source)
        return used

    def read(self, microbatch: int, count: int, stage: int) -> list[torch.Tensor]:
        """Completed sources ``0 .. count - 1`` of ``microbatch``, each a fresh leaf whose
        gradient goes to its entry."""
        held = self._held.get(microbatch, {})
        missing = [j for j in range(count) if j not in held]
        if missing:
            raise RuntimeError(f"stage {stage} reads cached sources {missing} of micro-batch {microbatch}, which its "
                               f"rank has not seen: a rank runs a micro-batch's stages in order")
        leaves = []
        for j in range(count):
            entry = held[j]
            leaf = entry.value.detach().requires_grad_(entry.needs_grad and torch.is_grad_enabled())
            if leaf.requires_grad:
                leaf.register_post_accumulate_grad_hook(entry.take_from)
            leaves.append(leaf)
        return leaves

    def drop(self, microbatch: int) -> None:
        """Free ``microbatch``'s sources (its gradients still reach their owners)."""
        for entry in self._held.pop(microbatch, {}).values():
            entry.value = None

    def __len__(self) -> int:
        return sum(len(held) for held in self._held.values())
