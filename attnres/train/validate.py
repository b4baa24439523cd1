"""Every check of a run's settings, in one place and on plain values: a ``TrainConfig`` (its
fields read as numbers and strings) and the number of processes the job runs.

``check_run(cfg, processes)`` raises ``ValueError`` naming the field, its value and what it
accepts, before anything is written, allocated or started, and before any process waits on
another. In order:

1. each field's type and range (``FIELDS``), and a ``hf:`` source's token budget;
2. a run that builds its model or continues a folder's (``init_from``, ``check_model_kind``,
   the one check that asks which) and the settings that must agree with that kind of model (for
   attnres's own, the sequence length and the model's context, the learning-rate scales, the
   residual options, checked by the stream itself on the meta device), then the fields that
   must agree: the batch and the gradient accumulation, the seed, the device;
3. the pipeline's options (``run.pp_*``): only with ``run.pp_size > 1``, then agreeing with the
   schedule, the sublayers, the batch and the model, checked where the run's parallel plan is
   built (``parallel_plan.plan_parallel``, on the job's processes when they are given);
4. with ``processes`` given, the placement: the parallel plan on that many processes (a
   pipeline dividing the job, each copy's part of the batch), or without a pipeline the batch
   dividing over the data-parallel ranks and the gradient accumulation; the plan, built once,
   is what ``check_run`` returns.

``load_saved`` reads a run's saved ``config.json`` back and checks it the same way.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..model import ModelConfig
from ..streams import build_stream
from .config import DATA_SEED_STRIDE, DataConfig, OptimConfig, RunConfig, TrainConfig, check_types, from_dict
from .frozen_corpus import frozen
from .parallel_plan import CACHE_SETTINGS, PARALLEL_MODES, SCHEDULES, ParallelPlan, run_plan
from .source_digest import check_record


# -- 1. each field ---------------------------------------------------------------------------

@dataclass(frozen=True)
class Range:
    """The numbers a field accepts: from ``low`` to ``high`` (None: unbounded), each end closed
    unless marked open; whole numbers only for ``integer``; None too for ``none``."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    integer: bool = False
    none: bool = False

    def accepts(self, value) -> bool:
        if value is None:
            return self.none
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (self.integer and not isinstance(value, int)):
            return False
        if not math.isfinite(value):
            return False
        if self.low is not None and (value < self.low or (self.low_open and value == self.low)):
            return False
        return self.high is None or (value < self.high or (not self.high_open and value == self.high))

    def __str__(self) -> str:
        low = "-inf" if self.low is None else f"{self.low:g}"
        high = "inf" if self.high is None else f"{self.high:g}"
        text = f"{'(' if self.low_open or self.low is None else '['}{low}, {high}{')' if self.high_open or self.high is None else ']'}"
        text = ("an integer in " if self.integer else "in ") + text
        return text + (" or None" if self.none else "")


@dataclass(frozen=True)
class Choice:
    """The values a field accepts: one of ``options``."""

    options: tuple

    def accepts(self, value) -> bool:
        return value in self.options

    def __str__(self) -> str:
        return f"one of {self.options}"


def _count(low=1, **kw) -> Range:
    return Range(low, integer=True, **kw)


#: what each field accepts, checked by ``check_run`` before any work (the model's sizes and
#: residual options are checked by ``ModelConfig`` and the streams); docs/RELIABILITY.md lists them
FIELDS: dict[str, Range | Choice] = {
    "model.ffn_dim": _count(),
    "model.rope_theta": Range(0, low_open=True),
    "model.norm_eps": Range(0, low_open=True),
    "model.init_std": Range(0, low_open=True),
    "data.tokenizer": Choice(("byte", "bpe", "model")),
    "data.bpe_vocab_size": _count(257),  # the 256 bytes and at least one merge
    "data.val_fraction": Range(0, 1, low_open=True, high_open=True),
    "data.max_train_tokens": _count(none=True),
    "data.max_val_tokens": _count(none=True),
    "data.decode_errors": Choice(("strict", "replace")),
    "optim.lr": Range(0, low_open=True),
    "optim.weight_decay": Range(0),
    "optim.beta1": Range(0, 1, high_open=True),
    "optim.beta2": Range(0, 1, high_open=True),
    "optim.warmup_steps": _count(0),
    "optim.schedule": Choice(("cosine", "wsd", "constant")),
    "optim.min_lr_ratio": Range(0, 1),
    "optim.decay_fraction": Range(0, 1),
    "optim.grad_clip": Range(0, low_open=True),
    "optim.query_lr_scale": Range(0, low_open=True),
    "optim.routing_lr_scale": Range(0, low_open=True),
    "run.steps": _count(),
    "run.batch_size": _count(),
    "run.seq_len": _count(),
    "run.grad_accum": _count(),
    "run.seed": _count(0),
    "run.eval_every": _count(),
    "run.eval_batches": _count(),
    "run.log_every": _count(),
    "run.log_first": _count(0),
    "run.ckpt_every": _count(0),
    "run.autocast": Choice(("auto", "none")),
    "run.parallel": Choice(PARALLEL_MODES),
    "run.pp_size": _count(),
    "run.pp_schedule": Choice(SCHEDULES),
    "run.pp_microbatches": _count(none=True),
    "run.pp_stages_per_rank": _count(none=True),
    "run.pp_cache": Choice(CACHE_SETTINGS),
}


