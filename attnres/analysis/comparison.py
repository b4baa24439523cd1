"""A comparison as its folder holds it, read and checked, and the numbers the report gives.

A comparison folder holds one sub-folder per run (``<design>`` or ``<design>-seed<k>``) with
``config.json``, ``summary.json``, ``metrics.jsonl`` and ``analysis.json``; ``compare.json``
lists them in order (with the steps each planned and reached) and says whether the comparison is
complete. ``load_comparison`` reads them all, finds what an incomplete comparison lacks
(``run_status``), keeps the complete pairs (the seeds every design finished) and computes what
``results.json`` holds (``comparison_results``: the paired differences of ``analysis.stats``).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..files import read_json, read_jsonl
from .budget import compute_equivalent
from .comparison_record import ComparisonRecord, read_record
from .stats import mean_and_sd, paired_difference


#: what the report reads of each run's summary.json and metrics.jsonl rows (checked on reading)
SUMMARY_FIELDS = {"final_val_loss": (int, float, type(None)), "parameters": int,
                  "peak_memory_mib": (int, float)}


def metric_fields(row: dict) -> dict:
    number = (int, float)
    return {"split": str, "step": int, "tokens": int, **({"val_loss": number} if row.get("split") == "val" else {})}


def label_path(label: str) -> str:
    """The filesystem-safe form of a design's label (``name:field=value:...``), for folder and
    figure names: each colon written as ``+`` (``full:norm_eps=1e-12`` -> ``full+norm_eps=1e-12``)."""
    return label.replace(":", "+")


def run_name(design: str, seed: int, seeds) -> str:
    """The folder of ``design``'s run for ``seed`` in a comparison over ``seeds``: the design's
    label (``label_path``), with ``-seed<k>`` when there are several seeds."""
    name = label_path(design)
    return name if len(seeds) == 1 else f"{name}-seed{seed}"


def load_runs(compare_dir: Path) -> tuple[ComparisonRecord, list[dict]]:
    """The comparison's record (``compare.json``) and the runs it records, each as its record's
    entry with its saved files (``summary``, ``config``, ``metrics``, ``analysis``)."""
    compare_dir = Path(compare_dir)
    record = read_record(compare_dir)
    runs = []
    for entry in record.runs:
        d = compare_dir / entry.dir
        missing = [n for n in ("summary.json", "metrics.jsonl", "config.json") if not (d / n).exists()]
        if missing:
            raise ValueError(f"run {d} is incomplete: {missing} missing")
        run = entry.to_json()
        run["summary"] = read_json(d / "summary.json", SUMMARY_FIELDS)
        # a run that continued a folder's model (compare --from) has no model section: null
        run["config"] = read_json(d / "config.json", {"model": (dict, type(None)), "data": dict, "run": dict})
        run["metrics"] = read_jsonl(d / "metrics.jsonl", metric_fields)
        analysis = d / "analysis.json"
        run["analysis"] = read_json(analysis) if analysis.exists() else None
        runs.append(run)
    return record, runs


def _last_checkpoint(run_dir: Path) -> str:
    """``"; its last checkpoint is step N"`` from a run folder's ``checkpoints/latest``, or ''."""
    try:
        name = (run_dir / "checkpoints" / "latest").read_text()
        return f"; its last checkpoint is step {int(name.split('-')[1])}"
    except (OSError, ValueError, IndexError):
        return ""


def run_status(root: Path, record: ComparisonRecord, runs: list[dict]) -> dict[tuple[str, int], str | None]:
    """``(design, seed)`` -> None for every run the comparison plans that finished its steps,
    else what became of it: stopped at a step (``steps_done`` of ``steps`` in ``compare.json``,
    or for an older comparison its summary's steps against its config's), killed while it
    trained (a folder that ``compare.json`` does not record), or not started."""
    entries = {(r["design"], r["seed"]): r for r in runs}
    status = {}
    for seed in record.seeds:
        for design in [*record.designs, *record.budget_runs]:
            run, folder = entries.get((design, seed)), root / run_name(design, seed, record.seeds)
            if run is not None:
                steps = run.get("steps", run["config"].get("run", {}).get("steps"))
                done = run.get("steps_done", run["summary"].get("steps", steps))
                finished = steps is None or done >= steps
                status[design, seed] = None if finished else f"stopped at step {done} of {steps}"
            elif folder.is_dir():
                status[design, seed] = ("killed while it trained (compare.json has no record of it)"
                                        + _last_checkpoint(folder))
            else:
                status[design, seed] = "not started"
    return status


def by_design(runs: list[dict]) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {}
    for run in runs:
        out.setdefault(run["design"], []).append(run)
    return out


