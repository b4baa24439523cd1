"""The training loop: AdamW with parameter groups, warmup then cosine/WSD, clipping, gradient
accumulation, bf16 autocast on GPU, optional torch.compile, periodic evaluation, checkpoints that
survive crashes and signals, and metrics as JSONL (plus TensorBoard when installed).

``train`` runs a run's parts in order, each a function over the ``Run`` that ``start`` makes:

1. the checks, which read only: every setting and its placement on the job's processes
   (``validate.check_run``, which returns the run's parallel plan; skipped when the caller
   checked them and hands the plan over), the model against the settings and the device
   (``RunModel.check``),
   the run folder (``run_dir.check_run_dir``: its lock, its links, a run it holds) and, on a
   resume, the checkpoint (``resume_point``);
2. the run folder's lock (``train/lock.py``, rank 0), the data (``load_data``), the memory the
   model needs (``RunModel.check_memory``), then the processes (``start_processes``), every
   rank told of any refusal (``_prepare``);
3. ``start``: the model, wrapped for data parallelism or cut into pipeline stages
   (``RunModel.instantiate``), and the optimizer (each part made in ``train/run_start.py``); ``restore`` (``resume=True``): the checkpoint's
   weights, optimizer, RNG and statistics; only then does ``--overwrite`` remove the old run's
   files (``run_dir.remove_run``), and a refusal before this point leaves the folder as it was;
4. ``run_steps``: each optimizer step (``train_step``), logged, evaluated (``evaluate``) and
   checkpointed (``save``) when due; SIGINT/SIGTERM saves a checkpoint and stops;
5. ``summarize``: the run's numbers, written to ``summary.json``.
"""

from __future__ import annotations

import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..model import Transformer, lm_loss
from ..signals import Signals, exit_status
from . import distributed as dist
from . import lock
from .agreed_signal import agreed_signal
from .checkpoint import latest_checkpoint
from .config import TrainConfig, to_dict
from .data import EVAL_SEED, Corpus, batch_at
from .machine import machine
from .parallel_plan import ParallelPlan
from .pipeline import Pipeline
from .resources import peak_memory_mib
from .stage_local import rank_footprint
from .resume import machine_change, restore, resume_point, save, saved_machine
from .run_model import OwnModel, RunModel, load_data
from .run_start import Placement, autocast_for, build_optimizer, start_processes
from .run_files import Metrics, check_run_dir, no_trace_if_refused, remove_run, write_json
from .saved_model import SavedExperts, SavedModel, logits_of
from .steps import ExpertSteps, LayerGradNorms, accumulate_gradients, lr_at, micro_step
from .validate import check_run


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


@dataclass
class TrainResult:
    """The trained model, the run's summary and corpus; ``interrupted`` when a signal stopped
    the steps (``signal``: its number) after a checkpoint was saved."""

    model: Transformer
    summary: dict
    corpus: Corpus
    interrupted: bool = False
    signal: int | None = None

    @property
    def exit_code(self) -> int:
        """The command's exit status: 0, or 130 after SIGINT and 143 after SIGTERM."""
        return exit_status(self.signal)


# -- 3. start --------------------------------------------------------------------------------

