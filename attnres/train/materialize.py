"""A distributed rank's model, built on the meta device, holding only its part, with the values
one process draws.

One process seeds the generator with ``run.seed`` and builds the whole ``Transformer`` on the
CPU: every module's constructor draws (``nn.Linear``'s Kaiming init, ``nn.Embedding``'s normal),
then ``init_weights`` draws again, parameter by parameter, in a fixed order. A rank reproduces
those values for its part only:

1. it builds the model on the meta device under ``ReplayDraws``: each random init applied to a
   meta tensor is applied instead to a scratch CPU tensor of the same shape and dtype, then
   dropped, so the generator advances exactly as one process's does, while nothing of the model
   is allocated;
2. it gives real CPU storage to the modules its part holds (``Part.module_names``);
3. it runs ``init_weights`` under ``ReplayDraws``: the held parameters draw their values, the
   others (still meta) draw into scratch tensors, keeping the order;
4. it removes what it does not hold (``stage_local.trim``), rebuilds the non-persistent RoPE
   tables, and moves the rest to its device.

So a parameter has the same value under every layout (``tests/test_scale.py`` asserts it for
each). The scratch tensors exist one at a time: the most a rank allocates beyond its part is
its largest parameter it does not hold.
"""

from __future__ import annotations

import torch
from torch.overrides import TorchFunctionMode

from ..model import ModelConfig, Transformer, rope_tables
from .stage_local import Part, trim

#: the in-place initializers that draw from the generator (``torch.nn.init``'s and ``Tensor``'s)
RANDOM_INITS = frozenset({
    "normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "xavier_uniform_", "xavier_normal_",
    "trunc_normal_", "orthogonal_", "sparse_", "bernoulli_", "random_", "exponential_", "geometric_",
    "cauchy_", "log_normal_",
})


class ReplayDraws(TorchFunctionMode):
    """In-place initializers applied to meta tensors: a random one draws into a scratch CPU
    tensor of the same shape and dtype (the generator advances as it would for a real tensor),
    a deterministic one (``zeros_``, ``fill_``, ``copy_``, ...) does nothing. Everything else,
    and every call on a real tensor, runs as usual."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        # torch.nn.init passes its tensor by keyword to the mode
        target = args[0] if args else kwargs.get("tensor")
        if (isinstance(target, torch.Tensor) and target.is_meta and name.endswith("_")
                and not name.startswith("_")):
            if name in RANDOM_INITS:
                scratch = torch.empty(target.shape, dtype=target.dtype, device="cpu")
                if args:
                    func(scratch, *args[1:], **kwargs)
                else:
                    func(**{**kwargs, "tensor": scratch})
            return target
        return func(*args, **kwargs)


def rank_model(config: ModelConfig, seed: int, part: Part, device: torch.device | str = "cpu") -> Transformer:
    """The model of ``config`` as one process initializes it from ``seed``, holding only
    ``part`` (``Part.whole`` for all of it), on ``device``."""
    torch.manual_seed(seed)
    with torch.device("meta"), ReplayDraws():
        model = Transformer(config, initialize=False)
    names = part.module_names(config)
    if config.tie_embeddings and part.last and not part.first:
        names.append("tok_embeddings")  # the head's weight is the embedding's: drawn there
    for name in names:
        model.get_submodule(name).to_empty(device="cpu")
    if config.tie_embeddings and model.lm_head.weight is not model.tok_embeddings.weight:
        model.lm_head.weight = model.tok_embeddings.weight  # to_empty gave each its own storage
    with ReplayDraws():
        model.init_weights()
    trim(model, part)
    cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
    model.rope_cos, model.rope_sin = cos, sin
    return model.to(device)
