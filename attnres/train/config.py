"""Typed training configuration, presets, and dotted overrides.

A preset is a Python function returning a ``TrainConfig``; ``--set section.field=value``
overrides one field, parsed by the field's type. Unknown keys are an error that lists the
accepted ones.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field

import torch

from ..model import ModelConfig
from ..streams import build_stream
from .pipeline import SCHEDULES, check_pipeline, stages_per_rank
from .stage_cache import use_cache


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes tokens.

    ``source``: ``"stdlib"`` (the Python standard library's sources, split by file), a text file
    or folder of text files, a folder with nanoGPT-style ``train.bin``/``val.bin`` (uint16), or
    ``"hf:NAME[:CONFIG]"`` for a Hugging Face ``datasets`` source (needs that package).
    ``tokenizer``: ``"byte"`` (token b is byte b) or ``"bpe"`` (trained on the training split
    with the ``tokenizers`` library, ``bpe_vocab_size`` tokens, cached).
    """

    source: str = "stdlib"
    tokenizer: str = "byte"
    bpe_vocab_size: int = 4096
    val_fraction: float = 0.05
    max_train_tokens: int | None = None
    max_val_tokens: int | None = None


@dataclass
class OptimConfig:
    """AdamW with warmup then ``cosine`` (to ``min_lr_ratio * lr``), ``wsd`` (warmup, stable,
    then linear decay over the last ``decay_fraction`` of steps) or ``constant``."""

    lr: float = 2e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 30
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    grad_clip: float = 1.0


@dataclass
class RunConfig:
    """Budget, batching, evaluation, checkpoints and placement of one run.

    ``batch_size`` is the global batch per optimizer step (split across ranks and
    ``grad_accum`` micro-steps). ``parallel`` (``ddp``/``fsdp``) applies under torchrun.

    ``pp_size > 1`` pipelines the model over that many ranks (``train/pipeline.py``; a job of
    ``k * pp_size`` ranks runs ``k`` copies side by side, data parallel): ``pp_schedule`` (``gpipe``, ``1f1b``, ``interleaved1f1b``, ``loopedbfs``,
    ``zbv``, ``dualpipev``), ``pp_microbatches`` per step (default: the number of stages),
    ``pp_stages_per_rank`` (default 1 for ``gpipe``/``1f1b``, 2 for the others), ``pp_split``
    (sublayers per stage; default as even as they go), ``pp_cache`` (``auto``, ``on``, ``off``:
    the cross-stage cache of completed sources, ``train/stage_cache.py``; ``auto`` turns it on
    for the AttnRes family with several stages per rank).
    """

    steps: int = 400
    batch_size: int = 16
    seq_len: int = 256
    grad_accum: int = 1
    seed: int = 0
    eval_every: int = 100
    eval_batches: int = 20
    log_every: int = 10
    ckpt_every: int = 0  # 0: only at the end (and on SIGINT/SIGTERM)
    compile: bool = False
    device: str = "auto"
    autocast: str = "auto"  # bf16 autocast on CUDA; "none" to disable
    parallel: str = "ddp"
    pp_size: int = 1
    pp_schedule: str = "1f1b"
    pp_microbatches: int | None = None
    pp_stages_per_rank: int | None = None
    pp_split: tuple[int, ...] | None = None
    pp_cache: str = "auto"
    out_dir: str = "runs"
    name: str = ""
    tensorboard: bool = True
    progress: bool = True


