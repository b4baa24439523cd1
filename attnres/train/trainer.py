"""The training loop: AdamW with parameter groups, warmup then cosine/WSD, clipping, gradient
accumulation, bf16 autocast on GPU, optional torch.compile, periodic evaluation, checkpoints that
survive crashes and signals, and metrics as JSONL (plus TensorBoard when installed)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import threading
import time
import warnings
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..model import Transformer, lm_loss, param_groups
from ..moe import ExpertStats, expert_load
from . import distributed as dist
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint, save_checkpoint
from .config import OptimConfig, TrainConfig, to_dict
from .data import Corpus, batch_at, check_length, load_corpus
from .pipeline import build_pipeline, check_pipeline, pipeline_groups

EVAL_SEED = 20_260_315  # evaluation batches are the same for every run and design


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; the last good checkpoint is kept."""


@dataclass
class TrainResult:
    model: Transformer
    summary: dict
    corpus: Corpus
    interrupted: bool = False


def lr_at(step: int, total: int, cfg: OptimConfig) -> float:
    """Learning rate of optimizer step ``step`` (0-based) out of ``total``."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return cfg.lr
    floor = cfg.lr * cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        progress = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
        return floor + (cfg.lr - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    decay_start = int(total * (1 - cfg.decay_fraction))  # wsd: warmup, stable, linear decay
    if step < decay_start:
        return cfg.lr
    return cfg.lr + (floor - cfg.lr) * (step - decay_start + 1) / max(1, total - decay_start)


def peak_memory_mib(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def layer_grad_norms(model: Transformer) -> list[float]:
    """L2 norm of each transformer layer's parameter gradients."""
    norms = []
    for layer in model.layers:
        sq = sum(float(p.grad.detach().float().pow(2).sum()) for p in layer.parameters() if p.grad is not None)
        norms.append(math.sqrt(sq))
    return norms


def step_counts(stats: list[ExpertStats]) -> torch.Tensor:
    """One optimizer step's assignments per MoE layer and expert ``[L, E]``, summed over its
    micro-batches' ``stats`` and over ranks."""
    return dist.sum_across_ranks(torch.stack([s.load() for s in stats]).sum(0))


def expert_record(stats: list[ExpertStats], counts: torch.Tensor) -> dict:
    """The log's MoE fields for one optimizer step (``counts`` from ``step_counts``):
    ``expert_load`` (the fraction of assignments per expert, per MoE layer),
    ``expert_imbalance`` (the most loaded expert's fraction times E, mean over layers; 1.0 is
    balanced), ``moe_aux_loss`` (the balance loss before its weight) and, with a capacity,
    ``expert_dropped`` (the fraction of assignments dropped)."""
    load = expert_load(counts)
    record = dict(expert_load=[[round(float(f), 6) for f in row] for row in load],
                  expert_imbalance=float((load.max(-1).values * load.shape[-1]).mean()),
                  moe_aux_loss=float(dist.mean_across_ranks(torch.stack([s.aux_loss().detach() for s in stats]).mean())))
    if stats[0].dropped:
        dropped = dist.sum_across_ranks(torch.stack([torch.stack(s.dropped).sum() for s in stats]).sum())
        record["expert_dropped"] = float(dropped / counts.sum())
    return record


def accumulate_gradients(loss_of, x: torch.Tensor, y: torch.Tensor, grad_accum: int = 1,
                         context=lambda k: nullcontext()) -> torch.Tensor:
    """The gradients of one optimizer step: ``x, y`` ``[B, T]`` split into ``grad_accum`` equal
    micro-batches, each ``loss_of(xs, ys) / grad_accum`` backpropagated inside ``context(k)``
    (``k``: the micro-batch). Returns the step's loss, a detached scalar. The caller zeroes the
    gradients before and clips and steps after."""
    micro = x.shape[0] // grad_accum
    total = torch.zeros((), device=x.device)
    for k in range(grad_accum):
        with context(k):
            loss = loss_of(x[k * micro : (k + 1) * micro], y[k * micro : (k + 1) * micro]) / grad_accum
        loss.backward()
        total += loss.detach()
    return total


