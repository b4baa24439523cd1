"""Train several residual designs on the same data, batches, seed and budget; then report.

A signal stops a comparison, not only its current run: the run's checkpoint is saved, no other
run starts, ``compare.json`` says ``"complete": false`` with the steps each run reached, and
``resume_comparison`` (``attnres compare --resume``) continues it where it stopped.

With ``budgets`` (``attnres compare --budgets 1 1.5 2 3``) the baseline also trains at each
multiple of the budget (``run.steps`` times it, rounded to the nearest step; warmup unchanged,
the schedule's decay stretched over the new length, evaluations every ``run.eval_every`` steps
as before, so at the same token counts), as runs labelled ``<baseline>@x<multiple>``
(``analysis.budget.budget_run_label``) that stay out of the paired table; before training, each
design's step is timed against the baseline's (``step_times``). The report places each design
on the baseline's loss-against-budget curve: its compute-equivalent multiplier
(``analysis/budget.py``).

A comparison of a model folder (``attnres compare --from MODEL_DIR``, ``base.init_from`` set)
trains the folder's model as it is (the design ``source``, the control) against its Delta
conversions (``convert[:heads=H][:block_layers=L]``, ``designs.parse_folder_design``), each
written once into ``models/`` of the comparison's folder: the layer that reads the folders'
format hands them over (``folders``, ``attnres.experiments.comparison_folders.ComparisonFolders``). Every run logs
each of its first ``shock_steps`` steps (``run.log_first``), from which the report measures the
conversion's optimization shock against the control.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import signal
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ..analysis.budget import MAX_BUDGET, budget_run_label, check_budgets
from ..analysis.comparison import label_path
from ..analysis.comparison_record import ComparisonRecord, RunRecord, read_record, write_record
from ..analysis.report import check_report_dependencies, choose_baseline, run_name, write_report
from ..files import new_folder, read_json
from ..model import ModelConfig
from ..names import DEFAULT_DESIGNS
from ..train.checkpoint import latest_checkpoint
from ..train.config import DATA_SEED_STRIDE, TrainConfig, from_dict, to_dict
from .designs import (check_labels, check_overrides, design_config, design_options, kind_epsilons, optim_fields,
                      parse_folder_design, saved_epsilons)
from ..train.lock import FolderLock
from ..train.machine import machine
from .routing_movement import routing_movement
from ..train.run_files import RUN_FILES
from ..signals import Signals, exit_status
from .step_times import STEP_TIME_ROUNDS, time_steps
from ..train.run_model import OwnModel, RunModel
from ..train.trainer import train
from ..train.distributed import pick_device  # noqa: I001
from ..train.validate import check_backend, check_run, max_seed, shared_part, window_problem

@dataclass
class Plan:
    """What a comparison trains, checked: the shared config, the designs and seeds in order, the
    baseline, and each design's residual options and model config."""

    base: TrainConfig
    designs: list[str]
    seeds: list[int]
    baseline: str
    options: dict[str, dict]
    configs: dict[str, ModelConfig]
    #: a design whose settings are another's, written differently -> that design (an A/A control)
    repeats: dict[str, str] = dataclasses.field(default_factory=dict)
    #: the budgets the baseline also trains at (multiples of ``run.steps``; 1 first), or None
    budgets: list[float] | None = None
    #: a comparison of a model folder (``base.init_from``): ``folders(label, root)`` is the
    #: ``SavedModel`` of design ``label`` (the source, or a conversion written under ``root``)
    folders: object | None = None
    #: what ``compare.json`` records of the comparison's source beside the plan (a folder's:
    #: ``init_from`` and ``shock_steps``; nothing for attnres's own designs)
    source_entries: dict = dataclasses.field(default_factory=dict)
    #: the residual options given for every design (``compare``'s ``overrides``), as given
    overrides: dict = dataclasses.field(default_factory=dict)
    #: each residual kind's default epsilon the designs not given one take (``kind_norm_eps``)
    epsilons: dict = dataclasses.field(default_factory=kind_epsilons)

    @property
    def budget_runs(self) -> dict[str, float]:
        """The baseline's runs at the larger budgets: label -> multiple."""
        return {budget_run_label(self.baseline, b): b for b in self.budgets or () if b != 1}

    @property
    def labels(self) -> list[str]:
        """Every run's label, seed by seed in this order: the designs, then the budget runs."""
        return [*self.designs, *self.budget_runs]

    def run_config(self, label: str, seed: int) -> TrainConfig:
        """The run of ``label`` (a design or a budget run) for ``seed``: the design's model and
        optimizer fields, the budget's steps."""
        budget = self.budget_runs.get(label, 1)
        design = self.baseline if label in self.budget_runs else label
        optim = optim_fields(self.options[design])
        steps = max(1, round(self.base.run.steps * budget))
        return dataclasses.replace(self.base, model=self.configs[design], optim=dataclasses.replace(self.base.optim, **optim),
                                   run=dataclasses.replace(self.base.run, seed=seed, steps=steps))

    def run_model(self, label: str, root: Path) -> RunModel:
        """The model design ``label`` trains (``run_model.RunModel``): the ``SavedModel`` of a
        comparison --from a folder, attnres's own otherwise."""
        return OwnModel() if self.folders is None else self.folders(label, root)


