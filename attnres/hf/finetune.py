"""Continued pretraining of a Hugging Face causal LM object (native or converted) on a token
array: the trainer's own loop (``train.trainer.train``, as ``attnres train --from`` runs it) in a
temporary run folder, at a constant learning rate."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import numpy as np

from ..train.config import DataConfig, OptimConfig, RunConfig, TrainConfig
from ..train.data import Corpus
from ..train.saved_model import SavedModel
from ..train.trainer import train
from .convert import freeze_base, routing_parameters
from .training import FolderLM, MOE_TYPES, decoder_layers


def finetune(model, tokens: np.ndarray, *, steps: int, batch_size: int = 4, seq_len: int = 64,
             lr: float = 1e-3, weight_decay: float = 0.0, routing_only: bool = False, seed: int = 0,
             on_step=None) -> list[float]:
    """Train ``model`` in place on next-token loss over batches of ``tokens`` (the trainer's
    batches of seed ``seed``, its AdamW, parameter groups and clipping, at a constant ``lr``,
    no warmup, in the model's dtype on its device); returns the loss of every step. A SIGINT or
    SIGTERM stops it after the current step with ``KeyboardInterrupt`` (the model keeps the
    steps it took).

    ``routing_only=True`` trains only the routing parameters a conversion added (the base is
    frozen for the run and unfrozen after). The routing parameters and vectors (norms, biases)
    are kept out of weight decay. A mixture of experts adds its routers' balance loss, as its
    own training weighs it. ``on_step(step, model)`` is called after each optimizer step."""
    routing = routing_parameters(model)
    if routing_only and not routing:
        raise ValueError("routing_only=True but the model has no routing.* parameters (is it converted?)")
    device = next(model.parameters()).device
    config = model.config
    moe = config.model_type in MOE_TYPES
    with tempfile.TemporaryDirectory(prefix="attnres-finetune-") as tmp:
        run_dir = Path(tmp) / "run"
        lm = FolderLM(model, moe)
        folder = SavedModel(Path(tmp), config.model_type, config.vocab_size, config.max_position_embeddings,
                             sum(p.numel() for p in model.parameters()),
                             config.router_aux_loss_coef if moe else None, lambda _device: lm.train(), decoder_layers)
        cfg = TrainConfig(
            model=None, init_from=tmp, data=DataConfig(),
            optim=OptimConfig(lr=lr, weight_decay=weight_decay, warmup_steps=0, schedule="constant"),
            run=RunConfig(steps=steps, batch_size=batch_size, seq_len=seq_len, seed=seed, eval_every=steps,
                          eval_batches=1, log_every=1, device=str(device), autocast="none", progress=False,
                          tensorboard=False))
        frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
        if routing_only:
            freeze_base(model)
        try:
            result = train(cfg, run_dir, corpus=Corpus(tokens, tokens, config.vocab_size, "a token array"),
                           folder=folder, on_step=None if on_step is None else lambda step, _lm: on_step(step, model))
            if result.interrupted:  # the trainer saved a checkpoint into the temporary folder: the caller is told
                raise KeyboardInterrupt(f"finetune stopped by signal {result.signal} after step {result.summary['steps']}")
            rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        finally:
            lm.remove_hooks()
            for name, p in model.named_parameters():
                p.requires_grad_(name not in frozen)
    return [row["loss"] for row in rows if row["split"] == "train"]
