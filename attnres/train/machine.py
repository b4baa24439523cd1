"""The machine a run trained on, as far as its arithmetic goes.

A run reproduces bit for bit on one machine: the same command at the same revision gave PreNorm
2.1154 on one machine and 2.0973 on another (the CPU's instructions, the threads that split a
reduction, the PyTorch build). ``summary.json`` records ``machine()``, and a comparison's report
says when its runs come from more than one, whose pairs are then not bit-comparable.
"""

from __future__ import annotations

import hashlib
import json
import platform
from pathlib import Path

import torch


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


def machine(device: torch.device | None = None) -> dict:
    """``{"id", "cpu", "threads", "torch", "gpu"}``: ``id`` a hash of everything else and of the
    CPU's feature flags (16 hex digits), equal for two runs whose arithmetic is alike; ``gpu``
    the device's name for a CUDA run, else None."""
    name, flags = _cpu()
    gpu = torch.cuda.get_device_name(device) if device is not None and device.type == "cuda" else None
    described = {"cpu": name, "threads": torch.get_num_threads(),
                 "torch": f"{torch.__version__} ({torch.version.git_version})", "gpu": gpu}
    digest = hashlib.sha256(json.dumps({**described, "flags": flags}, sort_keys=True).encode()).hexdigest()[:16]
    return {"id": digest, **described}
