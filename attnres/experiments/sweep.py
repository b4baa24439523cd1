"""A sweep: one comparison per point of a ladder, e.g. the same designs and seeds at
``model.n_layers`` 4, 8, 16 and 32, into one parent folder, summarized in ``sweep.json`` and a
figure of each design's gap to the baseline against the swept value.

``--over FIELD=V1,V2,...`` names a field and its values; several ``--over`` are zipped by
position (``--over model.dim=48,96,192 --over model.n_heads=2,4,8`` is three points). The swept
fields change the shared config of a point's comparison, never a design's own options: within a
point every design has the same sizes, budget and data (the comparison's guarantee), and only
the swept fields differ between points.

The parent folder holds ``sweep.json`` (written before the first point and after each: the
settings, each point's values and folder, ``"complete"``) and one comparison folder per point
(``point-0``, ...), each an ordinary comparison that ``attnres report`` reads. A signal stops the
sweep as it stops a comparison; ``resume_sweep`` (``attnres sweep --resume``) continues it: a
finished point is kept, an unfinished one resumes its comparison, the others start.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from ..analysis.comparison_record import read_record
from ..analysis.figures import pyplot, save_figure
from ..files import new_folder
from ..signals import Signals
from ..analysis.stats import mean_and_sd
from ..streams import MODEL_OPTIONS
from .compare import Plan, plan_comparison, resume_comparison, run_comparison
from .designs import EPSILONS_KEY, EVERY_DESIGN, kind_epsilons, saved_epsilons
from ..train.config import TrainConfig, apply_overrides, from_dict, to_dict
from ..train.validate import check_given

SWEEP_FILE = "sweep.json"
#: fields that are a design's, not the comparison's (a sweep over them would change designs within
#: a point), and fields a comparison sets itself (the seeds, its runs' names and folders)
NOT_SWEPT = ("model.residual", *(f"model.{name}" for name in (*MODEL_OPTIONS, *EVERY_DESIGN)), "run.seed", "run.name",
             "run.out_dir")


def parse_over(over: list[str]) -> dict[str, list[str]]:
    """``["model.dim=48,96", "model.n_heads=2,4"]`` -> ``{"model.dim": ["48", "96"], ...}``: each
    field once, each with the same number (at least one) of values, none a design's option."""
    fields: dict[str, list[str]] = {}
    for item in over:
        key, sep, values = item.partition("=")
        key = key.strip()
        if not sep or "." not in key or not values.strip():
            raise ValueError(f"--over {item!r}: give SECTION.FIELD=V1,V2,... (e.g. model.n_layers=4,8,16)")
        if key in fields:
            raise ValueError(f"--over names {key} twice: give each field once, its values comma-separated")
        if key in NOT_SWEPT:
            raise ValueError(f"--over {key}: a sweep changes what every design of a point shares (sizes, steps, "
                             f"data); the residual design, its options and its epsilon are the designs' own "
                             f"(e.g. block:block_size=4, block:norm_eps=1e-6), the seeds are --seeds', and run.name "
                             f"and run.out_dir the comparison's own")
        fields[key] = [v.strip() for v in values.split(",")]
        if any(not v for v in fields[key]):
            raise ValueError(f"--over {item!r}: an empty value")
    if not fields:
        raise ValueError("attnres sweep needs at least one --over SECTION.FIELD=V1,V2,...")
    counts = {key: len(values) for key, values in fields.items()}
    if len(set(counts.values())) != 1:
        raise ValueError(f"--over fields are zipped by position and must have as many values each: {counts}")
    return fields


def check_not_set(fields: dict[str, list[str]], given: list[str]) -> None:
    """Refuse a swept field that ``given`` (``--set`` assignments, ``--data`` as ``data.source=``)
    also sets: each point sets it, so the value given would be silently replaced."""
    for assignment in given:
        key = assignment.partition("=")[0].strip()
        if key in fields:
            option = "--data" if key == "data.source" else f"--set {key}"
            raise ValueError(f"{option} and --over {key}={','.join(fields[key])} both set {key}: each point of the "
                             f"sweep sets it to its own value; leave it out of {option.split()[0]}")


def sweep_points(fields: dict[str, list[str]]) -> list[dict[str, str]]:
    """The points of zipped ``fields``: ``[{field: value, ...}, ...]``."""
    n = len(next(iter(fields.values())))
    return [{key: values[k] for key, values in fields.items()} for k in range(n)]


def point_config(base: TrainConfig, point: dict[str, str]) -> TrainConfig:
    """``base`` with a point's values applied (as ``--set`` applies them), a swept setting that
    would do nothing in it refused (``validate.check_given``)."""
    cfg = apply_overrides(base, [f"{key}={value}" for key, value in point.items()])
    check_given(cfg, point)
    return cfg


