"""Typed training configuration, presets, and dotted overrides.

A preset is a Python function returning a ``TrainConfig``; ``--set section.field=value``
overrides one field, parsed by the field's type. Unknown keys are an error that lists the
accepted ones. The fields are plain values: what each accepts and how they must agree is checked
in one place, ``train/validate.py`` (``check_run``), which also reads a saved config back
(``load_saved``).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field

from ..model import ModelConfig
from ..model_config import default_norm_eps
from ..names import ABLATIONS, PRESET_NAMES  # noqa: F401  (ABLATIONS: read here by its users)
from .frozen_corpus import DEFAULT_CORPUS


@dataclass
class DataConfig:
    """Where the text comes from and how it becomes tokens.

    ``source``: a named corpus (``"sdists-v1"``, the default: the same bytes on every machine,
    ``train/frozen_corpus.py``), ``"stdlib"`` (the installed Python's standard library sources,
    split by file: another Python reads other bytes), a text file or folder of text files, a
    folder of token files (``train.bin``/``val.bin``), or ``"hf:NAME[:CONFIG]"``, a Hugging Face
    dataset streamed into token shards (``train/hf_shards.py``).
    ``tokenizer``: ``"byte"`` (token b is byte b), ``"bpe"`` (trained on the training split
    with the ``tokenizers`` library, ``bpe_vocab_size`` tokens, cached) or ``"model"`` (the
    tokenizer of the folder a run continues, ``attnres train --from``).
    ``decode_errors``: what a tokenizer that reads text (BPE, a folder's) does with a file that is not UTF-8:
    ``"strict"`` refuses it, naming the file and the first bad byte; ``"replace"`` reads each bad
    byte as U+FFFD (a run saved before the field existed did so, and reads as ``"replace"``:
    ``SAVED_BEFORE``).
    """

    source: str = DEFAULT_CORPUS
    tokenizer: str = "byte"
    bpe_vocab_size: int = 4096
    val_fraction: float = 0.05
    max_train_tokens: int | None = None
    max_val_tokens: int | None = None
    decode_errors: str = "strict"


#: what a field a saved config lacks reads as, where that is not its default for a new run:
#: section -> {field: value}; an older run, resumed or read, keeps doing what it did
SAVED_BEFORE = {"data": {"decode_errors": "replace"}}


@dataclass
class OptimConfig:
    """AdamW with warmup then ``cosine`` (to ``min_lr_ratio * lr``), ``wsd`` (warmup, stable,
    then linear decay over the last ``decay_fraction`` of steps) or ``constant``; every parameter
    group's learning rate is its ``lr_scale`` (1 but for ``query_lr_scale`` and ``routing_lr_scale``)
    times the schedule's."""

    lr: float = 2e-3
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 30
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    decay_fraction: float = 0.2
    grad_clip: float = 1.0
    #: the input-dependent queries' projections' learning rate, as a multiple of the scheduled one
    #: (``model.query="input"`` only; ``model.param_groups``' ``query_projection`` group)
    query_lr_scale: float = 1.0
    #: the routing parameters' learning rate, as a multiple of the scheduled one: pseudo-queries,
    #: key-norm gains, Delta's gates, DenseFormer's and static mixing's weights, HC's, mHC's and
    #: GR's mixing (``Stream.routing_parameters``; ``model.param_groups``' ``routing`` group);
    #: a model without routing parameters (PreNorm, a folder's unconverted model) refuses it
    routing_lr_scale: float = 1.0


#: the data seed of batch ``index`` of a run seeded ``run.seed`` is ``seed * DATA_SEED_STRIDE +
#: index`` (``data.batch_at``), a signed 64-bit integer for the generator that draws the batch
#: (``validate.max_seed`` bounds the seed by it)
DATA_SEED_STRIDE = 1_000_003


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
    #: every one of the first ``log_first`` steps is logged, whatever ``log_every`` says (a
    #: conversion's first steps against its control's: ``compare --from --shock-steps``)
    log_first: int = 0
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
    """A run's settings. ``model`` builds attnres's own ``Transformer``; a run that continues
    training a saved folder (``attnres train --from``) names it in ``init_from`` (an absolute
    path) and has no ``model`` section: its model is the folder's (``train/saved_model.py``).
    ``init_from_digest`` is that folder's digest when the run started from it
    (``train/source_digest.py``: checked where the run is continued or exported; None for a run
    saved before it was recorded)."""

    model: ModelConfig | None
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    init_from: str | None = None
    init_from_digest: dict | None = None


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


REGIME_STEPS = 2420


def regime() -> TrainConfig:
    """The papers' regime at a size two CPU cores can ladder (docs/RESULTS.md, "The papers'
    regime"): the study's depth and sequence at width 48 (2 heads of 24), 246,576 parameters,
    trained on 20.1 byte tokens per parameter (2420 steps of 16 x 128), warm-up the same 4% of the
    steps as the study's, from a 48M-token prefix of the corpus (three times the largest budget
    run's tokens, so no run samples a byte more than about once). About 3 minutes a run. Its 3e-3
    is the rate of a model none of ``names.REGIME_DESIGNS`` is: ``attnres train`` trains those at
    their own (``experiments/train_rate.py``)."""
    return TrainConfig(
        model=_model(dim=48, n_layers=8, n_heads=2, max_seq_len=128),
        data=DataConfig(max_train_tokens=48_000_000, max_val_tokens=400_000),
        optim=OptimConfig(lr=3e-3, warmup_steps=100),
        run=RunConfig(steps=REGIME_STEPS, batch_size=16, seq_len=128, eval_every=REGIME_STEPS // 4,
                      eval_batches=24, log_every=10),
    )


def ablations() -> TrainConfig:
    """The size of ``attnres compare --preset ablations``: the study's (``study``), so that its
    PreNorm, Block and Full runs are the study's own, bit for bit. Its designs are
    ``ABLATIONS``; about 72 minutes on two CPU cores (pilot: docs/RESULTS.md)."""
    return study()


#: name -> the function of that name above; the names, and the designs each comparison preset
#: compares (``COMPARISON_PRESETS``, ``ABLATIONS``), are in ``attnres/names.py``
PRESETS = {name: globals()[name] for name in PRESET_NAMES}


def preset(name: str) -> TrainConfig:
    if name not in PRESETS:
        raise ValueError(f"unknown preset {name!r}; expected one of {sorted(PRESETS)}")
    return PRESETS[name]()


# -- overrides -------------------------------------------------------------------------------

def parse_value(value: str, annotation, key: str, where: str = "--set"):
    """Parse ``value`` for a field annotated ``annotation`` (str, int, float, bool, a tuple of
    one of those written as a comma list, X | None). ``where`` begins an error's message: what
    gave ``key=value``."""
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
            raise ValueError(f"{where} {key}={value!r}: expected a comma list of {item.__name__}, "
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
        raise ValueError(f"{where} {key}={value!r}: expected a value of type {annotation.__name__}") from None


def parse_assignment(config: TrainConfig, assignment: str) -> tuple[str, str, object]:
    """``(section, field, value)`` of one ``section.field=value`` override, the value parsed by
    the field's type."""
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
        from ..streams import MODEL_OPTIONS

        named = [f for f, option in MODEL_OPTIONS.items() if option.name == field_name and f != field_name]
        if section_name == "model" and named:  # a stream's own name of the option (GR's rank)
            raise ValueError(f"--set {key!r}: the option is written model.{named[0]}: --set model.{named[0]}={value}")
        raise ValueError(f"--set {key!r}: unknown field; {section_name} has {sorted(fields)}")
    return section_name, field_name, parse_value(value, typing.get_type_hints(type(section))[field_name], key)


#: model fields whose default derives from others (``ModelConfig``): when one of those is set and
#: the field holds its derived value, it is derived again from the new values
DERIVED = {"ffn_dim": (("dim",), lambda m: 32 * math.ceil(8 * m["dim"] / 3 / 32)),
           "n_kv_heads": (("n_heads",), lambda m: m["n_heads"]),
           "norm_eps": (("residual", "norm_eps_scale"), lambda m: default_norm_eps(m["residual"], m["norm_eps_scale"]))}


def _model_with(model: ModelConfig, changes: dict) -> ModelConfig:
    """``model`` with ``changes``, checked once as a whole; a derived default (``DERIVED``)
    follows the field it derives from unless it is set too."""
    fields = dataclasses.asdict(model)
    for name, (sources, rule) in DERIVED.items():
        if set(sources) & set(changes) and name not in changes and fields[name] == rule(fields):
            fields[name] = None
    return ModelConfig(**{**fields, **changes})


def apply_overrides(config: TrainConfig, assignments) -> TrainConfig:
    """Apply ``section.field=value`` overrides together: each parsed, then every section built
    and checked once with all of its changes, so the order of the assignments of different
    fields never matters (a field given twice takes its last value). Returns a new config."""
    changes: dict[str, dict] = {}
    for assignment in assignments:
        section, name, value = parse_assignment(config, assignment)
        changes.setdefault(section, {})[name] = value  # a field given again: the last value
    for section, fields in changes.items():
        if section == "model":  # the model's checks run on all of its new values at once
            new_section = _model_with(config.model, fields)
        else:
            new_section = dataclasses.replace(getattr(config, section), **fields)
        config = dataclasses.replace(config, **{section: new_section})
    return config


def apply_override(config: TrainConfig, assignment: str) -> TrainConfig:
    """Apply one ``section.field=value`` override; returns a new config."""
    return apply_overrides(config, [assignment])


def _type_problem(value, annotation) -> bool:
    """True when ``value`` (read from JSON) is not of the field type ``annotation``."""
    if type(annotation) in (types.UnionType, typing.Union) or typing.get_origin(annotation) is typing.Union:
        return value is not None and all(_type_problem(value, a) for a in typing.get_args(annotation)
                                         if a is not type(None))
    if typing.get_origin(annotation) in (tuple, list):
        item = typing.get_args(annotation)[0]
        return not isinstance(value, (list, tuple)) or any(_type_problem(v, item) for v in value)
    if annotation is float:
        return isinstance(value, bool) or not isinstance(value, (int, float))
    if annotation is int:
        return isinstance(value, bool) or not isinstance(value, int)
    return not isinstance(value, annotation)


def check_types(cls, values, section: str) -> None:
    """Refuse a saved section ``values`` that is not an object, lacks no field but holds an
    unknown one, or holds a value not of its field's type (``ValueError`` naming it)."""
    if not isinstance(values, dict):
        raise ValueError(f"section {section!r} is {type(values).__name__}, not an object")
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(values) - set(hints))
    if unknown:
        raise ValueError(f"unknown field(s) {[f'{section}.{k}' for k in unknown]}")
    for name, value in values.items():
        if _type_problem(value, hints[name]):
            raise ValueError(f"{section}.{name}={value!r} is not of type {hints[name]}")


def to_dict(config: TrainConfig) -> dict:
    return dataclasses.asdict(config)


def from_dict(d: dict) -> TrainConfig:
    """Rebuild a config saved with ``to_dict``; unknown keys are an error."""
    try:
        return TrainConfig(
            model=None if d["model"] is None else ModelConfig(**d["model"]),
            data=DataConfig(**{**SAVED_BEFORE["data"], **d["data"]}),
            optim=OptimConfig(**d["optim"]),
            run=RunConfig(**d["run"]),
            init_from=d.get("init_from"),
            init_from_digest=d.get("init_from_digest"),
        )
    except (KeyError, TypeError) as exc:
        raise ValueError(f"not a valid attnres training config: {exc}") from None