def val_curve(run: dict) -> dict[int, float]:
    """Validation loss by training tokens."""
    return {m["tokens"]: m["val_loss"] for m in run["metrics"] if m["split"] == "val"}


def choose_baseline(designs, requested: str | None = None) -> str:
    """``requested`` when given (it must be one of ``designs``), else ``prenorm`` when it is
    among them, else the first design."""
    designs = list(designs)
    if requested is not None:
        if requested not in designs:
            raise ValueError(f"baseline {requested!r} is not among the designs {designs}")
        return requested
    return "prenorm" if "prenorm" in designs else designs[0]


def final_losses(runs: list[dict]) -> dict[str, float]:
    """Seed (a string, as in results.json) -> final validation loss."""
    return {str(r["seed"]): r["summary"]["final_val_loss"] for r in runs}


def training_tokens(runs: list[dict]) -> dict[str, int]:
    """Seed (a string, as in results.json) -> the training tokens the run saw (its summary's)."""
    return {str(r["seed"]): r["summary"]["tokens"] for r in runs}


def unequal_tokens(designs: dict[str, list[dict]], baseline: str) -> dict[str, dict[str, list[int]]]:
    """Design -> seed -> ``[the baseline's tokens, the design's]`` where a pair did not see the
    same training tokens (a run resumed to more steps than the others, by hand): such a pair
    measures the budget as well as the design, so it is not compared."""
    base = training_tokens(designs[baseline])
    out = {}
    for name, runs in designs.items():
        differ = {seed: [base[seed], n] for seed, n in training_tokens(runs).items() if seed in base and base[seed] != n}
        if differ and name != baseline:
            out[name] = differ
    return out


def data_digest(runs: list[dict]) -> str | list[str] | None:
    """``results.json``'s ``data_sha256``: the digest of the tokens the runs read (their
    summaries'), a sorted list of them when they read different data (a comparison continued
    with ``--allow-mixed-data``), None when no run recorded one."""
    digests = sorted({r["summary"]["data_sha256"] for r in runs if r["summary"].get("data_sha256")})
    return None if not digests else digests[0] if len(digests) == 1 else digests


def tokens_per_parameter(runs: list[dict]) -> float | None:
    """A design's training tokens over its parameters (its first run's ``summary.json``: every
    seed trains as many of each), the regime a comparison measures; None without the counts."""
    summary = runs[0]["summary"] if runs else {}
    if not summary.get("tokens") or not summary.get("parameters"):
        return None
    return summary["tokens"] / summary["parameters"]


def comparison_results(designs: dict[str, list[dict]], baseline: str) -> dict:
    """What ``results.json`` holds: the digest of the tokens the runs read (``data_sha256``),
    every design's final validation loss per seed and its tokens per parameter, and for each
    design but the baseline its paired difference to the baseline (``analysis.stats``), only
    where every pair saw the same training tokens (else ``unequal_tokens``, no difference)."""
    base = final_losses(designs[baseline])
    unequal = unequal_tokens(designs, baseline)
    out = {"baseline": baseline, "data_sha256": data_digest([r for runs in designs.values() for r in runs]),
           "designs": {}}
    for name, runs in designs.items():
        losses = final_losses(runs)
        mean, sd = mean_and_sd(list(losses.values()))
        entry = {"val_loss": losses, "val_loss_mean": mean, "val_loss_sd": sd,
                 "tokens_per_parameter": tokens_per_parameter(runs)}
        if name in unequal:
            entry.update(diff_mean=None, ci95=None, verdict="unequal tokens", unequal_tokens=unequal[name])
        elif name != baseline:
            paired = paired_difference(base, losses)
            entry.update(diff_mean=paired["diff_mean"], ci95=paired["ci95"], verdict=paired["verdict"])
        out["designs"][name] = entry
    return out


def budget_curves(base: dict[str, float], budget_runs: dict[str, dict]) -> dict[str, list[float]]:
    """Seed -> the baseline's final losses at each budget, 1 first: ``base`` (seed -> its loss at
    budget 1) and ``budget_runs`` (``results.json``'s, in budget order: label -> ``{"val_loss":
    {seed: loss}}``); a seed missing a budget run is left out."""
    curves = {seed: [loss, *(run["val_loss"].get(seed) for run in budget_runs.values())] for seed, loss in base.items()}
    return {seed: curve for seed, curve in curves.items() if None not in curve}