@dataclass
class Sweep:
    """A sweep's settings, as ``sweep.json`` keeps them for ``--resume``."""

    base: TrainConfig
    fields: dict[str, list[str]]
    designs: list[str]
    seeds: list[int]
    overrides: dict
    baseline: str | None
    budgets: list[float] | None
    command: list[str] | None
    #: each residual kind's default epsilon (``kind_norm_eps``); None for a sweep saved before the
    #: kinds had their own, whose designs take each point's shared ``norm_eps`` (``saved_epsilons``)
    kind_norm_eps: dict | None = dataclasses.field(default_factory=kind_epsilons)

    def index(self) -> dict:
        return {"complete": False, "over": self.fields, "designs": self.designs, "seeds": self.seeds,
                "baseline": self.baseline, "budgets": self.budgets, "command": self.command,
                "config": to_dict(self.base), "overrides": self.overrides, EPSILONS_KEY: self.kind_norm_eps,
                "points": [{"values": point, "dir": f"point-{k}"} for k, point in enumerate(sweep_points(self.fields))]}


def write_sweep_index(root: Path, index: dict) -> None:
    """``sweep.json``, replaced atomically."""
    tmp = root / f".{SWEEP_FILE}.tmp"
    tmp.write_text(json.dumps(index, indent=2))
    os.replace(tmp, root / SWEEP_FILE)


def check_sweep(sweep: Sweep) -> list[Plan]:
    """Every point's comparison planned before any work, in the order of ``sweep_points``: each
    point's values must apply (a field that exists, a value of its type) and give a comparison
    the designs can run, and no two points may be the same settings (``2,2``, or ``2,02`` for a
    number: one comparison run twice). The plans are the ones the points then run."""
    seen: dict[str, str] = {}
    plans = []
    for point in sweep_points(sweep.fields):
        where = ", ".join(f"{k}={v}" for k, v in point.items())
        try:
            cfg = point_config(sweep.base, point)
            overrides, epsilons = saved_epsilons(sweep.designs, sweep.overrides, to_dict(cfg), sweep.kind_norm_eps)
            plans.append(plan_comparison(cfg, sweep.designs, sweep.seeds, overrides, sweep.baseline, sweep.budgets,
                                         epsilons=epsilons))
        except ValueError as err:
            raise ValueError(f"sweep point {where}: {err}") from None
        key = json.dumps(to_dict(cfg), sort_keys=True)
        if key in seen:
            raise ValueError(f"sweep points {seen[key]} and {where} are the same settings (one comparison run twice): "
                             f"give each value of --over once")
        seen[key] = where
    return plans


def run_sweep(sweep: Sweep, out_dir: str | Path = "runs", log=print) -> tuple[Path, int | None]:
    """Every point's comparison into ``out_dir/sweep-<timestamp>/``; returns the folder and the
    signal that stopped it (None when every point finished)."""
    plans = check_sweep(sweep)
    root = new_folder(Path(out_dir), time.strftime("sweep-%Y%m%d-%H%M%S"))
    index = sweep.index()
    write_sweep_index(root, index)
    return root, _run_points(root, sweep, index, plans, log)


def load_sweep(root: Path) -> tuple[Sweep, dict]:
    """The sweep that ``root/sweep.json`` describes, and the index itself."""
    path = Path(root) / SWEEP_FILE
    if not path.is_file():
        raise ValueError(f"{root} is not a sweep: {SWEEP_FILE} is missing")
    try:
        index = json.loads(path.read_text())
        sweep = Sweep(from_dict(index["config"]), {k: list(v) for k, v in index["over"].items()},
                      list(index["designs"]), list(index["seeds"]), dict(index["overrides"]), index["baseline"],
                      index["budgets"], index.get("command"), index.get(EPSILONS_KEY))
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError, ValueError) as err:
        raise ValueError(f"{path} is not a sweep's index ({err}); was it edited by hand?") from None
    if [p["values"] for p in index.get("points", [])] != sweep_points(sweep.fields):
        raise ValueError(f"{path}: its points do not follow its 'over'; was it edited by hand?")
    return sweep, index


def resume_sweep(root: str | Path, log=print, allow_mixed_data: bool = False) -> tuple[Path, int | None]:
    """Continue the sweep in ``root`` with its own settings: finished points are kept, an
    unfinished point's comparison resumes (its runs' corpus checked against the one read now
    unless ``allow_mixed_data``: ``compare.check_same_data``), the others start."""
    root = Path(root)
    sweep, index = load_sweep(root)
    if index.get("complete"):
        raise ValueError(f"the sweep in {root} is complete: nothing to resume")
    plans = check_sweep(sweep)
    return root, _run_points(root, sweep, index, plans, log, allow_mixed_data)