@torch.no_grad()
def evaluate(model, tokens, cfg: TrainConfig, info: dist.DistInfo, autocast, dp_rank: int | None = None,
             dp_size: int | None = None) -> float:
    """Mean validation loss over ``run.eval_batches`` fixed batches (the same for every run),
    each split over the ``dp_size`` data-parallel ranks (default: every rank; the ranks of one
    pipeline, which all hold the whole model, evaluate the same part)."""
    r = cfg.run
    dp_rank, dp_size = (info.rank, info.world_size) if dp_size is None else (dp_rank, dp_size)
    was_training = model.training
    model.eval()
    per_rank = r.batch_size // dp_size
    losses = []
    for i in range(r.eval_batches):
        x, y = batch_at(tokens, r.batch_size, r.seq_len, EVAL_SEED, i)
        x, y = x[dp_rank * per_rank : (dp_rank + 1) * per_rank], y[dp_rank * per_rank : (dp_rank + 1) * per_rank]
        with autocast():
            losses.append(lm_loss(model(x.to(info.device)), y.to(info.device)))
    model.train(was_training)
    return float(dist.mean_across_ranks(torch.stack(losses).mean()))


class _Signals:
    """SIGINT/SIGTERM set a flag; the loop saves a checkpoint and stops at the next step."""

    def __init__(self):
        self.received: int | None = None
        self._previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signum

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def truncate_log(path: Path, step: int) -> None:
    """Drop the rows of the JSONL log ``path`` written after ``step``: a run that stopped after
    its checkpoint at ``step`` logged them, and resuming from that checkpoint logs them again.
    A row cut short by a crash is dropped too. The file is replaced atomically."""
    if not path.exists():
        return
    lines = path.read_text().splitlines()
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] <= step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    if len(kept) != len(lines):
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text("".join(line + "\n" for line in kept))
        os.replace(tmp, path)


class _Metrics:
    """JSONL metrics on the main rank, mirrored to TensorBoard when it is installed. Resuming
    from the checkpoint at ``resume_step`` first drops what was logged after it."""

    def __init__(self, run_dir: Path, enabled: bool, tensorboard: bool, resume_step: int | None = None):
        self.enabled = enabled
        if enabled and resume_step is not None:
            truncate_log(run_dir / "metrics.jsonl", resume_step)
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None
        self.tb = None
        if enabled and tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: events at later steps, from before a crash, are discarded
                purge = None if resume_step is None else resume_step + 1
                self.tb = SummaryWriter(str(run_dir / "tensorboard"), purge_step=purge)
            except ImportError:
                warnings.warn("tensorboard is not installed: metrics go to metrics.jsonl only", stacklevel=2)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.tb is not None:
            split, step = record["split"], record["step"]
            for k, v in record.items():
                if k not in ("step", "tokens", "split") and isinstance(v, (int, float)):
                    self.tb.add_scalar(f"{split}/{k}", v, step)
            for layer, load in enumerate(record.get("expert_load") or ()):
                for expert, fraction in enumerate(load):
                    self.tb.add_scalar(f"{split}/expert_load/layer{layer}/expert{expert}", fraction, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.tb is not None:
            self.tb.close()


@contextmanager
def micro_step(wrapped, no_sync: bool, autocast):
    """A micro-batch's forward: gradient synchronization held back until the last one, autocast."""
    with dist.no_sync(wrapped, no_sync), autocast():
        yield


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, unit="step", dynamic_ncols=True, leave=False)


#: what a run writes into its folder (``overwrite`` removes these and nothing else)
RUN_FILES = ("config.json", "summary.json", "metrics.jsonl", "checkpoints", "tensorboard")


