"""A model the trainer continues training from a saved folder (``attnres train --from``).

The trainer knows only its own ``Transformer``; a folder of another format (a Hugging Face
Llama, a converted model, an attnres export) is read by the layer that knows that format
(``attnres.hf.training.saved_model``), which hands the trainer a ``SavedModel``: what the
trainer needs of the model, and a function that builds it. So the trainer imports no
``transformers``, and one training loop serves both kinds of model.

The module ``build`` returns takes token ids ``[B, T]`` and returns logits ``[B, T, V]``; a
mixture-of-experts model returns ``(logits, balance)``, ``balance`` its routers' balance loss,
which the steps add to the language model's loss with the folder's own weight
(``SavedModel.balance_weight``, ``SavedExperts``), as ``transformers`` does with
``output_router_logits=True``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..model import lm_loss
from . import distributed as dist
from .data import load_corpus
from .source_digest import changes


@dataclass(frozen=True)
class SavedModel:
    """What the trainer needs of a model read from ``folder``.

    ``architecture``: the folder's model type (``llama``, ``attnres_qwen3``, ``attnres``, ...);
    ``vocab_size`` and ``max_positions``: its embedding's rows and its context;
    ``parameters``: its parameter elements (a tied weight once); ``balance_weight``: for a
    mixture of experts, whose forward returns a balance loss beside the logits, that loss's
    weight in the training loss (None for a dense model); ``build(device)``: the model with the folder's
    weights on ``device``, in float32; ``fsdp_units(model)``: the modules FSDP2 shards one by
    one before the whole (its decoder layers); ``tokenizer``: the folder's tokenizer (an object
    with ``encode(text) -> list[int]``), or None when it has none; ``digest``: the folder's
    digest as it was read (``source_digest.folder_digest``; None for a model handed over in
    memory), which a run records; ``routing_parameters``: how many routing parameters it has (a
    conversion's ``routing.*``, an export's stream's; 0 for a plain source), which
    ``optim.routing_lr_scale`` needs."""

    folder: Path
    architecture: str
    vocab_size: int
    max_positions: int
    parameters: int
    balance_weight: float | None
    build: Callable[[torch.device], nn.Module]
    fsdp_units: Callable[[nn.Module], list[nn.Module]]
    tokenizer: object | None = None
    digest: dict | None = None
    routing_parameters: int = 0

    def describe(self) -> dict:
        """What ``summary.json`` records of the model: its folder, architecture and sizes, and its
        digest's SHA-256 when it was read from a folder."""
        return dict(folder=str(self.folder), architecture=self.architecture, vocab_size=self.vocab_size,
                    max_positions=self.max_positions, sha256=self.digest["sha256"] if self.digest else None)

    # -- the run's model (``run_model.RunModel``) ---------------------------------------------

    #: a folder's model records no per-layer gradient norms (its layers are not attnres's)
    layer_statistics = False

    def check(self, cfg, device: torch.device) -> None:
        check_fits(cfg, self)

    def fit_data(self, cfg, run_dir: Path, corpus):
        """The folder's model keeps its own vocabulary, which must hold every token."""
        corpus = corpus or load_corpus(cfg.data, self.vocab_size, bpe_dir=run_dir, tokenizer=self.tokenizer)
        check_tokens(cfg.data, corpus, self)
        return cfg, corpus

    def check_memory(self, cfg, device: torch.device, plan) -> None:
        """Nothing to estimate: the model is read whole by each rank, its size the folder's."""

    def instantiate(self, cfg, place):
        """The model read whole by every rank, with the folder's weights (FSDP2 then keeps each
        rank's shards); never pipelined."""
        r, device, plan = cfg.run, place.info.device, place.plan
        torch.manual_seed(r.seed)  # what the folder's model draws (a router's jitter, dropout) follows the seed
        model = self.build(torch.device("cpu") if plan.wrapping == "fsdp" else device)
        wrapped = dist.wrap(model, plan.wrapping, self.fsdp_units(model) if plan.wrapping == "fsdp" else None)
        return model, wrapped, torch.compile(wrapped) if r.compile else wrapped, None

    def expert_steps(self, cfg, model: nn.Module, device: torch.device):
        return None if self.balance_weight is None else SavedExperts(cfg.run.grad_accum, device, self.balance_weight)

    def residual_name(self, cfg) -> str:
        return self.architecture

    def parameter_total(self, cfg) -> int:
        return self.parameters

    def summary_entries(self) -> dict:
        return dict(init_from=self.describe())

    def run_name(self, cfg) -> str:
        return Path(self.folder).name

    def checkpoint_model(self, cfg) -> None:
        """None: the checkpoint's state is checked by its contents, its weights by their names."""
        return None

    def checkpoint_mismatch(self, cfg) -> str:
        return (f"; the model of {cfg.init_from} is not the one the run started from: was that folder "
                f"replaced?")

    def run_config(self, cfg):
        return dataclasses.replace(cfg, init_from=str(self.folder), init_from_digest=self.digest)

    def trained_module(self, run_dir: Path, checkpoint: Path) -> None:
        """None: no depth weights are captured of a folder's model."""
        return None

    def analysis(self, model, corpus, cfg) -> None:
        return None


def logits_of(outputs) -> torch.Tensor:
    """The logits of a folder model's forward (``(logits, balance)`` for a mixture of experts)."""
    return outputs[0] if isinstance(outputs, tuple) else outputs


class SavedExperts:
    """The mixture-of-experts side of each optimizer step of a folder model (the interface of
    ``steps.ExpertSteps``): each micro-batch's loss is the language model's plus the routers'
    balance loss times ``weight``; ``lm`` is the step's language-model loss (what the log
    reports) and ``finish`` logs the balance loss apart (``moe_aux_loss``, before its weight, as
    for attnres's own MoE)."""

    def __init__(self, grad_accum: int, device: torch.device, weight: float):
        self.grad_accum, self.weight = grad_accum, weight
        self.lm = torch.zeros((), device=device)
        self.balance = torch.zeros((), device=device)

    def start(self) -> None:
        self.lm.zero_()
        self.balance.zero_()

    def loss(self, forward, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        logits, balance = forward(xs)
        lm = lm_loss(logits, ys)
        self.lm.add_(lm.detach() / self.grad_accum)
        self.balance.add_(balance.detach() / self.grad_accum)
        return lm + self.weight * balance

    def finish(self, logging: bool) -> dict:
        return dict(moe_aux_loss=float(dist.mean_across_ranks(self.balance))) if logging else {}


def check_fits(cfg, folder: SavedModel | None) -> None:
    """A run with ``init_from`` (a ``TrainConfig``) is handed that folder's model, whose context
    holds ``run.seq_len``, which has routing parameters where ``optim.routing_lr_scale`` scales
    them, which has the tokenizer ``data.tokenizer='model'`` asks for and, when
    the run recorded the folder's digest (``init_from_digest``), whose files are the ones it
    recorded; a run without one is handed none."""
    if cfg.init_from is None:
        if folder is not None:
            raise ValueError(f"a folder's model ({folder.folder}) was handed to a run without init_from")
        return
    if folder is None:
        raise ValueError(f"init_from={cfg.init_from!r}: the run continues that folder's model, which the trainer is "
                         f"handed read (attnres.hf.training.saved_model)")
    if Path(cfg.init_from) != Path(folder.folder):
        raise ValueError(f"init_from={cfg.init_from!r} but the model handed over is {folder.folder}")
    recorded, now = cfg.init_from_digest, folder.digest
    if recorded is not None and now is not None and recorded["sha256"] != now["sha256"]:
        raise ValueError(f"the model in {folder.folder} changed since the run started from it "
                         f"({'; '.join(changes(recorded, now))}): the run continues the model it started from")
    if cfg.run.seq_len > folder.max_positions:
        raise ValueError(f"run.seq_len={cfg.run.seq_len} exceeds the context of the model in {folder.folder} "
                         f"(max_position_embeddings={folder.max_positions})")
    if cfg.optim.routing_lr_scale != 1.0 and not folder.routing_parameters:
        raise ValueError(f"optim.routing_lr_scale={cfg.optim.routing_lr_scale} scales the learning rate of the "
                         f"routing parameters, and the model in {folder.folder} ({folder.architecture}) has none: "
                         f"convert it first (attnres convert), or leave the setting out")
    if cfg.data.tokenizer == "model" and folder.tokenizer is None:
        raise ValueError(f"data.tokenizer='model' reads the tokenizer of {folder.folder}, which holds none: "
                         f"use data.tokenizer='byte' for a model of 256 or more byte tokens")


def check_tokens(data, corpus, folder: SavedModel) -> None:
    """Every token id of ``corpus`` (read as ``data``, a ``DataConfig``, says) is a row of the
    embedding of ``folder``'s model: an id past it would be an index error (a device assert on a
    GPU). ``ValueError`` naming what made the ids (the folder's tokenizer, the bytes, token files)
    and what would fit."""
    top = max(int(corpus.train.max(initial=0)), int(corpus.val.max(initial=0)))
    if top < folder.vocab_size:
        return
    model = f"the model in {folder.folder} embeds {folder.vocab_size} tokens"
    size = len(folder.tokenizer) if hasattr(folder.tokenizer, "__len__") else None
    if (Path(data.source).expanduser() / "train.bin").is_file():
        raise ValueError(f"the token files in {data.source} hold ids up to {top}, and {model}: they were made with "
                         f"another tokenizer than the model's")
    if data.tokenizer == "model":
        raise ValueError(f"the folder's own tokenizer (data.tokenizer='model'{f', {size} tokens' if size else ''}) gives "
                         f"ids up to {top}, and {model}: the tokenizer saved in the folder is not its model's; save "
                         f"the model's own tokenizer there")
    if folder.tokenizer is None:
        raise ValueError(f"the data's bytes (data.tokenizer='byte') reach id {top}, and {model}, fewer than the 256 "
                         f"bytes; the folder holds no tokenizer of its own: save the model's tokenizer in it "
                         f"(data.tokenizer='model' then reads it)")
    if size is not None and size > folder.vocab_size:
        raise ValueError(f"the data's bytes (data.tokenizer='byte') reach id {top}, and {model}; the folder's own "
                         f"tokenizer ({size} tokens) does not fit it either: save the model's own tokenizer in it")
    raise ValueError(f"the data's bytes (data.tokenizer='byte') reach id {top}, and {model}: use the folder's own "
                     f"tokenizer (data.tokenizer='model', {size or 'its'} tokens)")
