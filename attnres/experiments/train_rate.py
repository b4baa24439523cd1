"""The learning rate ``attnres train --preset PRESET`` gives a model of its own, where the
comparison preset of that name gives each of its designs a rate of its own (``regime``:
``names.REGIME_DESIGNS``): a model that is one of those designs trains at that design's rate, as
``attnres compare --preset regime``'s own designs do; any other at the preset's. Which design a
model is: its residual kind, the options the kind takes and its blocks (``design_key``).
"""

from __future__ import annotations

import dataclasses

from ..model import ModelConfig
from ..names import COMPARISON_PRESETS
from ..streams import resolve_block_sizes
from ..train.config import TrainConfig, preset as training_preset
from .designs import BLOCK_SIZING, SIZE_FIELDS, design_config, kind_options, parse_design

#: model options that choose how a design is computed, not which design it is
HOW_COMPUTED = ("backend", "two_phase")
#: shared fields that are no size: how the epsilon is set (the run's choice, not where a rate was tuned)
NOT_SIZES = ("norm_eps_scale",)


def design_key(model: ModelConfig) -> tuple:
    """What makes ``model`` the design it is, sizes, epsilon and kernels aside: its residual
    kind, the options the kind takes, and its blocks as sizes in sublayers (however given)."""
    takes = kind_options(model.residual)
    options = sorted(takes - set(BLOCK_SIZING) - set(HOW_COMPUTED))
    blocks = (resolve_block_sizes(model.num_sublayers, model.block_size, model.num_blocks, model.block_sizes)[0]
              if takes & set(BLOCK_SIZING) else None)
    return model.residual, tuple((f, getattr(model, f)) for f in options), blocks


def tuned_designs(preset: str) -> list[str]:
    """The labels of comparison preset ``preset`` that give their design a learning rate."""
    return [label for label in COMPARISON_PRESETS.get(preset, {}).get("designs", ())
            if "lr" in parse_design(label)[1]]


def preset_design_rates(preset: str, model: ModelConfig) -> list[tuple[str, float]]:
    """``(label, rate)`` of each design of ``tuned_designs(preset)`` that ``model`` is
    (``design_key``): none, one, or two that are one model at these sizes (Block and MHAR where
    the model has one KV head)."""
    return [(label, parse_design(label)[1]["lr"]) for label in tuned_designs(preset)
            if design_key(design_config(model, label)) == design_key(model)]


def _spelled(label: str) -> str:
    """The rate as the label writes it (``block:lr=5e-3`` -> ``5e-3``)."""
    return next(part for part in label.split(":") if part.startswith("lr=")).removeprefix("lr=")


def preset_train_rate(preset: str, cfg: TrainConfig, assignments) -> tuple[TrainConfig, str | None]:
    """``cfg`` (a run of its own model, ``attnres train --preset PRESET``) at the rate the
    comparison preset ``preset`` gives the design its model is, and a line saying which rate it
    trains at and why (naming the sizes the run changes from the preset's, at which the rate was
    not chosen); ``(cfg, None)`` for a preset without such rates, or where ``assignments``
    (``--set``) give ``optim.lr``. ``ValueError`` where the model is two designs with different
    rates."""
    tuned = tuned_designs(preset)
    if not tuned or any(a.partition("=")[0].strip() == "optim.lr" for a in assignments):
        return cfg, None
    matches = preset_design_rates(preset, cfg.model)
    if len({lr for _, lr in matches}) > 1:
        raise ValueError(f"the model is {' and '.join(label for label, _ in matches)} at once (one model at these "
                         f"sizes), and --preset {preset} trains them at different rates: give --set optim.lr=X")
    if not matches:
        return cfg, (f"optim.lr={cfg.optim.lr:g} (the {preset} preset's own): this {cfg.model.residual} model is none "
                     f"of the designs the preset tunes ({' '.join(tuned)}); --set optim.lr=X for another")
    label, lr = matches[0]
    own = training_preset(preset)
    changed = [f"model.{f}" for f in SIZE_FIELDS if f not in NOT_SIZES
               and getattr(cfg.model, f) != getattr(own.model, f)]
    changed += [f"run.{f}" for f in ("steps", "batch_size", "seq_len") if getattr(cfg.run, f) != getattr(own.run, f)]
    where = f"; chosen at the preset's own size and steps, not at this run's {', '.join(changed)}" if changed else ""
    return (dataclasses.replace(cfg, optim=dataclasses.replace(cfg.optim, lr=lr)),
            f"optim.lr={_spelled(label)}: the rate {label} has in attnres compare --preset {preset}{where}; "
            f"--set optim.lr=X for another")
