"""What one rank of a distributed run holds of the model, and the parameters several ranks hold.

A pipeline rank holds only what its stages run (``Part``): the sublayers of its stages (one
Layer's attention and MLP may live on two ranks when a stage boundary falls between them), the
embedding where the first stage lives, the head where the last lives, and the whole stream.
``trim`` removes the rest from a ``Transformer``: the modules become None, and the state dict,
the optimizer and a checkpoint see only the rank's part, under the names the whole model gives
them.

The stream is held whole by every pipeline rank: its per-site parameters are rows of stacked
tensors (``pseudo_queries`` ``[M + 1, D]``, HC's and mHC's projections ``[M, ...]``), and the
final norm and Delta's null source belong to no sublayer. A rank's backward fills only the rows
of its own sites, so the stream's gradients are summed over the pipeline (``shared_names``);
so is a tied embedding's, held by the first and the last stage. Every other gradient stays on
its rank.

Without a pipeline a rank holds the whole model (``Part.whole``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ..model import ModelConfig, Transformer


@dataclass(frozen=True)
class Part:
    """The part of the model one rank holds: the sublayer indices ``sublayers``, the embedding
    (``first``: the rank runs sublayer 0's stage) and the head (``last``)."""

    sublayers: frozenset[int]
    first: bool
    last: bool

    @classmethod
    def whole(cls, config: ModelConfig) -> Part:
        return cls(frozenset(range(config.num_sublayers)), True, True)

    @classmethod
    def of_stages(cls, bounds: list[tuple[int, int]], num_sublayers: int) -> Part:
        """The part that runs the stages ``bounds`` (``[(first, last), ...]``, sublayers
        ``first .. last - 1`` each)."""
        held = frozenset(i for first, last in bounds for i in range(first, last))
        return cls(held, 0 in held, num_sublayers - 1 in held)

    def module_names(self, config: ModelConfig) -> list[str]:
        """The names of the modules this part holds, as the whole model names them."""
        names = ["tok_embeddings"] if self.first else []
        names += [f"layers.{i >> 1}.{'attn' if i % 2 == 0 else 'mlp'}" for i in sorted(self.sublayers)]
        return names + ["stream"] + (["lm_head"] if self.last else [])


def trim(model: Transformer, part: Part) -> Transformer:
    """Remove from ``model`` (in place) every module ``part`` does not hold; returns it. A
    tied embedding stays with the head where the rank holds the head only."""
    for j, layer in enumerate(model.layers):
        if 2 * j not in part.sublayers:
            layer.attn = None
        if 2 * j + 1 not in part.sublayers:
            layer.mlp = None
    if not part.first:
        model.tok_embeddings = None
    if not part.last:
        model.lm_head = None
    return model


def shared_names(config: ModelConfig, parts: list[Part]) -> list[str]:
    """The parameters more than one of the pipeline ranks ``parts`` hold, whose gradients are
    summed over the pipeline: the stream's, and a tied embedding held by two ranks (named
    ``tok_embeddings.weight``). The same list, in the same order, on every rank."""
    stream = meta_model(config).stream
    names = [f"stream.{name}" for name, _ in stream.named_parameters()]
    holders = [p for p in parts if p.first or p.last]
    if config.tie_embeddings and len(holders) > 1:
        names.append("tok_embeddings.weight")
    return names


def tied_weight(model: Transformer) -> nn.Parameter | None:
    """The tied embedding this rank holds (through the embedding or the head), or None."""
    if not model.config.tie_embeddings:
        return None
    module = model.tok_embeddings if model.tok_embeddings is not None else model.lm_head
    return None if module is None else module.weight


def shared_parameter(model: Transformer, name: str) -> nn.Parameter | None:
    """The parameter ``name`` of ``shared_names`` on this rank, or None where it does not hold it."""
    if name == "tok_embeddings.weight":
        return tied_weight(model)
    return model.get_parameter(name)


def _local(t):
    """A tensor's part on this rank (an FSDP2 shard's local tensor)."""
    return t.to_local() if hasattr(t, "to_local") else t


def _nbytes(t) -> int:
    t = _local(t)
    return t.numel() * t.element_size()


def rank_footprint(model: nn.Module, optimizer) -> dict:
    """What this rank holds: ``param_count``, the parameter elements (its shards under FSDP2),
    and ``state_bytes``, the bytes of its parameters, their gradients and the optimizer's state
    (read after an optimizer step, when all three exist)."""
    params = list(model.parameters())
    total = sum(_nbytes(p) + (_nbytes(p.grad) if p.grad is not None else 0) for p in params)
    total += sum(_nbytes(v) for state in optimizer.state.values() for v in state.values() if hasattr(v, "numel"))
    return dict(param_count=sum(_local(p).numel() for p in params), state_bytes=total)


def meta_model(config: ModelConfig) -> Transformer:
    """The ``Transformer`` ``config`` describes on the meta device, uninitialized (no memory):
    its parameters' and buffers' names, shapes and sizes, what the checks and counts read."""
    import torch

    with torch.device("meta"):
        return Transformer(config, initialize=False)


def parameter_count(config: ModelConfig) -> int:
    """The whole model's parameter elements (a tied weight once), counted on the meta device."""
    return sum(p.numel() for p in meta_model(config).parameters())