def plan_folder_comparison(base: TrainConfig, designs: list[str], seeds: list[int], overrides: dict,
                           baseline: str | None, budgets, folders) -> Plan:
    """A comparison --from a folder (``base.init_from``): its designs (``source``, the control
    and baseline, and conversions) and their options, checked against the folder's model by
    ``folders.check`` before any work."""
    if budgets is not None:
        raise ValueError("--budgets trains the baseline at larger budgets for attnres's own designs; a comparison "
                         "--from a folder compares conversions with their control at one budget")
    if overrides:
        raise ValueError(f"--set model.{next(iter(overrides))}: the models of a comparison --from a folder are the "
                         f"folder's and its conversions' (their options are the designs', convert:heads=H:...)")
    options, paths, same = {}, {}, {}
    for label in designs:
        name, values = parse_folder_design(label)
        options[label] = {"design": name, **values}
        if name == "source" and base.optim.routing_lr_scale != 1.0:
            options[label]["routing_lr_scale"] = 1.0  # the control has no routing to scale
        try:
            check_run(dataclasses.replace(base, optim=dataclasses.replace(base.optim, **optim_fields(options[label]))))
        except ValueError as err:
            raise ValueError(f"design {label!r}: {err}") from None
        other = paths.setdefault(label_path(label).lower(), label)
        if other != label:
            raise ValueError(f"designs {other!r} and {label!r} would share the folder {label_path(label)!r}; "
                             "write one of them differently")
        same.setdefault(json.dumps(options[label], sort_keys=True), label)
    repeats = {label: same[json.dumps(o, sort_keys=True)] for label, o in options.items()
               if same[json.dumps(o, sort_keys=True)] != label}
    if "source" not in designs:
        raise ValueError(f"designs {designs}: a comparison --from a folder compares conversions with their control, "
                         f"the folder's model trained as it is: include the design 'source'")
    if baseline not in (None, "source"):
        raise ValueError(f"--baseline {baseline!r}: under --from the baseline is the control, 'source'")
    folders.check(options, base)
    return Plan(base, designs, seeds, "source", options, {label: None for label in designs}, repeats, None, folders,
                {"init_from": base.init_from, "shock_steps": base.run.log_first}, overrides)