def check_fields(cfg: TrainConfig) -> None:
    """Every field of ``FIELDS`` within what it accepts (no ``model.*`` field for a run that
    continues a folder's model: it has none of its own)."""
    for key, accepted in FIELDS.items():
        section, name = key.split(".")
        if getattr(cfg, section) is None:
            continue
        value = getattr(getattr(cfg, section), name)
        if not accepted.accepts(value):
            raise ValueError(f"{key}={value!r} must be {accepted}")


def check_hf_source(data: DataConfig) -> None:
    """A ``hf:`` source (``data``, a ``DataConfig``) is streamed and tokenized up to
    ``data.max_train_tokens``, which it must set: its default, None, would tokenize the whole
    dataset (FineWeb-Edu's sample-10BT holds 10 billion tokens). Checked for a run's new
    settings (``commands.config_from_args``) and where the shards are made, not where a saved
    config is read back (a run of an older version, which read such a source whole, still
    exports and reports)."""
    if data.source.startswith("hf:") and data.max_train_tokens is None:
        raise ValueError(f"data.source={data.source!r} needs data.max_train_tokens, how many training tokens to "
                         f"stream and tokenize into its shards (e.g. --set data.max_train_tokens=1000000000); "
                         f"unset, the whole dataset would be tokenized")


# -- 2. the fields that must agree -----------------------------------------------------------

def check_model_kind(cfg: TrainConfig) -> None:
    """A run either builds attnres's own model (a ``model`` section) or continues a folder's
    (``init_from``): exactly one of the two, the folder's digest only with a folder; then the
    settings that must agree with that kind of model (``check_own_model``,
    ``check_folder_settings``). The one place the checks ask which kind a run trains."""
    if (cfg.model is None) == (cfg.init_from is None):
        raise ValueError("a run either builds its model (a model section) or continues a folder's model "
                         "(init_from, attnres train --from): exactly one of the two")
    if cfg.init_from is None and cfg.init_from_digest is not None:
        raise ValueError("init_from_digest is the digest of the folder a run continues (init_from); this run "
                         "builds its own model")
    check_record(cfg.init_from_digest, "the run's config")
    if cfg.model is not None:
        check_own_model(cfg)
    else:
        check_folder_settings(cfg)