@dataclass
class TrainConfig:
    model: ModelConfig
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the field, its value and what it accepts (``FIELDS``, the
        residual options through the stream's own checks, and the fields that must agree)."""
        for key, accepted in FIELDS.items():
            section, name = key.split(".")
            value = getattr(getattr(self, section), name)
            if not accepted.accepts(value):
                raise ValueError(f"{key}={value!r} must be {accepted}")
        r, m = self.run, self.model
        if r.batch_size % r.grad_accum:
            raise ValueError(f"run.batch_size={r.batch_size} must be divisible by run.grad_accum={r.grad_accum}")
        if r.seq_len > m.max_seq_len:
            raise ValueError(f"run.seq_len={r.seq_len} exceeds model.max_seq_len={m.max_seq_len}")
        if r.device != "auto":
            try:
                torch.device(r.device)
            except RuntimeError:
                raise ValueError(f"run.device={r.device!r} must be 'auto' or a torch device such as 'cpu' or 'cuda:0'") from None
        if r.pp_size > 1:
            self._check_pipeline()
        else:
            given = [f"run.{name}={value!r}" for name, value, default in (
                ("pp_split", r.pp_split, None), ("pp_microbatches", r.pp_microbatches, None),
                ("pp_stages_per_rank", r.pp_stages_per_rank, None), ("pp_cache", r.pp_cache, "auto"))
                if value != default]
            if given:
                raise ValueError(f"{', '.join(given)}: run.pp_split, run.pp_microbatches, run.pp_stages_per_rank and "
                                 f"run.pp_cache apply to a pipelined run: set run.pp_size > 1")
        with torch.device("meta"):  # the residual options, checked by the stream itself, on no memory
            build_stream(m.residual, dim=m.dim, num_sublayers=m.num_sublayers, eps=m.norm_eps, **m.stream_options())

    def _check_pipeline(self) -> None:
        r, m = self.run, self.model
        for name, clash in (("grad_accum", r.grad_accum != 1), ("compile", r.compile),
                            ("model.moe_experts", m.moe_experts > 0)):
            if clash:
                raise ValueError(f"run.pp_size={r.pp_size}: a pipelined run takes its micro-batches from "
                                 f"run.pp_microbatches and runs eagerly on dense models; {name} is not supported with it")
        try:
            check_pipeline(r.pp_schedule, r.pp_size, m.num_sublayers, r.batch_size, r.pp_microbatches,
                           r.pp_stages_per_rank, r.pp_split)
            use_cache(r.pp_cache, m.residual, stages_per_rank(r.pp_schedule, r.pp_stages_per_rank))
        except ValueError as err:
            raise ValueError(f"run.pp_size={r.pp_size}, run.pp_schedule={r.pp_schedule!r}: {err}") from None


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


#: what each field accepts, checked by ``TrainConfig.validate`` before any work (the model's sizes
#: and residual options are checked by ``ModelConfig`` and the streams); docs/RELIABILITY.md lists them
FIELDS: dict[str, Range | Choice] = {
    "model.ffn_dim": _count(),
    "model.rope_theta": Range(0, low_open=True),
    "model.norm_eps": Range(0, low_open=True),
    "model.init_std": Range(0, low_open=True),
    "data.tokenizer": Choice(("byte", "bpe")),
    "data.bpe_vocab_size": _count(257),  # the 256 bytes and at least one merge
    "data.val_fraction": Range(0, 1, low_open=True, high_open=True),
    "data.max_train_tokens": _count(none=True),
    "data.max_val_tokens": _count(none=True),
    "optim.lr": Range(0, low_open=True),
    "optim.weight_decay": Range(0),
    "optim.beta1": Range(0, 1, high_open=True),
    "optim.beta2": Range(0, 1, high_open=True),
    "optim.warmup_steps": _count(0),
    "optim.schedule": Choice(("cosine", "wsd", "constant")),
    "optim.min_lr_ratio": Range(0, 1),
    "optim.decay_fraction": Range(0, 1),
    "optim.grad_clip": Range(0, low_open=True),
    "run.steps": _count(),
    "run.batch_size": _count(),
    "run.seq_len": _count(),
    "run.grad_accum": _count(),
    "run.seed": _count(0),
    "run.eval_every": _count(),
    "run.eval_batches": _count(),
    "run.log_every": _count(),
    "run.ckpt_every": _count(0),
    "run.autocast": Choice(("auto", "none")),
    "run.parallel": Choice(("ddp", "fsdp")),
    "run.pp_size": _count(),
    "run.pp_schedule": Choice(SCHEDULES),
    "run.pp_microbatches": _count(none=True),
    "run.pp_stages_per_rank": _count(none=True),
    "run.pp_cache": Choice(("auto", "on", "off")),
}


# -- presets ---------------------------------------------------------------------------------

def _model(**kw) -> ModelConfig:
    return ModelConfig(**{"vocab_size": 256, **kw})


def tiny() -> TrainConfig:
    """Seconds on a laptop: for tests and smoke runs."""
    return TrainConfig(
        model=_model(dim=32, n_layers=2, n_heads=2, max_seq_len=64),
        data=DataConfig(max_train_tokens=200_000, max_val_tokens=20_000),
        optim=OptimConfig(lr=3e-3, warmup_steps=2),
        run=RunConfig(steps=8, batch_size=4, seq_len=32, eval_every=4, eval_batches=2, log_every=2),
    )


def demo() -> TrainConfig:
    """The default of ``attnres compare``: six designs in under 15 minutes on two CPU cores."""
    return TrainConfig(
        model=_model(dim=96, n_layers=8, n_heads=4, max_seq_len=128),
        data=DataConfig(max_train_tokens=8_000_000, max_val_tokens=400_000),
        optim=OptimConfig(lr=3e-3, warmup_steps=20),
        run=RunConfig(steps=160, batch_size=16, seq_len=128, eval_every=40, eval_batches=12, log_every=10),
    )


def small() -> TrainConfig:
    """The setting measured in the project's spec (section 11): ~4-6 minutes per design."""
    return TrainConfig(
        model=_model(dim=128, n_layers=8, n_heads=4, max_seq_len=256),
        optim=OptimConfig(lr=2e-3, warmup_steps=30),
        run=RunConfig(steps=400, batch_size=16, seq_len=256, eval_every=100, eval_batches=20),
    )


STUDY_STEPS = 480


def study() -> TrainConfig:
    """The size of ``attnres compare --preset study`` (PreNorm, Block, MHAR and Full, six seeds,
    paired intervals): about 50 minutes on two CPU cores. Pilot runs: docs/RESULTS.md."""
    return TrainConfig(
        model=_model(dim=96, n_layers=8, n_heads=4, max_seq_len=128),
        data=DataConfig(max_train_tokens=8_000_000, max_val_tokens=400_000),
        optim=OptimConfig(lr=3e-3, warmup_steps=20),
        run=RunConfig(steps=STUDY_STEPS, batch_size=16, seq_len=128, eval_every=STUDY_STEPS // 4, eval_batches=24,
                      log_every=10),
    )


PRESETS = {"tiny": tiny, "demo": demo, "small": small, "study": study}
#: what ``attnres compare --preset NAME`` compares when --designs and --seeds are not given
#: (others: ``compare.DEFAULT_DESIGNS``, seed 0)
COMPARISON_PRESETS = {"study": {"designs": ("prenorm", "block", "mhar", "full"), "seeds": (0, 1, 2, 3, 4, 5)}}


def preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name]()