def budget_results(record: ComparisonRecord, designs: dict[str, list[dict]], budget_runs: dict[str, list[dict]]
                   ) -> tuple[dict, dict[str, dict]]:
    """``results.json``'s budget numbers: ``{"budgets", "budget_runs"}`` (each of the baseline's
    runs at a larger budget with its final loss per seed), and design -> its
    ``compute_equivalent`` (``analysis.budget``) over the seeds whose every budget run
    finished, in wall-clock terms with the step times ``compare`` measured (``step_times``)."""
    budgets, baseline = record.budgets, record.baseline
    labels = record.budget_runs
    out = {"budgets": budgets, "budget_runs": {label: {"budget": b, "val_loss": final_losses(budget_runs.get(label, []))}
                                               for label, b in labels.items()}}
    curves = budget_curves(final_losses(designs.get(baseline, [])), out["budget_runs"])
    times = record.step_times or {}
    entries = {}
    for name, runs in designs.items():
        losses = {seed: loss for seed, loss in final_losses(runs).items() if seed in curves}
        if not losses:
            continue
        ratio = times.get(name, {}).get("ratio")
        entries[name] = compute_equivalent(budgets, curves, losses, ratio)
        if name in times:
            entries[name]["step_time_ratio"] = ratio
            entries[name]["step_time_ratio_range"] = times[name]["ratio_range"]
    return out, entries


def movement_results(designs: dict[str, list[dict]]) -> dict[str, dict]:
    """Design -> its routing's movement over its runs (``analysis.json``'s ``routing_movement``,
    ``experiments.routing_movement``: a conversion of ``compare --from``): the largest change over the
    seeds, the mean of their mean changes, and each seed's."""
    out = {}
    for name, runs in designs.items():
        seeds = {str(r["seed"]): r["analysis"]["routing_movement"] for r in runs
                 if r["analysis"] and r["analysis"].get("routing_movement")}
        if seeds:
            out[name] = {"max_abs": max(m["max_abs"] for m in seeds.values()),
                         "mean_abs": sum(m["mean_abs"] for m in seeds.values()) / len(seeds), "seeds": seeds}
    return out


@dataclass
class Comparison:
    """What every section of the report reads: the comparison's folder (where the figures go),
    its record (``compare.json``), its runs in order and grouped by design, the baseline and the
    numbers of ``results.json`` (``comparison_results``)."""

    root: Path
    record: ComparisonRecord
    runs: list[dict]
    designs: dict[str, list[dict]]
    baseline: str
    results: dict

    @property
    def seeds(self) -> list[int]:
        return sorted({r["seed"] for r in self.runs})

    def first_analyses(self, key: str) -> list[tuple[str, object]]:
        """``(design, value)`` of analysis field ``key`` from each design's first run, where it
        has one."""
        return [(name, runs[0]["analysis"][key]) for name, runs in self.designs.items()
                if runs[0]["analysis"] and runs[0]["analysis"].get(key)]


def load_comparison(compare_dir: Path, baseline: str | None = None) -> Comparison:
    """The comparison in ``compare_dir`` with its baseline: ``baseline`` when given, else the
    one the comparison chose (``choose_baseline``). Only complete pairs are compared: the runs
    of the seeds that every design finished (``run_status``); ``results`` says which seeds
    those are (``seeds``), whether the comparison is ``complete`` and what is ``missing``."""
    record, runs = load_runs(compare_dir)
    status = run_status(Path(compare_dir), record, runs)
    seeds = [s for s in record.seeds if all(status[d, s] is None for d in record.designs)]
    runs = [r for r in runs if r["seed"] in seeds]
    extra = record.budget_runs
    designs = by_design([r for r in runs if r["design"] not in extra])
    baseline = choose_baseline(record.designs, baseline or record.baseline)
    results = comparison_results(designs, baseline) if runs else dict(baseline=baseline, designs={})
    if record.budgets:
        finished = [r for r in runs if r["design"] in extra and status[r["design"], r["seed"]] is None]
        numbers, multipliers = budget_results(record, designs, by_design(finished))
        results.update(numbers)
        for name, entry in multipliers.items():
            results["designs"][name]["compute_equivalent"] = entry
    runs = [r for r in runs if r["design"] not in extra]
    if record.init_from and runs:  # a comparison --from a folder: the conversions against the control
        from .conversion_stats import downstream_results, shock_results

        for name, entry in shock_results(designs, baseline, record.shock_steps or 0).items():
            results["designs"][name]["shock"] = entry
        for name, entry in movement_results(designs).items():
            results["designs"][name]["routing_movement"] = entry
        downstream = downstream_results(Path(compare_dir), designs, baseline)
        if downstream is not None:
            results["downstream"] = downstream
    missing = [f"{d}, seed {s}: {text}" for (d, s), text in status.items() if text]
    results.update(complete=not missing, seeds=seeds, missing=missing)
    return Comparison(Path(compare_dir), record, runs, designs, baseline, results)