def check_own_model(cfg: TrainConfig) -> None:
    """A run of attnres's own model: not the folder's tokenizer, a sequence within the model's
    context, a scaled query learning rate with input-dependent queries to scale and a scaled
    routing one with routing parameters, and the residual options, checked by the stream that
    takes them, built on no memory."""
    r, m = cfg.run, cfg.model
    if cfg.data.tokenizer == "model":
        raise ValueError("data.tokenizer='model' reads the tokenizer of the folder a run continues "
                         "(attnres train --from MODEL_DIR); this run builds its own model: use 'byte' or 'bpe'")
    if r.seq_len > m.max_seq_len:
        raise ValueError(f"run.seq_len={r.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
    if cfg.optim.query_lr_scale != 1.0 and not (m.residual in ("full", "block", "delta") and m.query == "input"):
        raise ValueError(f"optim.query_lr_scale={cfg.optim.query_lr_scale} scales the learning rate of the "
                         f"input-dependent queries' projections: it applies with model.query='input' (full, block or "
                         f"delta), not to model.residual={m.residual!r} with model.query={m.query!r}")
    if cfg.optim.routing_lr_scale != 1.0 and m.residual == "prenorm":
        raise ValueError(f"optim.routing_lr_scale={cfg.optim.routing_lr_scale} scales the learning rate of the "
                         f"routing parameters, and model.residual='prenorm' has none (its stream is a running sum)")
    with torch.device("meta"):
        build_stream(m.residual, dim=m.dim, num_sublayers=m.num_sublayers, eps=m.stream_eps, **m.stream_options())


def check_folder_settings(cfg: TrainConfig) -> None:
    """A run that continues a folder's model (``init_from``) reads the folder's tokenizer or the
    bytes, is not pipelined and scales no query learning rate (its model's sublayers are the
    folder's). That ``run.seq_len`` fits the folder's context is checked against the folder
    itself (``saved_model.check_fits``)."""
    if cfg.data.tokenizer == "bpe":
        raise ValueError("data.tokenizer='bpe' trains a new tokenizer, whose ids the model read from a folder "
                         "(--from) never learned: use 'model' (the folder's tokenizer) or 'byte'")
    if cfg.run.pp_size != 1:
        raise ValueError(f"run.pp_size={cfg.run.pp_size}: a run that continues a folder's model (--from) is not "
                         f"pipelined; use run.parallel=ddp or fsdp under torchrun")
    if cfg.optim.query_lr_scale != 1.0:
        raise ValueError(f"optim.query_lr_scale={cfg.optim.query_lr_scale} scales the input-dependent queries of "
                         f"attnres's own models; a run that continues a folder's model (--from) has none")


def shared_part(cfg: TrainConfig) -> TrainConfig:
    """A comparison's shared config as ``check_run`` checks it: its ``optim.routing_lr_scale``
    applies to the designs that route, each design's run checked with it, not to the preset's
    model, which no design is (it may be PreNorm's, which has no routing)."""
    return dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, routing_lr_scale=1.0))


def check_agreement(cfg: TrainConfig) -> None:
    """The batch splits into the micro-steps, the seed's data seeds fit, the device is one torch
    knows."""
    r = cfg.run
    if r.batch_size % r.grad_accum:
        raise ValueError(f"run.batch_size={r.batch_size} must be divisible by run.grad_accum={r.grad_accum}")
    top = max_seed(r.steps)
    if r.seed > top:
        raise ValueError(f"run.seed={r.seed} must be an integer in [0, {top}]: each step's data seed, "
                         f"run.seed * {DATA_SEED_STRIDE} + step, must fit in a 64-bit integer "
                         f"(run.steps={r.steps})")
    if r.device != "auto":
        try:
            torch.device(r.device)
        except RuntimeError:
            raise ValueError(f"run.device={r.device!r} must be 'auto' or a torch device such as 'cpu' or 'cuda:0'") from None


def max_seed(steps: int) -> int:
    """The largest ``run.seed`` whose data seeds, up to step ``steps``, fit in an int64: a larger
    one passes every other check and fails at the first batch, leaving a folder no rerun can use."""
    return (2**63 - 1 - steps) // DATA_SEED_STRIDE


# -- 3. the pipeline -------------------------------------------------------------------------

def _pipeline_options_unset(cfg: TrainConfig) -> None:
    """Without a pipeline, no ``run.pp_*`` option but ``pp_size`` and ``pp_schedule`` is set."""
    r = cfg.run
    given = [f"run.{name}={value!r}" for name, value, default in (
        ("pp_split", r.pp_split, None), ("pp_microbatches", r.pp_microbatches, None),
        ("pp_stages_per_rank", r.pp_stages_per_rank, None), ("pp_cache", r.pp_cache, "auto"))
        if value != default]
    if given:
        raise ValueError(f"{', '.join(given)}: run.pp_split, run.pp_microbatches, run.pp_stages_per_rank and "
                         f"run.pp_cache apply to a pipelined run: set run.pp_size > 1")


def check_pipeline_settings(cfg: TrainConfig, processes: int | None = None) -> ParallelPlan | None:
    """With ``run.pp_size > 1``: no gradient accumulation or compilation, and a layout the
    schedule can run on the whole batch (on ``processes``, default one pipeline's: the plan,
    returned); without: no other ``run.pp_*`` option (None)."""
    r = cfg.run
    if r.pp_size == 1:
        _pipeline_options_unset(cfg)
        return None
    for name, clash in (("grad_accum", r.grad_accum != 1), ("compile", r.compile)):
        if clash:
            raise ValueError(f"run.pp_size={r.pp_size}: a pipelined run takes its micro-batches from "
                             f"run.pp_microbatches and runs eagerly; {name} is not supported with it")
    return run_plan(cfg, processes)


