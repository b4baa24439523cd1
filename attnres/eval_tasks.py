"""lm-eval's task names and ``--include-path``, checked before lm-evaluation-harness loads.

lm-eval learns its tasks by indexing every task file it ships (about 14,000 YAML files: seconds
to tens of seconds), and an ``--include-path`` that does not exist is silently read as empty.
``check_tasks`` answers first, reading text only: the include path must be a folder, and a task
name that appears in none of the task files (lm-eval's own, found without importing it, and
those of the include path) is unknown, refused at once. A name that does appear is left to
lm-eval's index to confirm (``hf.evaluate.check_known_tasks``), as is a pattern (``arc_*``).
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

#: the characters of a pattern of task names, which lm-eval matches against its index
PATTERN = frozenset("*?[")


def _task_folders(include_path: str | None) -> list[Path]:
    """The folders of task files: lm-eval's own (``lm_eval/tasks``) and the include path."""
    spec = importlib.util.find_spec("lm_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("evaluation needs lm-evaluation-harness with its hf extra (lm_eval is not installed): "
                         "pip install 'attnres[hf]'")
    folders = [Path(location) / "tasks" for location in spec.submodule_search_locations]
    return [*folders, *([Path(include_path)] if include_path else [])]


def _task_text(folders: list[Path]) -> str:
    """Every task file's text in ``folders`` (YAML files, read as text, never parsed)."""
    texts = []
    for folder in folders:
        for path in folder.rglob("*.y*ml"):
            try:
                texts.append(path.read_text(errors="replace"))
            except OSError:
                continue
    return "\n".join(texts)


def check_tasks(tasks: list[str], include_path: str | None = None) -> None:
    """``ValueError`` for an ``include_path`` that is not a folder (missing, or a file: lm-eval
    reads a folder's YAML files), and for a task name no task file holds (the module's
    docstring); reads text only, before lm-eval loads."""
    if include_path is not None:
        path = Path(include_path)
        if not path.exists():
            raise ValueError(f"--include-path {include_path}: no such folder; give the folder of your task YAML files")
        if not path.is_dir():
            raise ValueError(f"--include-path {include_path} is a file; give the folder that holds it (lm-eval reads "
                             f"every task YAML file in the folder)")
    text = _task_text(_task_folders(include_path))
    unknown = [t for t in tasks if not PATTERN & set(t) and t not in text]
    if unknown:
        raise ValueError(f"unknown lm-eval task(s) {unknown}; `lm_eval ls tasks` lists them (and --include-path adds a "
                         f"folder of task YAML files)")
