"""A comparison's designs: each a label, ``name[:field=value:...]``, a design of ``names.DESIGNS``
with options of its own (``parse_design``), made into its residual options (``design_options``),
its model config (``design_config``) and its optimizer fields (``optim_fields``) for the
comparison's shared sizes.
"""

from __future__ import annotations

import dataclasses
import typing

from ..analysis.comparison import label_path
from ..model import ModelConfig
from ..model_config import default_norm_eps
from ..names import COMPARISON_PRESETS, CONVERT_DEFAULTS, DEFAULT_DESIGNS, DESIGNS, FOLDER_DESIGNS
from ..streams import KINDS, MODEL_OPTIONS, STREAMS
from ..train.config import OptimConfig, parse_value


#: model fields a comparison's ``--set`` gives every design, as it gives a residual option, which
#: a design's label may replace: ``norm_eps``, whose default is each residual kind's own
#: (``model_config.default_norm_eps``)
EVERY_DESIGN = ("norm_eps",)
#: what every design of a comparison shares: the model's fields but the residual kind, its options
#: and those of ``EVERY_DESIGN``
SIZE_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig)
                    if f.name != "residual" and f.name not in MODEL_OPTIONS and f.name not in EVERY_DESIGN)


def comparison_choice(preset: str, designs=None, seeds=None) -> tuple[list[str], list[int]]:
    """The designs and seeds of a comparison: those given, else the preset's
    (``COMPARISON_PRESETS``), else ``DEFAULT_DESIGNS`` and seed 0."""
    chosen = COMPARISON_PRESETS.get(preset, {})
    return list(designs or chosen.get("designs", DEFAULT_DESIGNS)), list(seeds or chosen.get("seeds", (0,)))


#: the options that size a Block design's blocks, one way or another
BLOCK_SIZING = ("num_blocks", "block_size", "block_sizes")
#: what a variant may set besides its design's residual options (the sizes stay shared): model
#: fields, and optimizer fields (``OPTIM_VARIANT_FIELDS``, set in the variant's run's ``optim``)
OPTIM_VARIANT_FIELDS = ("lr", "query_lr_scale", "routing_lr_scale")
VARIANT_FIELDS = ("norm_eps", "norm_eps_scale", *OPTIM_VARIANT_FIELDS)
#: the characters a design's label may hold (folder names derive from it: ``label_path``)
LABEL_CHARACTERS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_.,:=+-")


def kind_options(kind: str) -> set[str]:
    """The model fields (``MODEL_OPTIONS``) that residual ``kind``'s stream takes as options."""
    return {field for field, option in MODEL_OPTIONS.items() if option.name in STREAMS[kind].options()}


def kind_optim_fields(kind: str) -> tuple[str, ...]:
    """The optimizer fields (``OPTIM_VARIANT_FIELDS``) that apply to a design of residual
    ``kind``: the learning rate to every design, the input query's to a kind with
    input-dependent queries, the routing's to one with routing."""
    applies = {"lr": True, "query_lr_scale": "query" in kind_options(kind), "routing_lr_scale": kind != "prenorm"}
    return tuple(f for f in OPTIM_VARIANT_FIELDS if applies[f])