def plan_comparison(base: TrainConfig, designs, seeds, overrides: dict,
                    baseline: str | None, budgets=None, folders=None, epsilons: dict | None = None) -> Plan:
    """Every setting of a comparison checked before any work (``compare``'s arguments);
    ``folders`` for a comparison --from a folder (``plan_folder_comparison``): the command that
    read ``--from`` (or a resumed ``compare.json``'s ``init_from``) makes them, and past it
    nothing asks again which kind of model the comparison trains. ``epsilons``: each residual
    kind's default epsilon (a saved comparison's ``kind_norm_eps``; default this version's)."""
    epsilons = kind_epsilons() if epsilons is None else epsilons
    check_run(shared_part(base))
    budgets = None if budgets is None else check_budgets(budgets)
    if budgets is not None:
        if len(budgets) < 2:
            raise ValueError(f"--budgets {budgets}: give 1 and at least one larger multiple (e.g. 1 1.5 2 3): the "
                             f"baseline's curve needs two points")
        if budgets[-1] > MAX_BUDGET:
            raise ValueError(f"--budgets {budgets}: {budgets[-1]:g} would train the baseline for {budgets[-1]:g} "
                             f"times the designs' {base.run.steps} steps; the multiples go up to {MAX_BUDGET:g} "
                             f"(e.g. 1 1.5 2 3)")
        uneven = [b for b in budgets if abs(base.run.steps * b - round(base.run.steps * b)) > 1e-9]
        if uneven:
            raise ValueError(f"--budgets {uneven}: run.steps={base.run.steps} times each multiple must be a whole "
                             f"number of steps, so that each budget run trains exactly its multiple")
    designs, seeds = list(designs), list(seeds)
    for name, values in (("designs", designs), ("seeds", seeds)):
        if not values or len(set(values)) != len(values):
            raise ValueError(f"{name} {values} must be given, each once")
    if any(type(s) is not int or s < 0 for s in seeds):
        raise ValueError(f"seeds {seeds} must be integers >= 0")
    top = max_seed(base.run.steps)
    if any(s > top for s in seeds):
        raise ValueError(f"seeds {seeds} must be integers in [0, {top}] (run.seed: each step's data seed, "
                         f"run.seed * {DATA_SEED_STRIDE} + step, must fit in a 64-bit integer)")
    check_report_dependencies(len(seeds))
    if folders is not None:  # the command's choice: the models of a folder and its conversions
        return plan_folder_comparison(base, designs, seeds, overrides, baseline, budgets, folders)
    check_labels(designs)
    baseline = choose_baseline(designs, baseline)
    check_overrides(designs, overrides)
    options, configs, repeats = {}, {}, {}
    device = pick_device(base.run.device)
    for label in designs:
        options[label] = design_options(base.model, label, overrides)
        if options[label]["residual"] == "prenorm" and base.optim.routing_lr_scale != 1.0:
            options[label]["routing_lr_scale"] = 1.0  # --set optim.routing_lr_scale: for the designs that route
        try:
            configs[label] = design_config(base.model, label, options=options[label], epsilons=epsilons)
            if "window" in options[label] and window_problem(configs[label]):  # given: a design has no window of its own
                raise ValueError(window_problem(configs[label]))
            optim = optim_fields(options[label])
            check_run(dataclasses.replace(base, model=configs[label], optim=dataclasses.replace(base.optim, **optim)))
            check_backend(configs[label], device)  # before the first design trains, not at its turn
        except ValueError as err:
            raise ValueError(f"design {label!r}: {err}") from None
        same = next((other for other in configs if other != label and configs[other] == configs[label]
                     and optim_fields(options[other]) == optim_fields(options[label])), None)
        if same is not None:
            repeats[label] = same
    plan = Plan(base, designs, seeds, baseline, options, configs, repeats, budgets, overrides=overrides,
                epsilons=epsilons)
    for label in plan.budget_runs:  # a longer run's seeds must still fit (max_seed)
        check_run(plan.run_config(label, max(seeds)))
    return plan


@dataclass
class ComparisonOutcome:
    """A comparison's report, and the signal that stopped it (None when it ran to its end)."""

    report: Path
    signal: int | None = None

    @property
    def exit_code(self) -> int:
        """The command's exit status: 0, or 130 after SIGINT and 143 after SIGTERM."""
        return exit_status(self.signal)