# -- overrides -------------------------------------------------------------------------------

def parse_value(value: str, annotation, key: str):
    """Parse ``value`` for a field annotated ``annotation`` (str, int, float, bool, a tuple of
    one of those written as a comma list, X | None)."""
    args = typing.get_args(annotation)
    if type(annotation) in (types.UnionType, typing.Union) or typing.get_origin(annotation) is typing.Union:
        if value.lower() in ("none", "null"):
            return None
        annotation = next(a for a in args if a is not type(None))
    if typing.get_origin(annotation) is tuple:  # tuple[int, ...]: "4,4,6,2"
        item = typing.get_args(annotation)[0]
        try:
            return tuple(item(v) for v in value.split(","))
        except ValueError:
            raise ValueError(f"--set {key}={value!r}: expected a comma list of {item.__name__}, "
                             f"e.g. 4,4,6,2") from None
    try:
        if annotation is bool:
            if value.lower() in ("1", "true", "yes", "on"):
                return True
            if value.lower() in ("0", "false", "no", "off"):
                return False
            raise ValueError
        return annotation(value)
    except ValueError:
        raise ValueError(f"--set {key}={value!r}: expected a value of type {annotation.__name__}") from None


def apply_override(config: TrainConfig, assignment: str) -> TrainConfig:
    """Apply one ``section.field=value`` override; returns a new config."""
    if "=" not in assignment:
        raise ValueError(f"--set {assignment!r}: expected section.field=value")
    key, value = assignment.split("=", 1)
    sections = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    if key.count(".") != 1 or key.split(".")[0] not in sections:
        raise ValueError(f"--set {key!r}: expected one of the sections {sorted(sections)} as section.field")
    section_name, field_name = key.split(".")
    section = sections[section_name]
    fields = {f.name: f for f in dataclasses.fields(section)}
    if field_name not in fields:
        raise ValueError(f"--set {key!r}: unknown field; {section_name} has {sorted(fields)}")
    parsed = parse_value(value, typing.get_type_hints(type(section))[field_name], key)
    if section_name == "model":  # re-run the model's validation on the new value
        new_section = ModelConfig(**{**dataclasses.asdict(section), field_name: parsed})
    else:
        new_section = dataclasses.replace(section, **{field_name: parsed})
    return dataclasses.replace(config, **{section_name: new_section})


def to_dict(config: TrainConfig) -> dict:
    return dataclasses.asdict(config)


def from_dict(d: dict) -> TrainConfig:
    """Rebuild a config saved with ``to_dict``; unknown keys are an error."""
    try:
        return TrainConfig(
            model=ModelConfig(**d["model"]),
            data=DataConfig(**d["data"]),
            optim=OptimConfig(**d["optim"]),
            run=RunConfig(**d["run"]),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a valid attnres training config: {exc}") from None
