"""Continued pretraining of a Hugging Face causal LM (native or converted) on a token array."""

from __future__ import annotations

import numpy as np
import torch

from ..train.data import batch_at
from .convert import routing_parameters


def finetune(model, tokens: np.ndarray, *, steps: int, batch_size: int = 4, seq_len: int = 64,
             lr: float = 1e-3, weight_decay: float = 0.0, routing_only: bool = False, seed: int = 0,
             on_step=None) -> list[float]:
    """AdamW on next-token loss over batches of ``tokens``; returns the loss of every step.

    ``routing_only=True`` trains only the routing parameters a conversion added. ``on_step(step,
    model)`` is called after each optimizer step.
    """
    routing = routing_parameters(model)
    if routing_only and not routing:
        raise ValueError("routing_only=True but the model has no routing.* parameters (is it converted?)")
    params = list(routing.values()) if routing_only else [p for p in model.parameters() if p.requires_grad]
    # routing parameters and vectors (norms, biases) are kept out of weight decay
    exempt = {id(p) for p in routing.values()} | {id(p) for p in params if p.ndim < 2}
    optimizer = torch.optim.AdamW([
        {"params": [p for p in params if id(p) not in exempt], "weight_decay": weight_decay},
        {"params": [p for p in params if id(p) in exempt], "weight_decay": 0.0},
    ], lr=lr)
    device = next(model.parameters()).device
    model.train()
    losses = []
    for step in range(steps):
        x, y = batch_at(tokens, batch_size, seq_len, seed, step)
        out = model(input_ids=x.to(device))
        loss = torch.nn.functional.cross_entropy(out.logits.flatten(0, 1).float(), y.to(device).flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, model)
    return losses