def compare(base: TrainConfig, designs=DEFAULT_DESIGNS, seeds=(0,), out_dir: str | Path = "runs",
            log=print, overrides: dict | None = None, baseline: str | None = None,
            command: list[str] | None = None) -> Path:
    """Train every design for every seed into ``out_dir/compare-<timestamp>/``; returns the
    path of the report. ``overrides``: residual options (``model.<option>`` fields) that apply
    to every chosen design that takes them, replacing the design's own value. ``baseline``: the
    design the others are compared with (default ``prenorm`` when chosen, else the first).
    ``command``: the command line that asked for the comparison, for the report to quote.
    ``run_comparison`` says too whether a signal stopped it."""
    plan = plan_comparison(base, designs, seeds, overrides or {}, baseline)
    return run_comparison(plan, out_dir=out_dir, log=log, command=command).report


def run_comparison(plan: Plan, *, out_dir: str | Path = "runs", root: Path | None = None, log=print,
                   command: list[str] | None = None, extra: dict | None = None,
                   allow_mixed_data: bool = False) -> ComparisonOutcome:
    """Train what ``plan`` (``plan_comparison``'s, checked) holds; returns the report and the
    signal that stopped it. ``compare.json`` is written before the first run (``"complete":
    false`` until every run finished) and after each; it holds what ``resume_comparison`` needs
    to continue: the shared config, the residual options given, the budgets, and per run the
    steps planned and done. ``root``: the comparison's folder (made here; default a new
    ``out_dir/compare-<timestamp>``); ``command``: the command line that asked for it, for the
    report to quote; ``extra``: more of ``compare.json``'s keys (what a comparison --from a
    folder evaluates after training); ``allow_mixed_data``: see ``train_designs``."""
    base = plan.base
    for label, same in plan.repeats.items():
        log(f"design {label!r} has the settings of {same!r}: it repeats that design (an A/A control)")
    if root is None:
        root = new_folder(Path(out_dir), time.strftime("compare-%Y%m%d-%H%M%S"))
    else:
        root.mkdir(parents=True)
    record = ComparisonRecord(plan.designs, plan.seeds, complete=False, baseline=plan.baseline, command=command,
                              steps=base.run.steps, config=to_dict(base), overrides=plan.overrides,
                              budgets=plan.budgets, kind_norm_eps=plan.epsilons, **plan.source_entries,
                              **(extra or {}))
    write_record(root, record)
    return train_designs(root, plan, record, log, allow_mixed_data)


def resume_comparison(root: str | Path, log=print, folders=None, allow_mixed_data: bool = False) -> ComparisonOutcome:
    """Continue the comparison in ``root`` where it stopped, with its own settings: the runs it
    finished are kept, each unfinished one continues from its checkpoint (``train``'s resume;
    one without a checkpoint starts over), and those not started run. ``folders``: the models
    of a comparison --from a folder (its config's ``init_from``). Its runs' corpus must be the
    one read now, unless ``allow_mixed_data`` (``train_designs``)."""
    root = Path(root)
    path = root / "compare.json"
    record = read_record(root)
    lacking = [key for key in ("config", "steps", "overrides") if getattr(record, key) is None]
    if lacking:
        raise ValueError(f"{path} lacks {lacking}: it was written before `attnres compare "
                         "--resume` existed, or edited by hand; run the comparison again")
    base = saved_config(root, record)
    if not isinstance(record.overrides, dict) or record.steps != base.run.steps:
        raise ValueError(f"{path}: 'overrides' or 'steps' do not agree with its 'config'; "
                         "was it edited by hand?")
    overrides, epsilons = saved_epsilons(record.designs, record.overrides, record.config, record.kind_norm_eps)
    plan = plan_comparison(base, record.designs, record.seeds, overrides, record.baseline, record.budgets, folders,
                           epsilons)
    if _all_finished(record, plan):
        raise ValueError(f"the comparison in {root} is complete: nothing to resume "
                         f"(`attnres report {root}` rebuilds its report)")
    return train_designs(root, plan, record, log, allow_mixed_data)


def saved_config(root: Path, record: ComparisonRecord) -> TrainConfig:
    """The shared config a comparison saved in its ``record``, read back; ``ValueError`` naming
    the file when it lacks one or holds one that does not read."""
    path = Path(root) / "compare.json"
    if record.config is None:
        raise ValueError(f"{path} lacks its 'config': it was written before `attnres compare --resume` existed, or "
                         f"edited by hand; run the comparison again")
    try:
        return from_dict(record.config)
    except ValueError as err:
        raise ValueError(f"{path}: 'config' is {err}") from None