def parse_design(label: str) -> tuple[str, dict]:
    """``(design, options)`` of a design's label: a name of ``DESIGNS``, then options separated
    by colons, ``name:field=value:field=value``, each a residual option the design's kind takes
    (as ``--set model.<field>`` names it) or ``norm_eps``, its value parsed by the field's type::

        full                          ->  ("full", {})
        full:norm_eps=1e-6            ->  ("full", {"norm_eps": 1e-06})
        block:block_sizes=4,4,6,2     ->  ("block", {"block_sizes": (4, 4, 6, 2)})

    ``ValueError`` names the label and what is accepted for anything else."""
    if not isinstance(label, str) or not label:
        raise ValueError(f"design {label!r}: expected a design name, e.g. 'full' or 'full:norm_eps=1e-6'")
    odd = sorted(set(label) - LABEL_CHARACTERS)
    if odd:
        raise ValueError(f"design {label!r}: the characters {odd} are not accepted; a label is "
                         "name:field=value:... in letters, digits and _ . , = + -")
    name, *parts = label.split(":")
    if name not in DESIGNS:
        raise ValueError(f"design {label!r}: unknown design {name!r}; expected one of {sorted(DESIGNS)}, "
                         "optionally with options: name:field=value:...")
    kind = DESIGNS[name]["residual"]
    takes = kind_options(kind)
    hints = {**typing.get_type_hints(ModelConfig),
             **{f: t for f, t in typing.get_type_hints(OptimConfig).items() if f in OPTIM_VARIANT_FIELDS}}
    variants = [f for f in VARIANT_FIELDS if f not in OPTIM_VARIANT_FIELDS or f in kind_optim_fields(kind)]
    options: dict = {}
    for part in parts:
        field, eq, value = part.partition("=")
        if not eq or not field or not value:
            raise ValueError(f"design {label!r}: {part!r} is not field=value (options are separated by colons: "
                             "name:field=value:field=value)")
        if field not in takes and field not in variants:
            named = [f for f in takes if MODEL_OPTIONS[f].name == field]
            if named:  # the stream's own name of an option the config names otherwise (GR's rank)
                raise ValueError(f"design {label!r}: the option {field!r} of {name!r} is written "
                                 f"{named[0]!r}: {name}:{named[0]}={value}")
            raise ValueError(f"design {label!r}: {field!r} is not an option of {name!r} (a {kind} design); "
                             f"it takes {sorted(takes) + variants}")
        if field in options:
            raise ValueError(f"design {label!r}: {field!r} is given twice")
        options[field] = parse_value(value, hints[field], field, f"design {label!r}:")
    return name, options


#: the optimizer fields a design of ``compare --from`` may set: the learning rate (both), the
#: routing's (a conversion: the source has no routing)
FOLDER_OPTIM_FIELDS = {"source": ("lr",), "convert": ("lr", "routing_lr_scale")}


def parse_folder_design(label: str) -> tuple[str, dict]:
    """``(design, options)`` of a design of ``compare --from``: ``source`` (the folder's model as
    it is, the control) or ``convert`` with ``heads`` and ``block_layers`` (those of ``attnres
    convert``: one number of layers per block, or a comma list of each block's layers), their
    defaults filled in; either with the optimizer fields ``FOLDER_OPTIM_FIELDS`` allows it::

        source                          ->  ("source", {})
        convert:heads=2:block_layers=1  ->  ("convert", {"heads": 2, "block_layers": 1})
        convert:block_layers=2,2        ->  ("convert", {"heads": 8, "block_layers": [2, 2]})
        convert:routing_lr_scale=100    ->  ("convert", {"heads": 8, "block_layers": 4, "routing_lr_scale": 100.0})

    ``ValueError`` names the label and what is accepted for anything else (a native design)."""
    accepted = ("'source[:lr=X]' (the control: the folder's model as it is) and "
                "'convert[:heads=H][:block_layers=L][:lr=X][:routing_lr_scale=S]'")
    if not isinstance(label, str) or not label or set(label) - LABEL_CHARACTERS:
        raise ValueError(f"design {label!r}: under --from the designs are {accepted}")
    name, *parts = label.split(":")
    if name not in FOLDER_DESIGNS:
        raise ValueError(f"design {label!r}: under --from the designs are {accepted}; attnres's own designs "
                         f"({name!r}) are compared without --from")
    options = dict(CONVERT_DEFAULTS) if name == "convert" else {}
    given = set()
    for part in parts:
        field, eq, value = part.partition("=")
        takes = FOLDER_OPTIM_FIELDS[name] + (tuple(CONVERT_DEFAULTS) if name == "convert" else ())
        if field not in takes or not eq or field in given:
            raise ValueError(f"design {label!r}: {part!r} is not an option; 'source' takes lr=X, 'convert' takes "
                             f"heads=H and block_layers=L (a number, or a comma list of each block's layers), lr=X "
                             f"and routing_lr_scale=S, once each")
        given.add(field)
        if field in FOLDER_OPTIM_FIELDS[name]:
            try:
                options[field] = float(value)
            except ValueError:
                raise ValueError(f"design {label!r}: {field}={value!r} must be a number") from None
            continue
        try:
            numbers = [int(v) for v in value.split(",")]
        except ValueError:
            raise ValueError(f"design {label!r}: {field}={value!r} must be a whole number"
                             f"{'' if field == 'heads' else ' or a comma list of them'}") from None
        if field == "heads" and len(numbers) != 1:
            raise ValueError(f"design {label!r}: heads={value!r} must be one whole number")
        options[field] = numbers[0] if len(numbers) == 1 else numbers
    return name, options


