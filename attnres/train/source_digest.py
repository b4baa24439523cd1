"""The folder a run trained ``--from`` started from, known by its digest: recorded when the run
starts (``TrainConfig.init_from_digest``) and checked wherever the run is continued or written
out (``train --resume``, ``export``, ``compare --resume``), so that a folder replaced or edited
since is never read as the run's model.

The digest covers what makes the model and its tokens: the fields of ``config.json`` (all but
the ``transformers_version`` that saved it), the weight files (``*.safetensors``, ``*.bin``,
``*.pt``, ``*.pth`` and their ``*.index.json``) and the tokenizer's files, each by SHA-256,
and one SHA-256 over them all. The record keeps ``config.json``'s fields too, so that a changed
config is told field by field (``rms_norm_eps 1e-06 -> 1e-05``). A source that moved is given
its new place with ``--source DIR``, taken when its files are the recorded ones. A run saved
before the digest existed has none: its source is not checked (only found).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

#: the files of a model folder that make its weights
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".index.json")
#: the files of a model folder that make its tokens (``data.tokenizer='model'``)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "special_tokens_map.json", "added_tokens.json")
#: what a re-save by another ``transformers`` changes in ``config.json`` without changing the model
NOT_DIGESTED = ("transformers_version",)
_CHUNK = 1 << 20
#: digests computed in this process: (folder, each file's name, size, mtime and inode) -> record
_computed: dict = {}


def _digested(folder: Path) -> list[Path]:
    return sorted(e for e in folder.iterdir() if e.is_file() and (
        e.name == "config.json" or e.name in TOKENIZER_FILES or e.name.endswith(WEIGHT_SUFFIXES)))


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _config_fields(folder: Path) -> dict:
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}
    return {k: v for k, v in config.items() if k not in NOT_DIGESTED} if isinstance(config, dict) else {}


def folder_digest(folder: str | Path) -> dict:
    """The digest of model folder ``folder``: ``{"sha256": the whole's, "files": {name:
    sha256}, "config": config.json's fields}`` (the module's docstring). A folder read again
    in the same process, its files unchanged (name, size, time, inode), is not read again."""
    folder = Path(folder).expanduser().resolve()
    paths = _digested(folder)
    stats = [p.stat() for p in paths]
    key = (str(folder), tuple((p.name, s.st_size, s.st_mtime_ns, s.st_ino) for p, s in zip(paths, stats)))
    if key not in _computed:
        config = _config_fields(folder)
        files = {p.name: _file_sha256(p) for p in paths if p.name != "config.json"}
        files["config.json"] = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()
        whole = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
        _computed[key] = {"sha256": whole, "files": files, "config": config}
    return _computed[key]


def check_record(record, where: str) -> None:
    """``ValueError`` naming ``where`` unless ``record`` is None or a digest as ``folder_digest``
    makes it (a run's saved ``init_from_digest``)."""
    if record is None:
        return
    files = record.get("files") if isinstance(record, dict) else None
    if not (isinstance(record, dict) and isinstance(record.get("sha256"), str) and isinstance(files, dict)
            and all(isinstance(v, str) for v in files.values()) and isinstance(record.get("config"), dict)):
        raise ValueError(f"{where}: init_from_digest is not a digest of a model folder (sha256, files, config); "
                         f"was it edited by hand?")


def changes(record: dict, now: dict) -> list[str]:
    """What differs between the digest ``record`` and the digest ``now`` of a folder: each field
    of ``config.json`` that changed (its two values), each other file changed, added or removed."""
    said = []
    old, new = record["config"], now["config"]

    def shown(config: dict, key: str) -> str:
        return repr(config[key]) if key in config else "(none)"

    fields = [f"{k} {shown(old, k)} -> {shown(new, k)}" for k in sorted({*old, *new})
              if k not in old or k not in new or old[k] != new[k]]
    if fields:
        said.append("config.json: " + ", ".join(fields[:6]) + (f" and {len(fields) - 6} more" if len(fields) > 6 else ""))
    for name in sorted({*record["files"], *now["files"]} - {"config.json"}):
        before, after = record["files"].get(name), now["files"].get(name)
        if before != after:
            said.append(f"{name} {'added' if before is None else 'removed' if after is None else 'changed'}")
    return said or ["its files differ"]


def check_source(cfg, where: str, repoint: str, anew: str, source: str | Path | None = None):
    """``cfg``, the config of a run (or comparison) that continued the model of folder
    ``cfg.init_from``, with that folder checked against the digest the run recorded, or with its
    new place ``source`` (``--source``) when given, taken only when it holds the recorded files.
    ``ValueError`` naming the folder as ``where`` names it, what changed, and how to go on:
    ``repoint`` (the command with ``--source DIR``) or ``anew`` (a new run). A folder that is
    gone is refused so for a run without a digest too; its files are then not checked."""
    recorded, old = cfg.init_from_digest, Path(cfg.init_from)
    if source is not None and Path(source).expanduser().resolve() == old.resolve():
        source = None  # the place the run recorded: nothing to re-point
    if source is not None:
        new = Path(source).expanduser().resolve()
        if recorded is None:
            raise ValueError(f"--source {source}: {where} names a folder but no digest of it (it was saved before "
                             f"runs recorded one), so another folder cannot be checked for the same model: put the "
                             f"folder back at {old}, or start anew: {anew}")
        if not (new / "config.json").is_file():
            raise ValueError(f"--source {source}: not a model folder (no config.json); give the folder {old} moved to")
        now = folder_digest(new)
        if now["sha256"] != recorded["sha256"]:
            raise ValueError(f"--source {source} does not hold the model recorded in {where} "
                             f"({'; '.join(changes(recorded, now))}): give the folder that does, or start anew: {anew}")
        return dataclasses.replace(cfg, init_from=str(new))
    if not (old / "config.json").is_file():
        if recorded is None:
            raise ValueError(f"{where} {old}: not a model folder (no config.json: moved or removed); put the folder "
                             f"back there, or start anew: {anew}")
        raise ValueError(f"{where} {old}: not a model folder (no config.json: moved or removed since it was "
                         f"recorded). If it moved, give its new place: {repoint} (its files must be the ones recorded, "
                         f"sha256 {recorded['sha256'][:16]}...); otherwise start anew: {anew}")
    if recorded is not None:
        now = folder_digest(old)
        if now["sha256"] != recorded["sha256"]:
            raise ValueError(f"{where} {old} changed since it was recorded: {'; '.join(changes(recorded, now))}. "
                             f"Continuing needs the model recorded: put those files back, or give a folder that "
                             f"holds them: {repoint}; or start anew from the folder as it is now: {anew}")
    return cfg
