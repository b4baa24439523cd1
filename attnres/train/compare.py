"""Train several residual designs on the same data, batches, seed and budget; then report."""

from __future__ import annotations

import dataclasses
import json
import time
import typing
from pathlib import Path

from ..analysis.capture import capture_analysis
from ..analysis.report import check_report_dependencies, choose_baseline, write_report
from ..model import ModelConfig
from ..streams import MODEL_OPTIONS, STREAMS
from .config import COMPARISON_PRESETS, TrainConfig, parse_value
from .data import batch_at, load_corpus
from .lock import FolderLock
from .trainer import EVAL_SEED, train

# label -> model options; "n_kv_heads" stands for the model's number of KV heads
DESIGNS: dict[str, dict] = {
    "prenorm": dict(residual="prenorm"),
    "block": dict(residual="block", num_blocks=8),
    "mhar": dict(residual="block", num_blocks=8, heads="n_kv_heads"),
    "full": dict(residual="full"),
    "mhc": dict(residual="mhc"),
    "gr": dict(residual="gr"),
    "hc": dict(residual="hc"),
    "delta": dict(residual="delta", num_blocks=8, heads="n_kv_heads"),
}
DEFAULT_DESIGNS = ("prenorm", "block", "mhar", "full", "mhc", "gr")
#: what every design of a comparison shares: the model's fields but the residual kind and options
SIZE_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.name != "residual" and f.name not in MODEL_OPTIONS)


def comparison_choice(preset: str, designs=None, seeds=None) -> tuple[list[str], list[int]]:
    """The designs and seeds of a comparison: those given, else the preset's
    (``COMPARISON_PRESETS``), else ``DEFAULT_DESIGNS`` and seed 0."""
    chosen = COMPARISON_PRESETS.get(preset, {})
    return list(designs or chosen.get("designs", DEFAULT_DESIGNS)), list(seeds or chosen.get("seeds", (0,)))


def design_options(base: ModelConfig, label: str, overrides: dict | None = None) -> dict:
    """Design ``label``'s residual kind and options for ``base``'s sizes, with ``overrides``
    (residual options the user set) replacing the design's own where its kind takes them."""
    if label not in DESIGNS:
        raise ValueError(f"unknown design {label!r}; expected one of {sorted(DESIGNS)}")
    options = dict(DESIGNS[label])
    if options.get("heads") == "n_kv_heads":
        options["heads"] = base.n_kv_heads
    if "num_blocks" in options:
        options["num_blocks"] = min(options["num_blocks"], base.num_sublayers)
    overrides = overrides or {}
    takes = STREAMS[options["residual"]].options()
    for name, value in overrides.items():
        if name == "residual" or MODEL_OPTIONS[name].name in takes:
            options[name] = value
    if {"block_size", "block_sizes"} & set(options) and "num_blocks" not in overrides:
        options.pop("num_blocks", None)  # the user's block size(s) replace the design's count
    return options


def design_config(base: ModelConfig, label: str, overrides: dict | None = None,
                  options: dict | None = None) -> ModelConfig:
    """``base``'s sizes with design ``label``'s residual options (``options``, when already
    made by ``design_options``)."""
    sizes = {f: getattr(base, f) for f in SIZE_FIELDS}
    return ModelConfig(**sizes, **(options or design_options(base, label, overrides)))


def check_overrides(designs, overrides: dict) -> None:
    """Every residual option the user set must apply to at least one chosen design, and
    ``residual`` (the designs choose it) must agree with all of them."""
    kinds = {label: DESIGNS[label]["residual"] for label in designs}
    for name, value in overrides.items():
        if name == "residual":
            other = [label for label, kind in kinds.items() if kind != value]
            if other:
                raise ValueError(f"--set model.residual={value!r}: the designs choose the residual kind, and "
                                 f"{other} are not {value!r}; leave it out or choose designs of that kind")
            continue
        option = MODEL_OPTIONS[name].name
        if not any(option in STREAMS[kind].options() for kind in kinds.values()):
            takers = sorted(k for k, cls in STREAMS.items() if option in cls.options())
            raise ValueError(f"--set model.{name}={value!r} applies to none of the designs {list(designs)}; "
                             f"it is an option of {takers}")