# -- 4. the placement over the job's processes -----------------------------------------------

def check_processes(cfg: TrainConfig, processes: int, plan: ParallelPlan | None = None) -> ParallelPlan:
    """The run on ``processes`` processes (torchrun's world size, 1 without it): its parallel
    plan (``parallel_plan.run_plan``, returned; ``plan``: a pipeline's, built on them already);
    without a pipeline, the batch dividing over the ranks and the micro-steps."""
    r = cfg.run
    if r.pp_size == 1 and r.batch_size % (processes * r.grad_accum):
        raise ValueError(f"run.batch_size={r.batch_size} must be divisible by world size {processes} x "
                         f"run.grad_accum={r.grad_accum}")
    return plan or run_plan(cfg, processes)


def check_run(cfg: TrainConfig, processes: int | None = None) -> ParallelPlan | None:
    """Every check of ``cfg`` (and, given ``processes``, of its placement on them), in the order
    of the module's docstring; the first that fails raises ``ValueError``. Given ``processes``,
    returns the run's parallel plan on them, built once (a pipeline's where its settings are
    checked); without, None."""
    check_fields(cfg)
    check_model_kind(cfg)
    check_agreement(cfg)
    if processes is not None and (type(processes) is not int or processes < 1):
        raise ValueError(f"processes={processes!r} must be a positive integer (the job's world size)")
    plan = check_pipeline_settings(cfg, processes)
    return None if processes is None else check_processes(cfg, processes, plan)


# -- what only the user's own settings and the machine can say ------------------------------

#: settings that act only under another setting's value: field -> (the other field, the values
#: under which it acts); ``check_given`` refuses one the user gave where it does nothing
ONLY_UNDER = {
    "data.bpe_vocab_size": ("data.tokenizer", ("bpe",)),
    "data.decode_errors": ("data.tokenizer", ("bpe", "model")),
    "optim.decay_fraction": ("optim.schedule", ("wsd",)),
    "optim.min_lr_ratio": ("optim.schedule", ("cosine", "wsd")),
}


def window_problem(model: ModelConfig) -> str | None:
    """Why Full's ``window`` does nothing in ``model``, or None: every site reads ``e`` and every
    output before it, as Full without a window, when the window holds all ``M`` sublayers' outputs
    (``W >= M``; ``W >= M - 1`` when the output routing reads every source anyway,
    ``window_output='all'``)."""
    window, sublayers = model.window, model.num_sublayers
    if window is None:
        return None
    widest = sublayers - 1 if model.window_output == "all" else sublayers
    if window < widest:
        return None
    return (f"window={window} does nothing with {sublayers} sublayers (model.n_layers={model.n_layers}, two each): "
            f"every sublayer{'' if model.window_output == 'all' else ' and the output'} already reads every source "
            f"within it, as Full without a window; give a window below {widest}, or leave it out")


def check_given(cfg: TrainConfig, given, token_files: bool = False) -> None:
    """Refuse a setting the user gave (``given``: the ``section.field`` keys of their ``--set``)
    that does nothing in ``cfg``: one of ``ONLY_UNDER`` without the value it acts under, and
    ``data.val_fraction`` for a folder of token files (``token_files``: its ``val.bin`` is the
    validation split) or a named corpus (its split is part of it), a ``model.window`` that holds
    every source (``window_problem``). Defaults and a resumed run's saved values are not the user's choice now,
    and are not checked this way."""
    given = set(given)
    # a run of a folder's model has no model.window to give: config_from_args refuses its model.*
    if "model.window" in given and window_problem(cfg.model):
        raise ValueError(f"--set model.window: {window_problem(cfg.model)}")
    for key, (other, values) in ONLY_UNDER.items():
        section, name = other.split(".")
        current = getattr(getattr(cfg, section), name)
        if key in given and current not in values:
            value = getattr(getattr(cfg, key.split(".")[0]), key.split(".")[1])
            under = " or ".join(f"{other}={v}" for v in values)
            raise ValueError(f"--set {key}={value!r} does nothing with {other}={current!r}: it applies with "
                             f"{under}; leave it out or set that too")
    if token_files and "data.val_fraction" in given:
        raise ValueError(f"--set data.val_fraction={cfg.data.val_fraction!r} does nothing for a folder of token "
                         f"files: its val.bin is the validation split; leave it out")
    named = frozen(cfg.data.source)
    if named is not None and "data.val_fraction" in given:
        raise ValueError(f"--set data.val_fraction={cfg.data.val_fraction!r} does nothing for the corpus "
                         f"{named.name}: its validation split is fixed ({named.val_share:.0%} of its files, the same "
                         f"for every run); leave it out")