def repoint_source(root: Path, record: ComparisonRecord, init_from: str) -> None:
    """Record in ``compare.json`` (``record``, updated in place) that the source folder of the
    comparison --from a folder in ``root`` is now ``init_from`` (``compare --resume --source``,
    once the folder there is known to hold the model the comparison started from)."""
    record.init_from = init_from
    record.config = {**record.config, "init_from": init_from}
    write_record(Path(root), record)


def _all_finished(record: ComparisonRecord, plan: Plan) -> bool:
    pairs = itertools.product(plan.seeds, plan.labels)
    return all(record.finished(label, seed) for seed, label in pairs)


def recorded_data(root: Path, record: ComparisonRecord) -> dict[str, list[str]]:
    """The corpora the comparison's runs so far read: ``data_sha256`` (their ``summary.json``'s)
    -> the runs' folders. Runs recorded without a digest are left out."""
    read: dict[str, list[str]] = {}
    for entry in record.runs:
        summary = root / entry.dir / "summary.json"
        digest = read_json(summary).get("data_sha256") if summary.is_file() else None
        if digest:
            read.setdefault(digest, []).append(entry.dir)
    return read


def check_same_data(root: Path, record: ComparisonRecord, corpus, source: str, allow: bool, log) -> None:
    """Refuse (unless ``allow``: then a warning) to continue a comparison whose runs read another
    corpus than ``corpus`` (``data.source=source``, read now): a paired difference between a run
    of each would hold the data's difference too. ``data.source=stdlib`` reads the installed
    interpreter's library, so a comparison resumed under another Python meets this."""
    here = corpus.digest()
    other = {digest: runs for digest, runs in recorded_data(root, record).items() if digest != here}
    if not other:
        return
    read = "; ".join(f"{', '.join(runs)} read {digest}" for digest, runs in other.items())
    text = (f"the comparison in {root} holds runs that read other data than data.source={source!r} reads here "
            f"({corpus.description}: data_sha256 {here}): {read}. A paired difference between runs of different "
            f"data holds the data's difference too")
    if not allow:
        raise ValueError(f"{text}. Continue it where its data is the same (data.source=stdlib is the installed "
                         f"Python's: use the Python version its runs used), or give --allow-mixed-data to mix them "
                         f"(the report then says which run read which)")
    log(f"warning: {text}; continuing (--allow-mixed-data)")


def train_designs(root: Path, plan: Plan, record: ComparisonRecord, log, allow_mixed_data: bool = False
                  ) -> ComparisonOutcome:
    """Train, seed by seed, each design that ``record`` does not hold as finished, recording
    each run in ``compare.json`` as it ends; then the report. A SIGINT or SIGTERM stops the run
    in progress (its checkpoint saved) and the comparison: no other run starts. The corpus is
    checked first against the one the runs so far read (``check_same_data``)."""
    start, spent = time.time(), record.wall_time_s or 0.0
    if record.machines is None:
        record.machines = []
    here, seen = machine(pick_device(plan.base.run.device))["id"], record.machines
    if seen and here not in seen:
        log(f"warning: this machine ({here}) is not the one that trained the comparison's runs so far "
            f"({', '.join(seen)}): runs reproduce bit for bit on one machine only, so a pair whose runs ran on "
            f"different machines differs by the machines' arithmetic too; the report lists which ran where")
    if here not in seen:
        seen.append(here)
    with Signals() as signals:
        # the model's tokens: a BPE tokenizer cached in root, a folder's tokenizer, the bytes
        _, corpus = plan.run_model("source", root).fit_data(plan.base, root, None)
        check_same_data(root, record, corpus, plan.base.data.source, allow_mixed_data, log)
        if plan.budget_runs and record.step_times is None:
            log(f"timing each design's step against {plan.baseline}'s ({STEP_TIME_ROUNDS} rounds, part of no run)")
            configs = {label: plan.run_config(label, plan.seeds[0]) for label in plan.designs}
            record.step_times = time_steps(configs, plan.baseline, corpus, root / ".step-times")
            write_record(root, record)
        for seed, label in itertools.product(plan.seeds, plan.labels):
            if signals.received is not None:
                break
            if record.finished(label, seed):
                continue
            record.record(train_design(root, plan, label, seed, corpus, lambda text: log(
                f"[{time.time() - start:5.0f}s] {text}")))
            record.wall_time_s = spent + time.time() - start
            write_record(root, record)
        record.complete = _all_finished(record, plan)
        record.stopped_by = None
        if signals.received is not None and not record.complete:
            record.stopped_by = signal.Signals(signals.received).name
        record.wall_time_s = spent + time.time() - start
        write_record(root, record)
        report = write_report(root)
    if not record.complete:
        log(f"stopped by {record.stopped_by or 'a signal'}: the comparison is incomplete; "
            f"continue it with: attnres compare --resume {root}")
    return ComparisonOutcome(report, signals.received)