def split_residual_overrides(assignments) -> tuple[list[str], dict]:
    """``--set`` assignments split into those of the shared config and the residual ones
    (``model.residual`` and ``model.<option>``), the latter parsed: ``(others, {field: value})``."""
    hints = typing.get_type_hints(ModelConfig)
    others, overrides = [], {}
    for assignment in assignments:
        key, _, value = assignment.partition("=")
        section, _, name = key.partition(".")
        if section == "model" and (name in MODEL_OPTIONS or name == "residual") and "=" in assignment:
            overrides[name] = parse_value(value, hints[name], key)
        else:
            others.append(assignment)
    return others, overrides


def compare(base: TrainConfig, designs=DEFAULT_DESIGNS, seeds=(0,), out_dir: str | Path = "runs",
            log=print, overrides: dict | None = None, baseline: str | None = None,
            command: list[str] | None = None) -> Path:
    """Train every design for every seed into ``out_dir/compare-<timestamp>/``; returns the
    path of the report. ``overrides``: residual options (``model.<option>`` fields) that apply
    to every chosen design that takes them, replacing the design's own value. ``baseline``: the
    design the others are compared with (default ``prenorm`` when chosen, else the first).
    ``command``: the command line that asked for the comparison, for the report to quote."""
    base.validate()
    designs, seeds = list(designs), list(seeds)
    for name, values in (("designs", designs), ("seeds", seeds)):
        if not values or len(set(values)) != len(values):
            raise ValueError(f"{name} {values} must be given, each once")
    if any(type(s) is not int or s < 0 for s in seeds):
        raise ValueError(f"seeds {seeds} must be integers >= 0")
    baseline = choose_baseline(designs, baseline)
    check_report_dependencies(len(seeds))
    overrides = overrides or {}
    check_overrides(designs, overrides)
    options = {label: design_options(base.model, label, overrides) for label in designs}  # fail fast on bad labels
    configs = {label: design_config(base.model, label, options=options[label]) for label in designs}
    for label, config in configs.items():
        dataclasses.replace(base, model=config).validate()
    root = Path(out_dir) / time.strftime("compare-%Y%m%d-%H%M%S")
    root.mkdir(parents=True, exist_ok=False)
    corpus = load_corpus(base.data, base.model.vocab_size, bpe_dir=root)
    index = {"designs": designs, "seeds": seeds, "baseline": baseline, "command": command, "runs": []}
    start = time.time()
    for seed in seeds:
        for label in designs:
            name = label if len(seeds) == 1 else f"{label}-seed{seed}"
            cfg = dataclasses.replace(base, model=configs[label], run=dataclasses.replace(base.run, seed=seed))
            log(f"[{time.time() - start:5.0f}s] training {name} ({cfg.run.steps} steps)")
            with FolderLock(root / name):  # one writer: the design's run, then its analysis
                result = train(cfg, root / name, corpus=corpus)
                x, _ = batch_at(corpus.val, min(8, cfg.run.batch_size), cfg.run.seq_len, EVAL_SEED, 0)
                analysis = capture_analysis(result.model, x)
                (root / name / "analysis.json").write_text(json.dumps(analysis))
            log(f"[{time.time() - start:5.0f}s] {name}: validation loss {result.summary['final_val_loss']:.4f}")
            index["runs"].append({"design": label, "seed": seed, "dir": name,
                                  "options": options[label]})
            (root / "compare.json").write_text(json.dumps(index, indent=2))
    index["wall_time_s"] = time.time() - start
    (root / "compare.json").write_text(json.dumps(index, indent=2))
    return write_report(root)
