"""Continued pretraining of a Hugging Face causal LM (native or converted) on a token array."""

from __future__ import annotations

import numpy as np
import torch

from ..model import param_groups
from ..train.data import batch_at
from ..train.trainer import accumulate_gradients
from .convert import routing_parameters


def finetune(model, tokens: np.ndarray, *, steps: int, batch_size: int = 4, seq_len: int = 64,
             lr: float = 1e-3, weight_decay: float = 0.0, routing_only: bool = False, seed: int = 0,
             on_step=None) -> list[float]:
    """AdamW on next-token loss over batches of ``tokens`` (the trainer's batches and gradient
    step, at a constant ``lr``); returns the loss of every step.

    ``routing_only=True`` trains only the routing parameters a conversion added. The routing
    parameters and vectors (norms, biases) are kept out of weight decay. ``on_step(step, model)``
    is called after each optimizer step.
    """
    routing = routing_parameters(model)
    if routing_only and not routing:
        raise ValueError("routing_only=True but the model has no routing.* parameters (is it converted?)")
    optimizer = torch.optim.AdamW(param_groups(model, weight_decay, only=set(routing) if routing_only else None), lr=lr)
    device = next(model.parameters()).device

    def loss_of(x, y):
        logits = model(input_ids=x).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    model.train()
    losses = []
    for step in range(steps):
        x, y = batch_at(tokens, batch_size, seq_len, seed, step)
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(accumulate_gradients(loss_of, x.to(device), y.to(device))))
        optimizer.step()
        if on_step is not None:
            on_step(step, model)
    return losses
