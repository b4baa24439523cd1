"""What training needs of a model, whichever kind a run trains (``RunModel``), attnres's own
model as one (``OwnModel``), and the run's data fitted to its model (``load_data``).

A run trains attnres's own ``Transformer`` (its config's ``model`` section) or the model of a
saved folder (``init_from``, ``attnres train --from``: ``saved_model.SavedModel``, which the
layer that reads the folder's format makes). The command makes the run's ``RunModel`` once and
hands it to ``trainer.train``; past that point nothing asks which kind it has: each question
whose answer differs between the two is a method here, answered by the model itself.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from ..model import Transformer
from . import distributed as dist
from .config import TrainConfig
from .data import Corpus, check_length, load_corpus
from .materialize import rank_model
from .pipeline import Pipeline, build_pipeline
from .resources import check_memory
from .stage_local import parameter_count
from .steps import ExpertSteps
from .validate import check_backend

if TYPE_CHECKING:
    from .parallel_plan import ParallelPlan
    from .run_start import Placement

#: what ``RunModel.instantiate`` returns: ``(model, wrapped, forward, pipe)``
Instantiated = tuple[nn.Module, nn.Module, nn.Module, Pipeline | None]


class RunModel(Protocol):
    """What training needs of the model a run trains. Each method takes the run's settings
    (``cfg``, a ``TrainConfig``) where its answer depends on them."""

    #: whether the run records each layer's gradient norms (one process), which a comparison
    #: reads beside the depth weights it captures of the trained model
    layer_statistics: bool

    def check(self, cfg: TrainConfig, device: torch.device) -> None:
        """``ValueError`` unless the model fits the run's settings on ``device`` (the run's
        context, its learning-rate scales, its tokenizer, an explicit routing backend)."""

    def fit_data(self, cfg: TrainConfig, run_dir: Path, corpus: Corpus | None) -> tuple[TrainConfig, Corpus]:
        """``corpus``, or the one ``cfg.data`` names read with the model's tokenizer, and ``cfg``
        with the vocabulary the run trains (``ValueError`` for a token the model cannot embed)."""

    def check_memory(self, cfg: TrainConfig, device: torch.device, plan: ParallelPlan) -> None:
        """``ValueError`` when the model's weights and optimizer state do not fit ``device``."""

    def instantiate(self, cfg: TrainConfig, place: Placement) -> Instantiated:
        """``(model, wrapped, forward, pipe)``: the model on this process's device (its rank's
        part where the plan splits it), ``wrapped`` for data parallelism (its FSDP units),
        ``forward`` what a micro-batch runs through, ``pipe`` this rank's pipeline stages or None."""

    def expert_steps(self, cfg: TrainConfig, model: nn.Module, device: torch.device):
        """The mixture-of-experts side of each step (``steps.ExpertSteps``'s interface), or None."""

    def residual_name(self, cfg: TrainConfig) -> str:
        """``summary.json``'s ``residual``: the residual design, or the folder's architecture."""

    def parameter_total(self, cfg: TrainConfig) -> int:
        """The model's parameter elements (a tied weight once), ``summary.json``'s ``parameters``."""

    def summary_entries(self) -> dict:
        """What else ``summary.json`` records of the model (``{}`` for attnres's own)."""

    def run_name(self, cfg: TrainConfig) -> str:
        """The default name of the run's folder (before its timestamp)."""

    def checkpoint_model(self, cfg: TrainConfig):
        """The model config a resumed run's checkpoint is checked against, weights and state
        (``checkpoint.load_checkpoint``), or None where the weights' names are checked on loading."""

    def checkpoint_mismatch(self, cfg: TrainConfig) -> str:
        """What a checkpoint's weights that do not fit the model may mean, appended to the refusal."""

    # -- what a comparison asks of its runs' models

    def run_config(self, cfg: TrainConfig) -> TrainConfig:
        """``cfg`` as a run of this model takes it (a folder's: naming the folder and its digest)."""

    def trained_module(self, run_dir: Path, checkpoint: Path) -> nn.Module | None:
        """The model a finished run in ``run_dir`` trained, with ``checkpoint``'s weights, for
        the analysis (None where nothing of it is analysed)."""

    def analysis(self, model: nn.Module | None, corpus: Corpus, cfg: TrainConfig) -> dict | None:
        """What a comparison records of the trained ``model`` (``analysis.json``): attnres's own
        model's depth weights and probes on the first validation batch; None for a folder's
        (a comparison measures its routing's movement from the folder instead)."""