def check_run_dir(run_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse, before any work, to start a new run in a folder that holds one (its config,
    checkpoints and log would be overwritten or appended to) unless ``resume`` or
    ``overwrite``; with ``overwrite`` the old run's files go."""
    held = [name for name in RUN_FILES if (run_dir / name).exists()]
    if not held or resume:
        return
    if not overwrite:
        raise ValueError(f"{run_dir} already holds a run ({', '.join(held)}); continue it with --resume "
                         "or start over with --overwrite")
    for name in held:
        path = run_dir / name
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def train(cfg: TrainConfig, run_dir: Path, *, corpus: Corpus | None = None, resume: bool = False,
          overwrite: bool = False) -> TrainResult:
    """Train one model as ``cfg`` says, writing into ``run_dir``; returns the model and summary.

    ``resume=True`` continues from ``run_dir``'s latest checkpoint exactly where it stopped. A
    folder that already holds a run is refused unless ``resume`` or ``overwrite`` (which removes
    that run's files first).
    """
    cfg.validate()
    check_run_dir(Path(run_dir), resume, overwrite)
    r, o = cfg.run, cfg.optim
    pipelined = r.pp_size > 1
    world = dist.launched_world_size()
    if pipelined and world % r.pp_size:  # before any process waits on another
        raise ValueError(f"run.pp_size={r.pp_size} must divide the job's {world} processes (torchrun "
                         f"--nproc_per_node=N, N a multiple of {r.pp_size}: the pipelines run side by side)")
    if pipelined:  # each copy of the pipeline splits its part of the batch into the micro-batches
        copies = world // r.pp_size
        if r.batch_size % copies:
            raise ValueError(f"run.batch_size={r.batch_size} must be divisible by the {copies} copies of the pipeline")
        check_pipeline(r.pp_schedule, r.pp_size, cfg.model.num_sublayers, r.batch_size // copies, r.pp_microbatches,
                       r.pp_stages_per_rank, r.pp_split)
    if pipelined and r.parallel != "ddp":
        raise ValueError(f"run.pp_size={r.pp_size}: the copies of a pipeline average their gradients as DDP does; "
                         f"run.parallel={r.parallel!r} is not supported with it")
    info = dist.setup(cfg.run.device)
    # the data-parallel ranks split the batch; the ranks of one pipeline all see their replica's part
    pipeline_group = replicas = None
    if pipelined:
        pipeline_group, replicas, dp_rank, dp_size = pipeline_groups(r.pp_size)
    else:
        dp_rank, dp_size = info.rank, info.world_size
    if r.batch_size % (dp_size * r.grad_accum):
        raise ValueError(
            f"run.batch_size={r.batch_size} must be divisible by world size {info.world_size} x "
            f"run.grad_accum={r.grad_accum}"
        )
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    corpus = corpus or load_corpus(cfg.data, cfg.model.vocab_size, bpe_dir=run_dir)
    if corpus.vocab_size != cfg.model.vocab_size:
        cfg = replace(cfg, model=replace(cfg.model, vocab_size=corpus.vocab_size))
    check_length(corpus.train, r.seq_len, "training")
    check_length(corpus.val, r.seq_len, "validation")

    torch.manual_seed(r.seed)
    model = Transformer(cfg.model).to(info.device)
    wrapped = model if pipelined else dist.wrap(model, r.parallel, info)
    forward = torch.compile(wrapped) if r.compile else wrapped
    pipe = (build_pipeline(model, r.pp_schedule, r.pp_microbatches, per_rank=r.pp_stages_per_rank, split=r.pp_split,
                           group=pipeline_group, replicas=replicas, device=info.device, cache=r.pp_cache)
            if pipelined else None)
    optimizer = torch.optim.AdamW(param_groups(model, o.weight_decay), lr=o.lr, betas=(o.beta1, o.beta2))
    autocast = (
        (lambda: torch.autocast("cuda", dtype=torch.bfloat16))
        if info.device.type == "cuda" and r.autocast == "auto" else nullcontext
    )

    ckpt_root = run_dir / "checkpoints"
    start_step, grad_norm_sums, grad_norm_count = 0, None, 0
    if resume:
        path = latest_checkpoint(ckpt_root)
        if path is None:
            raise CheckpointError(f"--resume: no checkpoint in {ckpt_root}")
        weights, state = load_checkpoint(path, cfg.model)
        dist.load_full_state(model, optimizer, weights, state["optimizer"], info)
        torch.set_rng_state(state["rng"])
        start_step = int(state["step"])
        if start_step >= r.steps:
            raise ValueError(
                f"the run in {run_dir} already finished its {start_step} steps; resume with "
                f"--set run.steps=N (N > {start_step}) to train further"
            )
        grad_norm_sums, grad_norm_count = state.get("grad_norm_sums"), int(state.get("grad_norm_count", 0))
        if grad_norm_sums is not None:
            grad_norm_sums = grad_norm_sums.tolist()

    if info.is_main:
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=2))
    metrics = _Metrics(run_dir, info.is_main, r.tensorboard, start_step if resume else None)
    tokens_per_step = r.batch_size * r.seq_len
    per_rank = r.batch_size // dp_size
    record_from = int(r.steps * 0.9)  # gradient norms are averaged over the last 10% of steps

    def save(step: int) -> None:
        model_state, optim_state = dist.full_state(model, optimizer, info)
        if info.is_main:
            train_state = dict(
                optimizer=optim_state, rng=torch.get_rng_state(), step=step, config=to_dict(cfg),
                grad_norm_sums=torch.tensor(grad_norm_sums) if grad_norm_sums is not None else None,
                grad_norm_count=grad_norm_count,
            )
            save_checkpoint(ckpt_root, step, model_state, train_state)
        dist.barrier()

    moe = bool(cfg.model.moe_experts)
    step_stats: list[ExpertStats] = []  # the MoE routing of the current step's micro-batches
    step_lm = torch.zeros((), device=info.device)  # an MoE step's loss without the balance loss

    def loss_of(xs, ys):
        if not moe:
            return lm_loss(forward(xs), ys)
        experts = ExpertStats()
        step_stats.append(experts)
        lm = lm_loss(forward(xs, experts=experts), ys)
        step_lm.add_(lm.detach() / r.grad_accum)
        return lm + model.moe_aux_loss(experts)

    step_time, val_loss, interrupted, last_loss = 0.0, None, False, float("nan")
    bar = _progress(r.steps, start_step, r.progress and info.is_main)
    model.train()
    try:
        with _Signals() as signals:
            for step in range(start_step, r.steps):
                lr = lr_at(step, r.steps, o)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                start = time.perf_counter()
                x, y = batch_at(corpus.train, r.batch_size, r.seq_len, r.seed, step)
                x = x[dp_rank * per_rank : (dp_rank + 1) * per_rank].to(info.device)
                y = y[dp_rank * per_rank : (dp_rank + 1) * per_rank].to(info.device)
                optimizer.zero_grad(set_to_none=True)
                step_stats.clear()
                step_lm.zero_()
                if pipelined:
                    loss_sum = pipe.step(x, y)
                else:
                    loss_sum = accumulate_gradients(loss_of, x, y, r.grad_accum,
                                                    lambda k: micro_step(wrapped, k < r.grad_accum - 1, autocast))
                if moe:  # the logged loss is the language model's; the balance loss is logged apart
                    loss_sum = step_lm
                last_loss = float(dist.mean_across_ranks(loss_sum))
                if not math.isfinite(last_loss):
                    raise TrainingDiverged(
                        f"loss is {last_loss} at step {step + 1}; stopping. The last good checkpoint "
                        f"({latest_checkpoint(ckpt_root) or 'none yet'}) is kept; lower optim.lr or raise optim.warmup_steps"
                    )
                grad_norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip))
                if step >= record_from and not info.distributed:
                    norms = layer_grad_norms(model)
                    grad_norm_sums = norms if grad_norm_sums is None else [a + b for a, b in zip(grad_norm_sums, norms)]
                    grad_norm_count += 1
                optimizer.step()
                done = step + 1
                logging = done % r.log_every == 0 or done == r.steps
                if moe and (logging or cfg.model.moe_balance == "bias"):
                    counts = step_counts(step_stats)
                    model.update_expert_bias(counts)  # nothing for the "aux" balance
                    routing = expert_record(step_stats, counts) if logging else {}
                step_time += time.perf_counter() - start
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(loss=f"{last_loss:.3f}", tok_s=f"{tokens_per_step * (done - start_step) / step_time:.0f}")
                if logging:
                    metrics.log(dict(split="train", step=done, tokens=done * tokens_per_step, loss=last_loss,
                                     lr=lr, grad_norm=grad_norm,
                                     tokens_per_s=tokens_per_step * (done - start_step) / step_time,
                                     **(routing if moe else {})))
                if done % r.eval_every == 0 or done == r.steps:
                    val_loss = evaluate(forward, corpus.val, cfg, info, autocast, dp_rank, dp_size)
                    metrics.log(dict(split="val", step=done, tokens=done * tokens_per_step, val_loss=val_loss))
                    if bar is not None:
                        bar.write(f"step {done}: val loss {val_loss:.4f}")
                if dist.broadcast_flag(signals.received is not None, info):
                    save(done)
                    interrupted = True
                    break
                if r.ckpt_every and done % r.ckpt_every == 0 and done < r.steps:
                    save(done)
            else:
                save(r.steps)
    finally:
        if bar is not None:
            bar.close()
        metrics.close()

    steps_run = max(1, (r.steps if not interrupted else done) - start_step)
    summary = dict(
        residual=cfg.model.residual,
        steps=r.steps if not interrupted else done,
        tokens=(r.steps if not interrupted else done) * tokens_per_step,
        final_train_loss=last_loss,
        final_val_loss=val_loss,
        parameters=sum(p.numel() for p in model.parameters()),
        step_time_s=step_time / steps_run,
        tokens_per_s=tokens_per_step * steps_run / step_time if step_time else float("nan"),
        peak_memory_mib=peak_memory_mib(info.device),
        layer_grad_norms=[s / grad_norm_count for s in grad_norm_sums] if grad_norm_count else None,
        interrupted=interrupted,
        data=corpus.description,
        world_size=info.world_size,
    )
    if info.is_main:
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return TrainResult(model, summary, corpus, interrupted)
