"""What ``attnres compare`` runs, new or resumed: the comparison's training
(``experiments.compare``), then, for a comparison --from a folder given ``--tasks``, the
evaluation of its runs (``experiments.downstream``), which a signal stops as it stops the
training and ``--resume`` finishes (``compare.json``'s ``downstream`` says what is left)."""

from __future__ import annotations

from pathlib import Path

from ..analysis.comparison_record import ComparisonRecord
from .compare import ComparisonOutcome, Plan, resume_comparison, run_comparison


def start_comparison(plan: Plan, **options) -> ComparisonOutcome:
    """A new comparison of ``plan`` (``run_comparison``'s arguments), trained and then evaluated
    when its ``extra`` holds a ``downstream``."""
    outcome = run_comparison(plan, **options)
    return evaluated(outcome, (options.get("extra") or {}).get("downstream"))


def continue_comparison(root: Path, record: ComparisonRecord, folders, allow_mixed_data: bool) -> ComparisonOutcome:
    """The comparison in ``root`` (its ``compare.json``, ``record``) continued: its unfinished
    runs, then its evaluation; a comparison trained whole goes straight to its evaluation, and
    one evaluated too is refused (nothing to resume)."""
    downstream = record.downstream
    if record.complete and downstream:  # trained: only its evaluation may be left
        if downstream.get("complete"):
            raise ValueError(f"the comparison in {root} is complete, its evaluation too: nothing to resume "
                             f"(`attnres report {root}` rebuilds its report)")
        return evaluated(ComparisonOutcome(root / "report.md"), downstream)
    return evaluated(resume_comparison(root, folders=folders, allow_mixed_data=allow_mixed_data), downstream)


def evaluated(outcome: ComparisonOutcome, downstream: dict | None) -> ComparisonOutcome:
    """``outcome`` once its runs are evaluated on ``downstream``'s tasks (none: as it is). The
    evaluation imports lm-eval, so it loads only here."""
    if not downstream:
        return outcome
    from .downstream import evaluate_pending

    return ComparisonOutcome(outcome.report, evaluate_pending(outcome.report.parent, outcome.signal))