class OwnModel:
    """attnres's own ``Transformer``, as ``cfg.model`` describes it (a ``RunModel``)."""

    layer_statistics = True

    def check(self, cfg: TrainConfig, device: torch.device) -> None:
        if cfg.init_from is not None:
            raise ValueError(f"init_from={cfg.init_from!r}: the run continues that folder's model, which the trainer "
                             f"is handed read (attnres.hf.training.saved_model)")
        check_backend(cfg.model, device)  # an explicit backend that runs there

    def fit_data(self, cfg: TrainConfig, run_dir: Path, corpus: Corpus | None) -> tuple[TrainConfig, Corpus]:
        from dataclasses import replace

        corpus = corpus or load_corpus(cfg.data, cfg.model.vocab_size, bpe_dir=run_dir)
        if corpus.vocab_size != cfg.model.vocab_size:
            cfg = replace(cfg, model=replace(cfg.model, vocab_size=corpus.vocab_size))
        return cfg, corpus

    def check_memory(self, cfg: TrainConfig, device: torch.device, plan: ParallelPlan) -> None:
        check_memory(cfg, device, plan)

    def instantiate(self, cfg: TrainConfig, place: Placement) -> Instantiated:
        """The model initialized from ``run.seed`` (one process's values under every layout: a
        distributed rank builds it on the meta device and materializes only its part,
        ``materialize.rank_model``)."""
        r, device, plan = cfg.run, place.info.device, place.plan
        # FSDP2 moves each module it shards to the device and keeps the shard: the part waits on the host
        if plan.pipelined:
            part = plan.part(plan.pipeline_rank(place.info.rank))
            model = rank_model(cfg.model, r.seed, part, "cpu" if plan.shards_stages else device)
            pipe = build_pipeline(model, plan, place.groups, device)
            return model, model, model, pipe
        if place.info.distributed:
            model = rank_model(cfg.model, r.seed, plan.part(0), "cpu" if plan.wrapping == "fsdp" else device)
        else:
            torch.manual_seed(r.seed)
            model = Transformer(cfg.model).to(device)
        wrapped = dist.wrap(model, plan.wrapping)
        return model, wrapped, torch.compile(wrapped) if r.compile else wrapped, None

    def expert_steps(self, cfg: TrainConfig, model: nn.Module, device: torch.device) -> ExpertSteps | None:
        return ExpertSteps(model, cfg.run.grad_accum, device) if cfg.model.moe_experts else None

    def residual_name(self, cfg: TrainConfig) -> str:
        return cfg.model.residual

    def parameter_total(self, cfg: TrainConfig) -> int:
        return parameter_count(cfg.model)

    def summary_entries(self) -> dict:
        return {}

    def run_name(self, cfg: TrainConfig) -> str:
        return cfg.model.residual

    def checkpoint_model(self, cfg: TrainConfig):
        return cfg.model

    def checkpoint_mismatch(self, cfg: TrainConfig) -> str:
        return ""

    def run_config(self, cfg: TrainConfig) -> TrainConfig:
        return cfg

    def trained_module(self, run_dir: Path, checkpoint: Path) -> Transformer:
        from ..files import read_json
        from .checkpoint import load_checkpoint
        from .config import from_dict

        model_config = from_dict(read_json(run_dir / "config.json")).model
        weights, _ = load_checkpoint(checkpoint, model_config)
        model = Transformer(model_config)
        model.load_state_dict(weights)
        return model

    def analysis(self, model: nn.Module | None, corpus: Corpus, cfg: TrainConfig) -> dict:
        from ..analysis.capture import capture_analysis
        from .data import EVAL_SEED, batch_at

        x, _ = batch_at(corpus.val, min(8, cfg.run.batch_size), cfg.run.seq_len, EVAL_SEED, 0)
        return capture_analysis(model, x)


def load_data(cfg: TrainConfig, run_dir: Path, corpus: Corpus | None = None,
              model: RunModel | None = None) -> tuple[TrainConfig, Corpus]:
    """``corpus``, or the one ``cfg.data`` names (a BPE tokenizer cached in ``run_dir``; the
    tokenizer of the folder a run continues, ``data.tokenizer='model'``), and ``cfg`` with
    the vocabulary ``model`` (default: attnres's own) trains (``RunModel.fit_data``: attnres's
    own takes the corpus's, a folder's model keeps its own, which must hold every token); both
    splits hold a sequence."""
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg, corpus = (model or OwnModel()).fit_data(cfg, run_dir, corpus)
    check_length(corpus.train, cfg.run.seq_len, "training")
    check_length(corpus.val, cfg.run.seq_len, "validation")
    return cfg, corpus