@dataclass
class Run:
    """What the parts of one run share. ``start`` makes it; ``restore`` sets ``start_step`` and
    ``grad_norms`` from a checkpoint; each step advances the weights and ``grad_norms``.
    ``cfg`` carries the corpus's vocabulary size; ``experts`` is the MoE side of the steps (None
    for a dense model); ``model`` is the module ``spec`` (the run's ``RunModel``) instantiated:
    a ``Transformer``, or a folder's model."""

    cfg: TrainConfig
    run_dir: Path
    place: Placement
    corpus: Corpus
    model: nn.Module
    wrapped: nn.Module
    forward: nn.Module
    pipe: Pipeline | None
    optimizer: torch.optim.Optimizer
    autocast: Callable
    experts: ExpertSteps | SavedExperts | None
    spec: RunModel
    grad_norms: LayerGradNorms = field(default_factory=LayerGradNorms)
    start_step: int = 0
    #: called after each optimizer step with the step (0-based) and ``model`` (``train``'s ``on_step``)
    on_step: Callable | None = None

    @property
    def info(self) -> dist.DistInfo:
        return self.place.info

    @property
    def ckpt_root(self) -> Path:
        return self.run_dir / "checkpoints"

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.run.batch_size * self.cfg.run.seq_len

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """This rank's rows of step ``step``'s batch ``[B / dp_size, T]``, on its device."""
        r, place = self.cfg.run, self.place
        x, y = batch_at(self.corpus.train, r.batch_size, r.seq_len, r.seed, step)
        per_rank = r.batch_size // place.dp_size
        rows = slice(place.dp_rank * per_rank, (place.dp_rank + 1) * per_rank)
        return x[rows].to(self.info.device), y[rows].to(self.info.device)

    def loss(self, xs: torch.Tensor, ys: torch.Tensor) -> torch.Tensor:
        """One micro-batch's loss through ``forward`` (for MoE, with the weighted balance loss)."""
        if self.experts is not None:
            return self.experts.loss(self.forward, xs, ys)
        return lm_loss(self.forward(xs), ys)  # a folder's dense model returns logits alone too

    def save(self, step: int) -> None:
        """Checkpoint ``step`` (``resume.save``)."""
        save(self.ckpt_root, step, self.model, self.optimizer, self.cfg, self.grad_norms, self.info.distributed)

    def micro_batch(self, k: int):
        """Micro-batch ``k``'s context: DDP's gradient synchronization held back but for the
        last, autocast."""
        return micro_step(self.wrapped, k < self.cfg.run.grad_accum - 1, self.autocast)


def start(cfg: TrainConfig, run_dir: Path, corpus: Corpus, place: Placement, spec: RunModel | None = None) -> Run:
    """Everything a run needs before its first step, on the processes ``place`` and the data
    ``corpus`` (``load_data``) that ``train`` made and checked: the model ``spec`` (default:
    attnres's own) instantiated (``RunModel.instantiate``: initialized, wrapped and compiled or
    cut into pipeline stages) and the optimizer."""
    spec = spec or OwnModel()
    model, wrapped, forward, pipe = spec.instantiate(cfg, place)
    optimizer = build_optimizer(cfg.optim, model)
    device = place.info.device
    experts = spec.expert_steps(cfg, model, device)
    return Run(cfg, run_dir, place, corpus, model, wrapped, forward, pipe, optimizer,
               autocast_for(device, cfg.run.autocast), experts, spec)


# -- 4. the steps ----------------------------------------------------------------------------

@dataclass
class StepResult:
    """One optimizer step: its learning rate, loss (the mean over ranks; the language model's
    for MoE), gradient norm before clipping, MoE log fields (``{}`` unless logged) and seconds."""

    lr: float
    loss: float
    grad_norm: float
    routing: dict
    seconds: float