def design_kind(label: str) -> str:
    """The residual kind of a design's label."""
    return DESIGNS[parse_design(label)[0]]["residual"]


def design_options(base: ModelConfig, label: str, overrides: dict | None = None) -> dict:
    """The residual kind and options of design ``label`` (a name of ``DESIGNS`` with its own
    options, ``parse_design``) for ``base``'s sizes: the design's defaults, then ``overrides``
    (residual options the user set for every design) where its kind takes them, then the
    label's own options, which win; ``norm_eps`` only when given (else the model's config
    takes the design's kind's default)."""
    name, own = parse_design(label)
    options = dict(DESIGNS[name])
    if options.get("heads") == "n_kv_heads":
        options["heads"] = base.n_kv_heads
    if "num_blocks" in options:
        options["num_blocks"] = min(options["num_blocks"], base.num_sublayers)
    takes = STREAMS[options["residual"]].options()
    shared = {name: value for name, value in (overrides or {}).items()
              if name == "residual" or name in EVERY_DESIGN or MODEL_OPTIONS[name].name in takes}
    for given in (shared, own):  # the label's own options last: they win
        sizing = set(BLOCK_SIZING) & set(given)
        if sizing:  # one way of sizing the blocks replaces another given before
            for name in set(BLOCK_SIZING) - sizing:
                options.pop(name, None)
        options.update(given)
    return options


def design_config(base: ModelConfig, label: str, overrides: dict | None = None,
                  options: dict | None = None, epsilons: dict | None = None) -> ModelConfig:
    """``base``'s sizes with design ``label``'s residual options (``options``, when already
    made by ``design_options``; its optimizer fields aside) and its ``norm_eps``: the one among
    them, else its residual kind's default, never the base's: ``epsilons``' (a saved comparison's
    ``kind_norm_eps``) when given, this version's (``model_config.default_norm_eps``) otherwise."""
    sizes = {f: getattr(base, f) for f in SIZE_FIELDS}
    options = options or design_options(base, label, overrides)
    fields = {**sizes, **{k: v for k, v in options.items() if k not in OPTIM_VARIANT_FIELDS}}
    if fields.get("norm_eps") is None and epsilons and fields["norm_eps_scale"] == "absolute":
        fields["norm_eps"] = epsilons.get(fields["residual"])
    return ModelConfig(**fields)


def check_overrides(designs, overrides: dict) -> None:
    """Every residual option the user set must apply to at least one chosen design, and
    ``residual`` (the designs choose it) must agree with all of them."""
    kinds = {label: design_kind(label) for label in designs}
    for name, value in overrides.items():
        if name in EVERY_DESIGN:
            if all(name in parse_design(label)[1] for label in designs):
                raise ValueError(f"--set model.{name}={value!r} applies to none of the designs {list(designs)}: "
                                 f"each sets its own ({name}=... in its label); leave it out")
            continue
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


