"""Downstream answers of a comparison --from a folder, item by item (``attnres compare --from
... --tasks``): each finished run exported back to its architecture's folder
(``export.export_run``) and evaluated with lm-evaluation-harness, its logged samples kept as one
right-or-wrong per item, in ``downstream.json`` beside ``compare.json``. The report pairs the
conversions' answers with the control's, seed by seed (``analysis/conversion_stats.py``: McNemar).

The evaluation follows the training (``evaluate_pending``): ``compare.json``'s ``downstream``
says whether it is ``complete``. SIGINT or SIGTERM stops it where it stands (the runs evaluated
so far kept), records ``stopped_by`` and prints the command that finishes it, ``attnres compare
--resume``; ``complete`` keeps saying whether the training finished.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from ..analysis.comparison import label_path
from ..analysis.comparison_record import read_record, write_record
from ..analysis.report import write_report
from ..files import read_json
from ..signals import Raising, Terminated
from ..hf.evaluate import evaluate
from ..hf.export import export_run

#: the per-item metrics read as right or wrong, the first a task's samples hold
ITEM_METRICS = ("acc", "exact_match")
DOWNSTREAM_FILE = "downstream.json"


def item_correctness(task: str, samples: list[dict]) -> dict[str, tuple[str, dict[str, bool]]]:
    """Each answered key of one task's logged samples -> ``(metric, {doc_id: right})``, each
    item right when its metric (``ITEM_METRICS``, the first the samples hold) is 1. A task
    whose samples pass through several filters (gsm8k's strict and flexible answers) answers
    each item once per filter: its keys are ``task/filter``; otherwise the key is ``task``."""
    if not samples:
        raise ValueError(f"the task {task!r} logged no samples")
    metric = next((m for m in ITEM_METRICS if m in samples[0]), None)
    if metric is None:
        raise ValueError(f"the samples of {task!r} hold none of the per-item metrics {ITEM_METRICS} "
                         f"(they hold {sorted(k for k in samples[0] if not k.startswith(('doc', 'resps')))})")
    by_filter: dict[str, dict[str, bool]] = {}
    for s in samples:
        answers = by_filter.setdefault(str(s.get("filter", "none")), {})
        if str(s["doc_id"]) in answers:
            raise ValueError(f"the samples of {task!r} answer item {s['doc_id']} twice under one filter")
        answers[str(s["doc_id"])] = float(s[metric]) == 1.0
    if len(by_filter) == 1:
        return {task: (metric, next(iter(by_filter.values())))}
    return {f"{task}/{name}": (metric, answers) for name, answers in by_filter.items()}


def _write(path: Path, data: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    os.replace(tmp, path)


def evaluate_comparison(root: str | Path, tasks: list[str], include_path: str | None = None,
                        limit: float | None = None, log=print, stopped=lambda: False) -> Path:
    """Export and evaluate on ``tasks`` every finished run of the comparison in ``root`` that
    ``downstream.json`` does not hold yet (written after each run: a stopped evaluation
    continues where it stopped, ``attnres compare --resume``), on the device the comparison
    trained on (``run.device``); returns its path. A group task's subtasks are answered each
    under its own name. Each run is exported from the folder its model came from as the
    comparison knows it now (``compare.json``'s ``init_from``, or its ``models/``: either may
    have moved since the run). ``stopped()`` is asked before each run: true ends the loop."""
    from ..train.distributed import pick_device

    root = Path(root)
    record = read_record(root)
    device = str(pick_device(record.config["run"]["device"]))
    path = root / DOWNSTREAM_FILE
    done = read_json(path) if path.exists() else {}
    if done and (done.get("tasks") != list(tasks) or done.get("include_path") != include_path
                 or done.get("limit") != limit):
        raise ValueError(f"{path} holds answers to other tasks ({done.get('tasks')}); remove it to evaluate anew")
    data = {"tasks": list(tasks), "include_path": include_path, "limit": limit, "metrics": done.get("metrics", {}),
            "runs": done.get("runs", {})}
    for entry in record.runs:
        if entry.dir in data["runs"] or not entry.finished(record.steps):
            continue
        if stopped():
            break
        out = root / "exports" / entry.dir
        log(f"evaluating {entry.dir} on {', '.join(tasks)}")
        source = record.init_from if entry.design == "source" else root / "models" / label_path(entry.design)
        export_run(root / entry.dir, out, overwrite=True, source=source)
        results = evaluate(out, list(tasks), include_path=include_path, limit=limit, device=device, log_samples=True)
        answers = {}
        for task, samples in results["samples"].items():
            for key, (metric, items) in item_correctness(task, samples).items():
                answers[key] = items
                data["metrics"][key] = metric
        data["runs"][entry.dir] = answers
        _write(path, data)
    _write(path, data)
    return path


def evaluate_pending(root: str | Path, received: int | None = None, log=print) -> int | None:
    """Finish what a comparison --from a folder with ``--tasks`` owes once trained: evaluate its
    runs (``evaluate_comparison``) unless a signal came before (``received``), or the training
    is incomplete (then the evaluation waits for ``--resume``). ``compare.json``'s ``downstream``
    records whether the evaluation is ``complete``, and ``stopped_by`` the signal that stopped it
    (SIGINT or SIGTERM stop it where it stands, ``signals.Raising``), with the report
    written again; returns that signal's number, or None when nothing stopped it."""
    root = Path(root)
    record = read_record(root)
    downstream = record.downstream
    if not record.complete:
        return received
    if received is None:
        try:
            with Raising() as signals:
                evaluate_comparison(root, downstream["tasks"], downstream.get("include_path"), downstream.get("limit"),
                                    log=log, stopped=lambda: signals.received is not None)
        except KeyboardInterrupt:
            signals.received = signal.SIGINT
        except Terminated as stop:
            signals.received = int(stop.code) - 128
        received = signals.received
    downstream["complete"] = received is None
    record.stopped_by = None if received is None else signal.Signals(received).name
    write_record(root, record)
    write_report(root)
    if received is not None:
        log(f"stopped by {record.stopped_by}: the comparison's evaluation on {', '.join(downstream['tasks'])} is "
            f"incomplete; continue it with: attnres compare --resume {root}")
    return received
