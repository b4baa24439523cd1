"""The machine a run trained on, as far as its arithmetic goes.

A run reproduces bit for bit on one machine: the same command at the same revision gave PreNorm
2.1154 on one machine and 2.0973 on another (the CPU's instructions, the threads that split a
reduction, the PyTorch build). ``summary.json`` records ``machine()``, and a comparison's report
says when its runs come from more than one, whose pairs are then not bit-comparable.

The packages are the environment's: ``make setup`` installs them from a lock (``attnres/locks/``,
exact versions with their hashes), and ``machine()`` records the lock's digest and every installed
distribution that differs from it, so that a report can say when its runs computed with different
packages (numpy, scipy, transformers, ... move a result as torch does).
"""

from __future__ import annotations

import copy
import functools
import hashlib
import importlib.metadata
import importlib.resources
import importlib.util
import json
import platform
import re
import site
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:  # importlib.resources.abc is Python 3.11's
    from importlib.resources.abc import Traversable

#: the lock of the environment ``make serve-setup`` builds (vLLM's), and of ``make setup``'s
SERVE_LOCK, MAIN_LOCK = "serve.txt", "main.txt"
#: installed, never locked: the package itself (an editable install of the working tree)
NOT_LOCKED = frozenset({"attnres"})


def _cpu() -> tuple[str, str]:
    """The CPU's model name and feature flags (``/proc/cpuinfo``), or the platform's words."""
    name = flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and not name:
                name = value.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = value.strip()
    except OSError:
        pass
    return name or platform.processor() or platform.machine(), flags


def normalized(name: str) -> str:
    """``name`` as PEP 503 compares distribution names: lower case, runs of ``-_.`` as one ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


def locked_versions(lock_text: str) -> dict[str, str]:
    """``{normalized name: version}`` of each ``name==version`` line of a pip-compile lock (its
    hashes, comments and options skipped); the version as written (``2.13.0+cpu``)."""
    pins = re.finditer(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", lock_text, re.MULTILINE)
    return {normalized(m[1]): m[2] for m in pins}


def installed_versions() -> dict[str, str]:
    """``{normalized name: version}`` of the distributions installed in this environment (its
    site-packages folders, in ``sys.path``'s order: the first of a name is the one ``import``
    finds), as ``importlib.metadata`` reports them. Other folders on ``sys.path`` are not
    installations: setuptools, once imported, puts the folder of its own vendored packages there."""
    sites = set(site.getsitepackages())
    if site.ENABLE_USER_SITE:
        sites.add(site.getusersitepackages())
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions(path=[p for p in sys.path if p in sites] or sorted(sites)):
        name = dist.metadata["Name"]
        if name:  # a broken install's metadata may lack it
            found.setdefault(normalized(name), dist.version)
    return found


def unlocked(lock_text: str, installed: dict[str, str]) -> dict[str, dict[str, str | None]]:
    """Every distribution whose installed version differs from the lock's, as ``{name:
    {"installed": version, "locked": version}}``, the versions compared as strings; one installed
    but absent from the lock has ``"locked": None``, one locked but not installed ``"installed":
    None``. ``{}`` for an environment that is its lock. ``attnres`` itself is never locked and is
    left out; the installer (pip, setuptools) is locked like the rest and so compared."""
    locked = locked_versions(lock_text)
    names = (locked.keys() | installed.keys()) - NOT_LOCKED
    return {name: {"installed": installed.get(name), "locked": locked.get(name)}
            for name in sorted(names) if installed.get(name) != locked.get(name)}


def lock_path() -> Traversable:
    """The lock this environment was set up from: the serving one (``make serve-setup``) where
    vLLM is installed, else the main one (``make setup``); shipped as package data."""
    which = SERVE_LOCK if importlib.util.find_spec("vllm") is not None else MAIN_LOCK
    return importlib.resources.files("attnres") / "locks" / which


@functools.cache
def lock_state() -> dict:
    """``{"lock_sha256", "unlocked"}``: the sha256 of the lock file's bytes (64 hex digits) and
    ``unlocked(lock, installed_versions())``; both None when the lock cannot be read (an install
    without its package data). Computed once per process: every run's end records it."""
    try:
        raw = lock_path().read_bytes()
    except OSError:
        return {"lock_sha256": None, "unlocked": None}
    return {"lock_sha256": hashlib.sha256(raw).hexdigest(),
            "unlocked": unlocked(raw.decode(), installed_versions())}


def machine(device: torch.device | None = None) -> dict:
    """``{"id", "cpu", "threads", "torch", "gpu", "lock_sha256", "unlocked"}``: ``id`` a hash of
    the CPU, threads, torch and gpu and of the CPU's feature flags (16 hex digits), equal for two
    runs whose arithmetic is alike; ``gpu`` the device's name for a CUDA run, else None;
    ``lock_sha256`` and ``unlocked`` the packages (``lock_state()``), left out of ``id``, which
    says what changes the arithmetic of torch's kernels, the same before the lock was recorded."""
    name, flags = _cpu()
    gpu = torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else None
    described = {"cpu": name, "threads": torch.get_num_threads(),
                 "torch": f"{torch.__version__} ({torch.version.git_version})", "gpu": gpu}
    digest = hashlib.sha256(json.dumps({**described, "flags": flags}, sort_keys=True).encode()).hexdigest()[:16]
    return {"id": digest, **described, **copy.deepcopy(lock_state())}  # the cached one stays as it is