def _how_to_start(run_dir: Path, steps: int) -> tuple[str, Path | None]:
    """How a design's run starts in ``run_dir``, and its latest checkpoint: ``new`` (no run
    there), ``resume`` (a checkpoint before the last step), ``trained`` (the last checkpoint and
    the summary of all ``steps``: only its analysis is missing) or ``over`` (a run that left no
    checkpoint to continue from: started over)."""
    if not any((run_dir / name).exists() for name in RUN_FILES):
        return "new", None
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    if ckpt is None:
        return "over", None
    if int(ckpt.name.split("-")[1]) < steps:
        return "resume", ckpt
    summary = run_dir / "summary.json"
    if summary.exists() and read_json(summary).get("steps") == steps:
        return "trained", ckpt
    return "over", ckpt


def train_design(root: Path, plan: Plan, label: str, seed: int, corpus, log) -> RunRecord:
    """Train design ``label`` for ``seed`` (or continue it: ``_how_to_start``), write its
    analysis once it has finished, and return its entry of ``compare.json``. The comparison
    holds the design's folder (``lock.FolderLock``) from its first look at it to its analysis."""
    with FolderLock(root / run_name(label, seed, plan.seeds)):
        return _train_design(root, plan, label, seed, corpus, log)


def _train_design(root: Path, plan: Plan, label: str, seed: int, corpus, log) -> RunRecord:
    name = run_name(label, seed, plan.seeds)
    cfg, run_dir = plan.run_config(label, seed), root / name
    spec = plan.run_model(label, root)
    cfg = spec.run_config(cfg)
    steps = cfg.run.steps
    how, ckpt = _how_to_start(run_dir, steps)
    if how == "trained":
        model, summary = spec.trained_module(run_dir, ckpt), read_json(run_dir / "summary.json")
    else:
        since = f", from its checkpoint {ckpt.name}" if how == "resume" else ""
        log(f"training {name} ({steps} steps){since}")
        if cfg.run.compile:
            # each run compiles its own model; the compiled code of the runs before it would fill
            # the compiler's cache of the shared forward, past whose limit it runs eager
            torch.compiler.reset()
        result = train(cfg, run_dir, corpus=corpus, resume=how == "resume", overwrite=how == "over", model=spec)
        model, summary = result.model, result.summary
    budget = plan.budget_runs.get(label)
    entry = RunRecord(label, seed, name, plan.options[plan.baseline if budget else label], steps, summary["steps"],
                      budget or None)
    if summary["steps"] < steps:
        log(f"{name} stopped at step {summary['steps']} of {steps}, its checkpoint saved")
        return entry
    analysis = spec.analysis(model, corpus, cfg)
    if analysis is None:  # a folder's model: a conversion's routing, how far it moved from the folder's
        movement = routing_movement(Path(cfg.init_from), run_dir)
        analysis = None if movement is None else {"routing_movement": movement}
    if analysis is not None:
        (run_dir / "analysis.json").write_text(json.dumps(analysis))
    log(f"{name}: validation loss {summary['final_val_loss']:.4f}")
    return entry
