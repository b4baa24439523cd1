"""Reading the JSON a run or a comparison saved, with errors that name the file."""

from __future__ import annotations

import json
from pathlib import Path


def require(value, fields: dict, where: str) -> None:
    """``ValueError`` naming ``where`` unless ``value`` is an object holding every key of
    ``fields`` (key -> accepted type or tuple of types)."""
    if not isinstance(value, dict):
        raise ValueError(f"{where} holds {type(value).__name__}, not an object; was it edited by hand?")
    for key, kind in fields.items():
        if key not in value:
            raise ValueError(f"{where} lacks the field {key!r}; was it cut short or edited by hand?")
        if not isinstance(value[key], kind) or (isinstance(value[key], bool) and bool not in _types(kind)):
            raise ValueError(f"{where}: {key!r} is {value[key]!r}, not {' or '.join(t.__name__ for t in _types(kind))}")


def _types(kind) -> tuple:
    return kind if isinstance(kind, tuple) else (kind,)


def read_json(path: Path, fields: dict | None = None):
    """The JSON value in ``path``; ``ValueError`` naming the file when it is not valid JSON or
    (given ``fields``, see ``require``) not an object holding those fields."""
    try:
        value = json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path} is not valid JSON ({err}); was it cut short or edited by hand?") from None
    if fields is not None:
        require(value, fields, str(path))
    return value


def read_jsonl(path: Path, fields=None) -> list:
    """The rows of the JSON-lines file ``path``; ``ValueError`` naming the file and the line
    when one is not valid JSON or (given ``fields``, a function of the row returning what it
    must hold, see ``require``) lacks a field."""
    rows = []
    try:
        text = Path(path).read_text()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not text ({err})") from None
    for number, line in enumerate(text.splitlines(), 1):
        if not line:
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}, line {number}, is not valid JSON ({err})") from None
        if fields is not None:
            require(row, fields(row) if isinstance(row, dict) else {}, f"{path}, line {number},")
        rows.append(row)
    return rows
