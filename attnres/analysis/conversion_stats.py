"""What a comparison --from a folder adds to ``results.json``: each conversion's optimization
shock against its control over the first steps, and its downstream answers paired with the
control's, item by item (McNemar).

**Shock.** For seed ``s``, let ``c_t`` and ``v_t`` be the control's and the conversion's training
loss at step ``t = 1..k`` (each step logged: ``run.log_first``; step 1's loss is that of the
first batch before any update). Then ``step0_diff = |v_1 - c_1|`` (zero to the last bit: the
conversion is exact), ``max_abs_diff = max_t |v_t - c_t|`` and ``control_noise`` the standard
deviation of the control's step-to-step changes ``c_{t+1} - c_t``; each reported as the largest
over the seeds. A difference within ``control_noise`` is no shock.

**Downstream.** Per task and seed, the exact McNemar test (``stats.mcnemar``) of the control's
and the conversion's per-item correctness on the same items: seeds are not pooled (their items
are the same items).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from ..files import read_json
from .stats import mcnemar


def first_losses(run: dict, steps: int) -> dict[int, float]:
    """Step -> training loss of the run's first ``steps`` steps (its log rows)."""
    return {r["step"]: r["loss"] for r in run["metrics"] if r["split"] == "train" and r["step"] <= steps}


def step_noise(losses: dict[int, float]) -> float | None:
    """The standard deviation of a run's step-to-step loss changes over ``losses`` (step ->
    loss, consecutive steps), or None with fewer than three steps."""
    steps = sorted(losses)
    changes = [losses[b] - losses[a] for a, b in zip(steps, steps[1:])]
    return statistics.stdev(changes) if len(changes) > 1 else None


def shock(control: dict[int, float], converted: dict[int, float]) -> dict:
    """One seed's shock figures (the module's docstring) from the two runs' losses by step; the
    steps both logged, which must run from 1 without a gap."""
    steps = sorted(set(control) & set(converted))
    if not steps or steps != list(range(1, len(steps) + 1)):
        raise ValueError(f"the first steps' losses are incomplete (steps {steps[:5]}...): the runs must log every "
                         f"one of them (run.log_first)")
    return {"steps": len(steps), "step0_diff": abs(converted[1] - control[1]),
            "max_abs_diff": max(abs(converted[t] - control[t]) for t in steps),
            "control_noise": step_noise({t: control[t] for t in steps})}


def shock_results(designs: dict[str, list[dict]], baseline: str, steps: int) -> dict[str, dict]:
    """Design -> its ``"shock"`` entry against ``baseline`` (the control) over the first
    ``steps`` steps: ``{"steps", "step0_diff", "max_abs_diff", "control_noise"}``, each figure
    the largest over the seeds both finished."""
    control = {r["seed"]: first_losses(r, steps) for r in designs.get(baseline, [])}
    out = {}
    for name, runs in designs.items():
        if name == baseline:
            continue
        per_seed = [shock(control[r["seed"]], first_losses(r, steps)) for r in runs if r["seed"] in control]
        if not per_seed:
            continue
        noise = [s["control_noise"] for s in per_seed if s["control_noise"] is not None]
        out[name] = {"steps": min(s["steps"] for s in per_seed),
                     "step0_diff": max(s["step0_diff"] for s in per_seed),
                     "max_abs_diff": max(s["max_abs_diff"] for s in per_seed),
                     "control_noise": max(noise) if noise else None}
    return out


def downstream_results(root: Path, designs: dict[str, list[dict]], baseline: str) -> dict | None:
    """``results.json``'s ``"downstream"`` from ``downstream.json`` (``experiments/downstream.py``), or
    None without it: ``{"tasks", "metrics", "by_task": {task: {design: {seed: mcnemar}}}}`` for
    each conversion and seed whose run and control were both evaluated, over every task they
    answered (a group's subtasks, a task's filters: ``experiments/downstream.py``)."""
    path = Path(root) / "downstream.json"
    if not path.exists():
        return None
    data = read_json(path, {"tasks": list, "runs": dict, "metrics": dict})
    control = {r["seed"]: data["runs"].get(r["dir"]) for r in designs.get(baseline, [])}
    by_task: dict = {}
    answered = sorted({task for answers in data["runs"].values() for task in answers})
    for task in answered:
        for name, runs in designs.items():
            if name == baseline:
                continue
            for run in runs:
                ours, theirs = data["runs"].get(run["dir"]), control.get(run["seed"])
                if not ours or not theirs or task not in ours or task not in theirs:
                    continue
                items = sorted(theirs[task], key=lambda k: (len(k), k))
                if sorted(ours[task], key=lambda k: (len(k), k)) != items:
                    raise ValueError(f"{path}: {run['dir']} and the control answered other items of {task}")
                test = mcnemar([theirs[task][i] for i in items], [ours[task][i] for i in items])
                by_task.setdefault(task, {}).setdefault(name, {})[str(run["seed"])] = test
    return {"tasks": data["tasks"], "metrics": data["metrics"], "by_task": by_task}
