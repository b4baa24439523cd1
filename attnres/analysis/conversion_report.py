"""The sections of a comparison --from a folder's report (``report.write_report``): each
conversion's optimization shock against its control (``shock_section``) and, with ``--tasks``,
the downstream answers paired item by item (``downstream_section``), or what the evaluation
still lacks (``evaluation_pending``). Their numbers are ``analysis/conversion_stats.py``'s.
"""

from __future__ import annotations

from ..files import read_json
from .comparison import Comparison
from .conversion_stats import first_losses
from .figures import plot_first_steps


def shock_section(c: Comparison, plt) -> list[str]:
    """For a comparison --from a folder: each conversion's first steps against the control's
    (``analysis/conversion_stats.py``) and the curves of the first seed, with each conversion's
    difference to the control (``first_steps.png``)."""
    shocks = {name: e["shock"] for name, e in c.results["designs"].items() if e.get("shock")}
    if not shocks:
        return []
    steps = min(s["steps"] for s in shocks.values())
    seed = c.seeds[0]
    plot_first_steps(plt, {name: first_losses(next(r for r in runs if r["seed"] == seed), steps)
                           for name, runs in c.designs.items()}, seed, c.root / "first_steps.png", control=c.baseline)
    lines = ["## Optimization shock", "",
             f"Every one of the first {steps} steps' training loss, each conversion's against the control's "
             f"({c.baseline}) on the same batches: the difference at the first step (before any update; 0 when the "
             "conversion is exact), the largest difference over the steps, and the control's own step-to-step noise "
             "(the standard deviation of its loss changes); each the largest over the seeds. A largest difference "
             "within the noise is no shock. The figure's second panel draws each conversion's loss minus the control's, "
             "step by step, against the control's noise (shaded).", "",
             "The routing's movement: the largest and the mean absolute change of the conversion's routing "
             "parameters from their identity initialization to the end of the run (the largest over the seeds, "
             "the mean of their means); a routing that barely moved makes \"no shock\" a statement about a model "
             "that stayed its source (`optim.routing_lr_scale` moves it further).", "",
             "| design | step-0 difference | largest difference | control's noise | routing moved (largest) | "
             "routing moved (mean) |", "|---|---|---|---|---|---|"]
    for name, s in shocks.items():
        noise = "" if s["control_noise"] is None else f"{s['control_noise']:.4f}"
        moved = c.results["designs"][name].get("routing_movement")
        movement = f"{moved['max_abs']:.3g} | {moved['mean_abs']:.3g}" if moved else " | "
        lines.append(f"| {name} | {s['step0_diff']:.3g} | {s['max_abs_diff']:.3g} | {noise} | {movement} |")
    return [*lines, "", "![the first steps](first_steps.png)", ""]


def evaluation_pending(c: Comparison) -> list[str]:
    """With ``--tasks``, once every run trained: whether the evaluation is still to finish
    (``compare.json``'s ``downstream``), how many runs it evaluated and how to finish it."""
    downstream = c.record.downstream
    if not downstream or downstream.get("complete", True) or not c.results["complete"]:
        return []
    path = c.root / "downstream.json"
    done = len(read_json(path).get("runs", {})) if path.is_file() else 0
    stopped = f" (stopped by {c.record.stopped_by})" if c.record.stopped_by else ""
    return [f"**The evaluation on {', '.join(downstream['tasks'])} is incomplete**{stopped}: {done} of "
            f"{len(c.record.runs)} runs evaluated. To finish it: `attnres compare --resume {c.root}`", ""]


def downstream_section(c: Comparison) -> list[str]:
    """With ``--tasks``: per task, conversion and seed, the exact McNemar test of its answers
    against the control's on the same items."""
    downstream = c.results.get("downstream")
    pending = evaluation_pending(c)
    if not downstream:
        return pending
    lines = [*pending, "## Downstream, paired item by item", "",
             "Each run exported and evaluated with lm-evaluation-harness; each item right or wrong by its task's "
             "per-item metric. Per seed (not pooled: the seeds answer the same items), the items only the control "
             "got right (n01) and only the conversion got right (n10), and the exact McNemar test "
             "(`binomtest(min(n01, n10), n01 + n10, 0.5)`, two-sided).", "",
             "| task | design | seed | items | control | conversion | difference | n01 | n10 | p |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for task, by_design_ in downstream["by_task"].items():
        for name, seeds in by_design_.items():
            for seed, t in seeds.items():
                lines.append(f"| {task} | {name} | {seed} | {t['items']} | {t['acc_control']:.3f} | "
                             f"{t['acc_treated']:.3f} | {t['acc_diff']:+.3f} | {t['n01']} | {t['n10']} | {t['p']:.3g} |")
    return [*lines, ""]