def compute_gradients(run: Run, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """This rank's gradients of the step's rows ``x, y``: through the pipeline's schedule, or in
    ``run.grad_accum`` micro-batches. Returns the step's loss (for MoE, without the balance loss)."""
    if run.pipe is not None:
        with run.autocast():  # bf16 on CUDA, as one process's micro-batches
            return run.pipe.step(x, y)
    if run.experts is not None:
        run.experts.start()
    loss = accumulate_gradients(run.loss, x, y, run.cfg.run.grad_accum, run.micro_batch)
    return run.experts.lm if run.experts is not None else loss


def train_step(run: Run, step: int, logging: bool) -> StepResult:
    """Optimizer step ``step`` (0-based): the learning rate set, the gradients, a non-finite loss
    refused (``TrainingDiverged``), clipping, the per-layer gradient norms recorded over the last
    10% of steps (one process), the update, and for MoE the balance bias (and, when ``logging``,
    the log's expert fields)."""
    r, o = run.cfg.run, run.cfg.optim
    lr = lr_at(step, r.steps, o)
    for group in run.optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    start_time = time.perf_counter()
    x, y = run.batch(step)
    run.optimizer.zero_grad(set_to_none=True)
    loss = float(dist.mean_across_ranks(compute_gradients(run, x, y)))
    if not math.isfinite(loss):
        raise TrainingDiverged(
            f"loss is {loss} at step {step + 1}; stopping. The last good checkpoint "
            f"({latest_checkpoint(run.ckpt_root) or 'none yet'}) is kept; lower optim.lr or raise optim.warmup_steps"
        )
    if run.pipe is not None:  # the norm of the whole model's gradients, summed over the pipeline
        grad_norm = run.pipe.clip_gradients(o.grad_clip)
    else:
        grad_norm = float(torch.nn.utils.clip_grad_norm_(run.model.parameters(), o.grad_clip))
    if step >= int(r.steps * 0.9) and not run.info.distributed and run.spec.layer_statistics:
        run.grad_norms.add(run.model)
    run.optimizer.step()
    if run.experts is None:
        routing = {}
    elif run.pipe is not None:  # the routing each rank's stages logged, summed over the pipeline
        routing = run.pipe.finish_experts(logging)
    else:
        routing = run.experts.finish(logging)
    return StepResult(lr, loss, grad_norm, routing, time.perf_counter() - start_time)


@torch.no_grad()
def evaluate(model, tokens, cfg: TrainConfig, info: dist.DistInfo, autocast, dp_rank: int | None = None,
             dp_size: int | None = None, pipe: Pipeline | None = None) -> float:
    """Mean validation loss over ``run.eval_batches`` fixed batches (the same for every run),
    each split over the ``dp_size`` data-parallel ranks (default: every rank; the ranks of one
    pipeline evaluate their copy's part through it, ``pipe``)."""
    r = cfg.run
    dp_rank, dp_size = (info.rank, info.world_size) if dp_size is None else (dp_rank, dp_size)
    was_training = model.training
    model.eval()
    per_rank = r.batch_size // dp_size
    losses = []
    for i in range(r.eval_batches):
        x, y = batch_at(tokens, r.batch_size, r.seq_len, EVAL_SEED, i)
        rows = slice(dp_rank * per_rank, (dp_rank + 1) * per_rank)
        x, y = x[rows].to(info.device), y[rows].to(info.device)
        with autocast():
            losses.append(pipe.evaluate(x, y) if pipe is not None else lm_loss(logits_of(model(x)), y))
    model.train(was_training)
    return float(dist.mean_across_ranks(torch.stack(losses).mean()))


@dataclass
class Progress:
    """How far the steps got: the last step done, the seconds spent in steps, the last training
    and validation losses (None before the first evaluation), and the signal that stopped them
    (None when they ran to the end)."""

    done: int
    step_time: float = 0.0
    last_loss: float = float("nan")
    val_loss: float | None = None
    signal: int | None = None
    #: this rank's parameters and their state after the job's first step (``rank_footprint``)
    footprint: dict | None = None

    @property
    def interrupted(self) -> bool:
        return self.signal is not None

    def add(self, done: int, result: StepResult) -> None:
        self.done, self.last_loss = done, result.loss
        self.step_time += result.seconds

    def tokens_per_s(self, run: Run) -> float:
        """Training throughput over this job's steps."""
        return run.tokens_per_step * (self.done - run.start_step) / self.step_time


def _progress_bar(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)


def run_steps(run: Run, metrics: Metrics, bar) -> Progress:
    """Optimizer steps from ``run.start_step`` to ``run.steps``, each logged every
    ``run.log_every``, evaluated every ``run.eval_every`` and checkpointed every
    ``run.ckpt_every`` (and at the end). A SIGINT or SIGTERM on any rank saves a checkpoint after
    the current step and stops every rank (``Progress.signal``: the signal, ``agreed_signal``)."""
    r = run.cfg.run
    progress = Progress(run.start_step)
    run.model.train()
    with Signals() as signals:
        for step in range(run.start_step, r.steps):
            done = step + 1
            logging = done % r.log_every == 0 or done == r.steps or done <= r.log_first
            result = train_step(run, step, logging)
            progress.add(done, result)
            if run.on_step is not None:
                run.on_step(step, run.model)
            if progress.footprint is None:
                progress.footprint = rank_footprint(run.model, run.optimizer)
            if bar is not None:
                bar.update(1)
                bar.set_postfix(loss=f"{result.loss:.3f}", tok_s=f"{progress.tokens_per_s(run):.0f}")
            if logging:
                metrics.log(dict(split="train", step=done, tokens=done * run.tokens_per_step, loss=result.loss,
                                 lr=result.lr, grad_norm=result.grad_norm, tokens_per_s=progress.tokens_per_s(run),
                                 **result.routing))
            if done % r.eval_every == 0 or done == r.steps:
                progress.val_loss = evaluate(run.forward, run.corpus.val, run.cfg, run.info, run.autocast,
                                             run.place.dp_rank, run.place.dp_size, run.pipe)
                metrics.log(dict(split="val", step=done, tokens=done * run.tokens_per_step, val_loss=progress.val_loss))
                if bar is not None:
                    bar.write(f"step {done}: val loss {progress.val_loss:.4f}")
            progress.signal = agreed_signal(signals.received, run.info)
            if progress.signal is not None:
                run.save(done)
                break
            if r.ckpt_every and done % r.ckpt_every == 0 and done < r.steps:
                run.save(done)
        else:
            run.save(r.steps)
    return progress


def run_logged(run: Run, resumed: bool) -> Progress:
    """``run_steps`` with the metrics log open (on a resume, cut back to its checkpoint) and the
    progress bar on the main rank; both closed however the steps end."""
    r = run.cfg.run
    metrics = Metrics(run.run_dir, run.info.is_main, r.tensorboard, run.start_step if resumed else None)
    bar = _progress_bar(r.steps, run.start_step, r.progress and run.info.is_main)
    try:
        return run_steps(run, metrics, bar)
    finally:
        if bar is not None:
            bar.close()
        metrics.close()


# -- 5. the summary --------------------------------------------------------------------------

def summarize(run: Run, progress: Progress) -> dict:
    """The run's numbers (``summary.json``): its steps and tokens, final losses, parameters,
    time and throughput over this job's steps, peak memory, mean per-layer gradient norms, a digest
    of the tokens read (``Corpus.digest``), the machine (``machine.machine``: runs reproduce bit
    for bit on one machine only)."""
    tokens_per_step = run.tokens_per_step
    steps_run = max(1, progress.done - run.start_step)
    return dict(
        residual=run.spec.residual_name(run.cfg),
        steps=progress.done,
        tokens=progress.done * tokens_per_step,
        final_train_loss=progress.last_loss,
        final_val_loss=progress.val_loss,
        parameters=run.spec.parameter_total(run.cfg),
        step_time_s=progress.step_time / steps_run,
        tokens_per_s=tokens_per_step * steps_run / progress.step_time if progress.step_time else float("nan"),
        peak_memory_mib=peak_memory_mib(run.info.device),
        layer_grad_norms=run.grad_norms.mean(),
        interrupted=progress.interrupted,
        data=run.corpus.description,
        data_sha256=run.corpus.digest(),
        world_size=run.info.world_size,
        parallel=run.place.plan.describe(),
        ranks=rank_entries(run, progress),
        machine=machine(run.info.device),
        **run.spec.summary_entries(),
    )


def rank_entries(run: Run, progress: Progress) -> list[dict]:
    """One entry per rank (collective under torchrun): its rank, its pipeline stages (empty
    without a pipeline), its parameter elements and the bytes of its parameters, gradients and
    optimizer state after the job's first step."""
    footprint = progress.footprint or rank_footprint(run.model, run.optimizer)
    entry = dict(rank=run.info.rank, stages=run.pipe.stage_indices if run.pipe is not None else [], **footprint)
    if not run.info.distributed:
        return [entry]
    entries = [None] * run.info.world_size
    torch.distributed.all_gather_object(entries, entry)
    return entries


def _prepare(cfg: TrainConfig, run_dir: Path, corpus: Corpus | None, plan: ParallelPlan,
             problem: Exception | None, spec: RunModel) -> tuple[TrainConfig, Corpus, Placement]:
    """The checks that need the data, then the processes: the data (``load_data``) and the
    memory the model needs (``check_memory``), unless ``problem`` (the lock refused) already
    stops the run; every rank learns of any rank's refusal once the process group starts
    (``dist.agree``), so that none waits on one that left."""
    if problem is None:
        try:
            cfg, corpus = load_data(cfg, run_dir, corpus, spec)
            spec.check_memory(cfg, dist.pick_device(cfg.run.device), plan)
        except ValueError as exc:
            problem = exc
    place = start_processes(cfg, plan)
    dist.agree(problem, place.info)
    return cfg, corpus, place


def train(cfg: TrainConfig, run_dir: Path, *, corpus: Corpus | None = None, resume: bool = False,
          overwrite: bool = False, model: RunModel | None = None, plan: ParallelPlan | None = None,
          folder: SavedModel | None = None, on_step: Callable | None = None) -> TrainResult:
    """Train one model as ``cfg`` says, writing into ``run_dir``; returns the model and summary.

    ``resume=True`` continues from ``run_dir``'s latest checkpoint exactly where it stopped. A
    folder that already holds a run is refused unless ``resume`` or ``overwrite`` (which removes
    that run's files once the new run has started: its settings, data, memory and model are
    known to be good). The job holds the folder's lock (``train/lock.py``) from its checks to
    its end; a refusal before the first step leaves the folder as it was.

    ``model`` is what the run trains (``run_model.RunModel``; default: attnres's own,
    ``OwnModel``). A run with ``cfg.init_from`` continues the model of that folder, read by the
    layer that knows its format and handed over as ``model`` (or ``folder``, the same:
    ``attnres.hf.training.saved_model``). ``plan`` is the run's parallel plan as
    ``validate.check_run(cfg, processes)`` returned it for the job's processes, when the caller
    checked the settings already; without it they are checked here.
    ``on_step(step, model)`` is called after each optimizer step (``step`` 0-based).
    """
    run_dir = Path(run_dir)
    spec = model or folder or OwnModel()
    processes, main = dist.launched_world_size(), dist.launched_rank() == 0
    if plan is None:
        plan = check_run(cfg, processes)  # before any process waits on another
    spec.check(cfg, dist.pick_device(cfg.run.device))  # the model fits the settings; a backend that runs there
    old_run = check_run_dir(run_dir, resume, overwrite, owner=main)  # reads only
    point = resume_point(cfg, run_dir, spec.checkpoint_model(cfg)) if resume else None
    locked = False
    try:
        with no_trace_if_refused(run_dir, main):
            problem = None
            if main:  # one lock per job, held by rank 0
                try:
                    lock.acquire(run_dir)
                    locked = True
                except lock.FolderInUse as exc:
                    problem = exc
            cfg, corpus, place = _prepare(cfg, run_dir, corpus, plan, problem, spec)
            run = start(cfg, run_dir, corpus, place, spec)
            run.on_step = on_step
            if point is not None:
                stopped_on = saved_machine(point, run_dir) if main else None
                run.start_step, run.grad_norms = restore(point, run.model, run.optimizer, run.cfg,
                                                         run.info.distributed, spec.checkpoint_mismatch(run.cfg))
                point = None  # the checkpoint's tensors now live in the model and the optimizer
                change = machine_change(stopped_on, machine(run.info.device), run_dir) if main else None
                if change is not None:
                    warnings.warn(change, RuntimeWarning, stacklevel=2)
            if main:
                remove_run(run_dir, old_run)
                write_json(run_dir / "config.json", to_dict(run.cfg))
        progress = run_logged(run, resume)
        summary = summarize(run, progress)
        if run.info.is_main:
            write_json(run_dir / "summary.json", summary)
    finally:
        if locked:
            lock.release(run_dir)
    return TrainResult(run.model, summary, run.corpus, progress.interrupted, progress.signal)