def _point_state(point_dir: Path) -> str:
    """``"new"`` (nothing there), ``"complete"`` or ``"started"`` (a comparison to resume)."""
    if not (point_dir / "compare.json").is_file():
        return "new"
    return "complete" if read_record(point_dir).complete else "started"


def _run_points(root: Path, sweep: Sweep, index: dict, plans: list[Plan], log,
                allow_mixed_data: bool = False) -> int | None:
    """Each point not yet complete: a started one's comparison resumed (it plans from its own
    ``compare.json``), a new one's run from its plan in ``plans``. The signal handlers are held
    over the whole loop (the comparisons share them): a signal between two points stops the
    sweep before the next one starts, as one during a point stops that point's comparison."""
    with Signals() as signals:
        for entry, plan in zip(index["points"], plans, strict=True):
            point_dir = root / entry["dir"]
            state = _point_state(point_dir)
            if state == "complete":
                continue
            if signals.received is not None:
                return signals.received
            where = ", ".join(f"{k}={v}" for k, v in entry["values"].items())
            log(f"sweep point {where}")
            if state == "started":
                outcome = resume_comparison(point_dir, log, allow_mixed_data=allow_mixed_data)
            else:
                if point_dir.exists():  # a point stopped before its comparison wrote its index
                    leftovers = sorted(p.name for p in point_dir.iterdir())
                    if leftovers:
                        raise ValueError(f"{point_dir} holds {leftovers[:3]} but no compare.json: move them away "
                                         f"to rerun the point")
                    point_dir.rmdir()
                outcome = run_comparison(plan, root=point_dir, log=log, command=sweep.command)
            if outcome.signal is not None:
                return outcome.signal
        index["complete"] = True
        index["summary"] = summarize_sweep(root, index)
        write_sweep_index(root, index)
        draw_sweep(root, index)
    return None


def summarize_sweep(root: Path, index: dict) -> list[dict]:
    """Per point: its values, and per design its final loss (mean and sd over seeds), its gap to
    the baseline with the paired interval, and its compute-equivalent multiplier where the
    comparison measured one (``results.json`` of the point's comparison)."""
    summary = []
    for entry in index["points"]:
        results = json.loads((root / entry["dir"] / "results.json").read_text())
        designs = {}
        for name, e in results["designs"].items():
            losses = [v for v in e["val_loss"].values() if v is not None]
            mean, sd = mean_and_sd(losses) if losses else (None, None)
            designs[name] = {"final_loss": mean, "final_loss_sd": sd, "gap": e.get("diff_mean"),
                             "ci95": e.get("ci95"), "verdict": e.get("verdict")}
            if "compute_equivalent" in e:
                designs[name]["compute_equivalent"] = e["compute_equivalent"]
        summary.append({"values": entry["values"], "dir": entry["dir"], "baseline": results["baseline"],
                        "designs": designs})
    return summary


def draw_sweep(root: Path, index: dict) -> Path:
    """``sweep.png``: each design's gap to the baseline (final loss, nats) against the swept value
    (the first ``--over`` field), with its paired 95% interval."""
    plt = pyplot()
    field = next(iter(index["over"]))
    xs = list(range(len(index["summary"])))
    labels = [p["values"][field] for p in index["summary"]]
    fig, ax = plt.subplots(figsize=(7, 4.2))
    baseline = index["summary"][0]["baseline"]
    names = [d for d in index["summary"][0]["designs"] if d != baseline]
    width = 0.6 / max(1, len(names))
    for k, name in enumerate(names):
        offset = (k - (len(names) - 1) / 2) * width
        gaps = [p["designs"][name]["gap"] for p in index["summary"]]
        cis = [p["designs"][name]["ci95"] for p in index["summary"]]
        err = [[g - c[0] if c else 0 for g, c in zip(gaps, cis)], [c[1] - g if c else 0 for g, c in zip(gaps, cis)]]
        ax.errorbar([x + offset for x in xs], gaps, yerr=err, marker="o", ms=4, capsize=3, label=name,
                    color=f"C{k + 1}")
    ax.axhline(0, color="C0", lw=1, label=baseline)
    ax.set_xticks(xs, labels)
    ax.set_xlabel(field)
    ax.set_ylabel(f"final loss - {baseline} (nats/token)")
    ax.legend(fontsize=8)
    path = root / "sweep.png"
    save_figure(plt, fig, path)
    return path

