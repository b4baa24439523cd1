"""Reading the JSON a run or a comparison saved, with errors that name the file; a folder
written whole or not at all (``replace_folder``: exports and conversions)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import tempfile
from pathlib import Path

from .signals import cleaned_up_on_signals, pause_at, signals_held


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


# -- a folder written whole or not at all ----------------------------------------------------

#: the temporary folders beside a destination ``D``: ``.D.partial-PID-...`` (being written) and
#: ``.D.old-PID-...`` (the old ``D`` while the new one takes its place), PID the writer's
PARTIAL, OLD = "partial", "old"


def umask() -> int:
    """The process's umask (read without changing it where Linux says it)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def follow_umask(folder: Path) -> None:
    """Give ``folder`` and everything in it the modes a new folder and file get under the user's
    umask (755 and 644 under 022): a temporary folder is made 700 and some writers make their
    files 600, which a serving account could not read."""
    mask = umask()
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o777 & ~mask)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o666 & ~mask)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(dst: Path) -> list[Path]:
    """Remove the temporary folders beside ``dst`` that a writer killed without a chance to
    clean up (SIGKILL, a power cut) left there: those whose writer's process is gone."""
    removed = []
    if not dst.parent.is_dir():
        return removed
    for entry in dst.parent.iterdir():
        for kind in (PARTIAL, OLD):
            prefix = f".{dst.name}.{kind}-"
            if entry.name.startswith(prefix) and entry.is_dir() and not entry.is_symlink():
                pid = entry.name[len(prefix):].split("-", 1)[0]
                if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry)
    return removed


def replace_folder(dst: Path, fill) -> None:
    """``fill(folder)`` into a temporary folder beside ``dst``, renamed to ``dst`` when complete
    (an old ``dst`` removed only then): an interrupted write leaves ``dst`` as it was, and no
    temporary folder, whether it fails, is interrupted (SIGINT, SIGTERM) or was killed before
    (``remove_stale``, on the next write to ``dst``). The folder written follows the user's
    umask (``follow_umask``), as a run's folder does."""
    dst = Path(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    remove_stale(dst)
    tmp = None
    with cleaned_up_on_signals():
        try:
            tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.{PARTIAL}-{os.getpid()}-", dir=dst.parent))
            fill(tmp)
            follow_umask(tmp)
            pause_at("written")
            # the swap runs whole: no signal between taking the old dst away and the new one's rename
            with signals_held():
                if dst.exists():
                    old = Path(tempfile.mkdtemp(prefix=f".{dst.name}.{OLD}-{os.getpid()}-", dir=dst.parent))
                    os.replace(dst, old / dst.name)
                    os.replace(tmp, dst)
                    shutil.rmtree(old)
                else:
                    os.replace(tmp, dst)
        finally:
            if tmp is not None and tmp.exists():
                shutil.rmtree(tmp)


def new_folder(parent: Path, stem: str) -> Path:
    """A new folder ``parent/stem``, or ``stem-2``, ``stem-3``, ... when that name is taken:
    made with one ``mkdir`` each (atomic), so that two commands started in the same second
    never share a default folder."""
    parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        path = parent / (stem if n == 1 else f"{stem}-{n}")
        try:
            path.mkdir()
        except FileExistsError:
            continue
        return path
    raise AssertionError("unreachable")
