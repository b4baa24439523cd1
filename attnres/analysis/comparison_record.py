"""``compare.json``, a comparison's record, as a typed value: read and checked (``read_record``)
and written (``write_record``) here alone.

A comparison writes its record before its first run (``"complete": false``) and after each run
it trains; ``attnres compare --resume`` continues from it, the report reads it, and a comparison
--from a folder records there what its evaluation has done. ``ComparisonRecord`` holds every key
a comparison writes; a key this version does not know is kept as it was read (``other``), so
that reading and writing a record loses nothing.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from ..files import read_json
from .budget import budget_run_labels

#: the file a comparison's folder holds its record in
RECORD = "compare.json"


@dataclass
class RunRecord:
    """One run of a comparison: its design's label, its seed, its folder's name (inside the
    comparison's), the design's options, the steps it plans and has done, and for a baseline run
    at a larger budget the budget's multiple. A record written before a field existed lacks it
    (None)."""

    design: str
    seed: int
    dir: str
    options: dict | None = None
    steps: int | None = None
    steps_done: int | None = None
    budget: float | None = None

    def finished(self, default_steps: int | None) -> bool:
        """Whether the run has done its steps (its own, or the comparison's ``default_steps``)."""
        planned = self.steps if self.steps is not None else default_steps
        return planned is not None and (self.steps_done or 0) >= planned

    def to_json(self) -> dict:
        return {k: v for k, v in dataclasses.asdict(self).items() if v is not None}


#: the keys every record written since ``compare --resume`` exists holds, null or not, in order
ALWAYS = ("complete", "designs", "seeds", "baseline", "command", "steps", "config", "overrides", "budgets", "runs")


@dataclass
class ComparisonRecord:
    """A comparison's ``compare.json``. ``designs`` and ``seeds`` in order; ``baseline`` the design
    the others are compared with; ``command`` the command line that asked for it; ``steps`` each
    design's steps; ``config`` the shared settings (``TrainConfig`` as a dict) and ``overrides``
    the residual options given for every design; ``budgets`` the multiples the baseline also
    trains at (or None); ``runs`` those recorded so far. A comparison --from a folder adds its
    source (``init_from``), the steps its shock is measured over (``shock_steps``) and its
    evaluation (``downstream``); ``kind_norm_eps`` each residual kind's default epsilon, which
    a design not given one ran at; training adds the machines it ran on, the step timing of a
    comparison with budgets (``step_times``), the wall time so far (``wall_time_s``) and, when a
    signal stopped it, its name (``stopped_by``)."""

    designs: list[str]
    seeds: list[int]
    runs: list[RunRecord] = field(default_factory=list)
    complete: bool | None = None
    baseline: str | None = None
    command: list[str] | None = None
    steps: int | None = None
    config: dict | None = None
    overrides: dict | None = None
    budgets: list[float] | None = None
    init_from: str | None = None
    shock_steps: int | None = None
    downstream: dict | None = None
    machines: list[str] | None = None
    step_times: dict | None = None
    wall_time_s: float | None = None
    stopped_by: str | None = None
    #: each residual kind's default ``norm_eps`` when the comparison was planned (a record
    #: without it ran every design at its ``config``'s ``norm_eps`` unless the design set one)
    kind_norm_eps: dict | None = None
    #: keys this version does not know, kept as read
    other: dict = field(default_factory=dict)

    @property
    def budget_runs(self) -> dict[str, float]:
        """The baseline's runs at the larger budgets: label -> budget (``budget.budget_run_labels``)."""
        return budget_run_labels(self.baseline, self.budgets)

    def run(self, design: str, seed: int) -> RunRecord | None:
        """The run of ``design`` for ``seed`` recorded so far, or None."""
        return next((r for r in self.runs if (r.design, r.seed) == (design, seed)), None)

    def record(self, run: RunRecord) -> None:
        """``run`` in ``runs``, in place of the same design and seed's earlier one."""
        old = self.run(run.design, run.seed)
        if old is None:
            self.runs.append(run)
        else:
            self.runs[self.runs.index(old)] = run

    def finished(self, design: str, seed: int) -> bool:
        run = self.run(design, seed)
        return run is not None and run.finished(self.steps)

    def to_json(self) -> dict:
        """The record as ``compare.json`` holds it: the keys of ``ALWAYS``, then those set."""
        values = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "other"}
        values["runs"] = [run.to_json() for run in self.runs]
        out = {key: values.pop(key) for key in ALWAYS}
        out.update({key: value for key, value in values.items() if value is not None})
        out.update(self.other)
        return out

    @classmethod
    def from_json(cls, data: dict) -> ComparisonRecord:
        """The record of a ``compare.json`` that ``record_problem`` passed."""
        known = {f.name for f in dataclasses.fields(cls)} - {"other", "runs"}
        runs = [RunRecord(**{k: v for k, v in run.items() if k in RUN_KEYS}) for run in data["runs"]]
        return cls(runs=runs, **{k: v for k, v in data.items() if k in known},
                   other={k: v for k, v in data.items() if k not in known and k != "runs"})


RUN_KEYS = {f.name for f in dataclasses.fields(RunRecord)}


def _list_problem(data: dict, key: str, kind: type) -> str | None:
    values = data.get(key)
    if key not in data:
        return f"has no {key!r}"
    if not isinstance(values, list) or not values or any(type(v) is not kind for v in values):
        return f"{key!r} is {values!r}, not a non-empty list of {kind.__name__}"
    return None


def _run_problem(data: dict, k: int, run) -> str | None:
    if not isinstance(run, dict):
        return f"runs[{k}] is {run!r}, not an object"
    lacking = [key for key in ("design", "seed", "dir") if key not in run]
    if lacking:
        return f"runs[{k}] has no {lacking}"
    if (run["design"] not in data["designs"]
            and run["design"] not in budget_run_labels(data.get("baseline"), data.get("budgets"))) \
            or run["seed"] not in data["seeds"]:
        return (f"runs[{k}] is design {run['design']!r}, seed {run['seed']!r}: not one the "
                "comparison lists")
    folder = run["dir"]
    if not isinstance(folder, str) or folder in ("", ".", "..") or Path(folder).name != folder:
        return f"runs[{k}] has dir {folder!r}: not the name of a folder inside the comparison's"
    steps = [run.get(key) for key in ("steps", "steps_done") if key in run]
    if any(type(v) is not int or v < 0 for v in steps):
        return f"runs[{k}] has steps {steps}: not integers >= 0"
    return None


def record_problem(data) -> str | None:
    """What is wrong with a comparison's ``compare.json`` (``data``, as read), or None: it is an
    object with its ``designs`` and ``seeds`` (non-empty lists), and ``runs``, each naming one of
    them once and a folder inside the comparison's, with its steps (planned and done) when given."""
    if not isinstance(data, dict):
        return f"holds {type(data).__name__} {data!r:.40}, not an object"
    problem = _list_problem(data, "designs", str) or _list_problem(data, "seeds", int)
    if problem:
        return problem
    if not isinstance(data.get("runs"), list):
        return "has no 'runs' list"
    for k, run in enumerate(data["runs"]):
        problem = _run_problem(data, k, run)
        if problem:
            return problem
    pairs = [(r["design"], r["seed"]) for r in data["runs"]]
    if len(set(pairs)) != len(pairs):
        return "lists a design and seed twice in 'runs'"
    if not isinstance(data.get("complete", True), bool):
        return f"'complete' is {data['complete']!r}, not true or false"
    return None


def read_record(compare_dir: Path) -> ComparisonRecord:
    """The record in comparison folder ``compare_dir``, checked (``record_problem``):
    ``ValueError`` naming the file and what is wrong."""
    path = Path(compare_dir) / RECORD
    if not path.exists():
        raise ValueError(f"{compare_dir} is not a comparison folder: {RECORD} is missing")
    data = read_json(path)
    problem = record_problem(data)
    if problem:
        raise ValueError(f"{path} {problem}; was it cut short or edited by hand?")
    return ComparisonRecord.from_json(data)


def write_record(compare_dir: Path, record: ComparisonRecord) -> None:
    """``record`` to ``compare_dir``'s ``compare.json``, replaced atomically: a comparison killed
    mid-write keeps the last one."""
    tmp = Path(compare_dir) / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(record.to_json(), indent=2))
    os.replace(tmp, Path(compare_dir) / RECORD)