def check_shared_optim(designs, given: dict[str, str], folder: bool = False) -> None:
    """Refuse an optimizer field set for every design (``given``: ``"optim.lr"`` -> how it was
    given, ``"--set optim.lr=1e-3"`` or a sweep's ``"--over optim.lr=1e-3,2e-3"``) that reaches
    none of them: each design's label sets its own (``prenorm:lr=8e-3``; ``OPTIM_VARIANT_FIELDS``)
    or it does not apply to the design (``kind_optim_fields``; a design of ``compare --from``, when
    ``folder``: ``FOLDER_OPTIM_FIELDS``). It would change nothing."""
    def reaches(label: str, name: str) -> bool:
        if folder:
            design, own = parse_folder_design(label)
            return name in FOLDER_OPTIM_FIELDS[design] and name not in own
        design, own = parse_design(label)
        return name in kind_optim_fields(DESIGNS[design]["residual"]) and name not in own

    for key, how in given.items():
        section, _, name = key.partition(".")
        if section == "optim" and name in OPTIM_VARIANT_FIELDS and not any(reaches(label, name) for label in designs):
            raise ValueError(f"{how} applies to none of the designs {list(designs)}: each sets its own ({name}=... "
                             f"in its label) or does not take it; leave it out, or give designs it applies to "
                             f"(--designs)")


def check_labels(designs) -> None:
    """Each label parses (``parse_design``); no two are the same variant written differently
    (``full:key_norm=false`` and ``full:key_norm=False``), and no two share a folder name
    (``label_path``) on a filesystem that ignores case."""
    paths: dict[str, str] = {}
    variants: dict[tuple, str] = {}
    for label in designs:
        design, options = parse_design(label)
        other = variants.setdefault((design, frozenset(options.items())), label)
        if other != label:
            raise ValueError(f"designs {other!r} and {label!r} are the same variant; give it once")
        other = paths.setdefault(label_path(label).lower(), label)
        if other != label:
            raise ValueError(f"designs {other!r} and {label!r} would share the folder {label_path(label)!r}; "
                             "write one of them differently")


def split_residual_overrides(assignments) -> tuple[list[str], dict]:
    """``--set`` assignments split into those of the shared config and the designs' own ones
    (``model.residual``, ``model.<option>`` and those of ``EVERY_DESIGN``), the latter parsed:
    ``(others, {field: value})``."""
    hints = typing.get_type_hints(ModelConfig)
    others, overrides = [], {}
    for assignment in assignments:
        key, _, value = assignment.partition("=")
        section, _, name = key.partition(".")
        if section == "model" and (name in MODEL_OPTIONS or name in ("residual", *EVERY_DESIGN)) and "=" in assignment:
            overrides[name] = parse_value(value, hints[name], key)
        else:
            others.append(assignment)
    return others, overrides


def kind_epsilons() -> dict[str, float]:
    """Each residual kind's default ``norm_eps`` (``model_config.default_norm_eps``), as
    ``compare.json`` and ``sweep.json`` record it (``EPSILONS_KEY``)."""
    return {kind: default_norm_eps(kind) for kind in KINDS}


#: the key under which a comparison's or sweep's file records ``kind_epsilons``; one written
#: before each kind had its own default lacks it
EPSILONS_KEY = "kind_norm_eps"


def saved_epsilons(designs, overrides: dict, config: dict, epsilons: dict | None) -> tuple[dict, dict | None]:
    """``(overrides, epsilons)`` of a saved comparison or sweep point (its ``designs``, the
    designs' own options ``overrides``, its shared ``config`` and its ``kind_norm_eps``), as
    planned now: a file that records each kind's default epsilon is planned with those, whatever
    this version's are. One without them was written when every design took its shared config's
    ``norm_eps``: that value is then given to every design (as ``--set model.norm_eps`` gives it
    now) that does not set its own, so that the comparison continues as it began."""
    if epsilons is not None:
        return overrides, dict(epsilons)
    model = config.get("model")
    if model is None or "norm_eps" in overrides or all("norm_eps" in parse_design(d)[1] for d in designs):
        return overrides, None
    return {**overrides, "norm_eps": model["norm_eps"]}, None


def optim_fields(options: dict) -> dict:
    """A design's optimizer fields among its options (``OPTIM_VARIANT_FIELDS``)."""
    return {k: v for k, v in options.items() if k in OPTIM_VARIANT_FIELDS}
