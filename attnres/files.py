"""Reading the JSON a run or a comparison saved, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path


def read_json(path: Path):
    """The JSON value in ``path``; ``ValueError`` naming the file when it is not valid JSON."""
    try:
        return json.loads(Path(path).read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON ({err}); was it cut short or edited by hand?") from None


def read_jsonl(path: Path) -> list:
    """The rows of the JSON-lines file ``path``; ``ValueError`` naming the file and the line."""
    rows = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line:
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {number}, is not valid JSON ({err})") from None
    return rows