def backend_problem(model: ModelConfig, device: torch.device, dtype: torch.dtype = torch.float32) -> str | None:
    """Why ``model``'s explicit routing backend (``model.backend``) cannot run on ``device`` with
    ``dtype`` sources (the parameters' dtype: training keeps fp32 weights), as the backend itself
    says (``ops.registry``: its devices, dtypes and setup); None for ``auto``, a design without
    a backend, or one that can run."""
    from ..ops.registry import Request, get

    options = model.stream_options()
    name = options.get("backend", "auto")
    if name == "auto":
        return None
    request = Request(device.type, dtype, options.get("score", "softmax"), options.get("key_norm", True),
                      options.get("query") == "input")
    return get(name).problem(request)


def check_backend(model: ModelConfig, device: torch.device, where: str = "model.backend") -> None:
    """Refuse an explicit ``model.backend`` that cannot run on the run's ``device`` (``backend_problem``),
    before any folder is written: it would otherwise fail at the first step."""
    problem = backend_problem(model, device)
    if problem:
        raise ValueError(f"{where}={model.backend!r} cannot run on {device}: {problem}; leave it out "
                         f"(auto picks the backend that runs there)")


def runnable_model(model: ModelConfig, device: torch.device) -> tuple[ModelConfig, str | None]:
    """``model`` for running on ``device``: its own backend where it can run there, else the same
    model with ``backend="auto"`` and one line saying why (a run trained on a GPU with
    ``backend=triton`` is still read, generated from and exported on a CPU)."""
    import dataclasses

    problem = backend_problem(model, device)
    if problem is None:
        return model, None
    return (dataclasses.replace(model, backend="auto"),
            f"the run's model.backend={model.backend!r} cannot run on {device} ({problem}); using backend=auto")


SECTIONS = {"model": ModelConfig, "data": DataConfig, "optim": OptimConfig, "run": RunConfig}


def _has_sections(d) -> bool:
    """``d`` is an object with every section an object, but for a null ``model`` beside a
    string ``init_from`` (a run that continues a folder's model)."""
    if not isinstance(d, dict) or not all(isinstance(d.get(k), dict) for k in SECTIONS if k != "model"):
        return False
    init_from = d.get("init_from")
    if init_from is not None and not isinstance(init_from, str):
        return False
    return isinstance(d.get("model"), dict) or (d.get("model", {}) is None and isinstance(init_from, str))


def check_structure(d) -> None:
    """``ValueError`` unless ``d`` has a run config's structure as ``load_saved`` reads it: the
    sections model, data, optim and run, each an object of the config's fields and their types
    (``config.check_types``), holding every field without a default (the model's sizes). The
    values are not checked: a run saved on another machine (``run.device='cuda'``) or before a
    value was refused is still a run (``run_dir.check_run_dir`` tells a run's folder by it). A
    run that continues a folder's model has ``"model": null`` and the folder in ``init_from``."""
    if not _has_sections(d):
        raise ValueError("not an attnres training config: expected an object with the sections "
                         "model, data, optim and run")
    for name, cls in SECTIONS.items():
        if d[name] is None:
            continue
        check_types(cls, d[name], name)
        lacking = [f"{name}.{f.name}" for f in dataclasses.fields(cls)
                   if f.name not in d[name] and f.default is f.default_factory is dataclasses.MISSING]
        if lacking:
            raise ValueError(f"lacks {', '.join(lacking)}")


def load_saved(d) -> TrainConfig:
    """A config read from a run's ``config.json``: every section an object, every field of its
    type (``config.check_types``), rebuilt (``config.from_dict``) and checked (``check_run``);
    ``ValueError`` naming what is wrong."""
    if not _has_sections(d):
        raise ValueError("not a valid attnres training config: expected an object with the sections "
                         "model, data, optim and run")
    try:
        for name, cls in SECTIONS.items():
            if d[name] is not None:
                check_types(cls, d[name], name)
        config = from_dict(d)
        check_run(config)
    except ValueError as exc:
        text = str(exc)
        raise ValueError(text if text.startswith("not a valid") else f"not a valid attnres training config: {text}") from None
    return config
