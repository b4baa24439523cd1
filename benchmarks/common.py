"""Shared benchmark machinery: interleaved timing, per-round ratios, memory in a fresh process.

Every timing is a ratio against a baseline measured in the same run: the variants run one after
another inside each round, so that noise from a shared machine hits them alike; the ratio is taken
per round, and the median and the spread (min..max over rounds) are reported.

Memory is the growth of peak RSS above the RSS after model and optimizer construction, measured
in a fresh process per variant (``--child VARIANT``), so that one variant's allocator state
cannot hide another's peak.

``import_revision(REV)`` imports the package as it was at git revision ``REV`` beside the
current one, so that a script can time both revisions in one interleaved run (a variant
``block@REV`` against ``prenorm@REV``).
"""

from __future__ import annotations

import csv
import functools
import importlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

from attnres.train.resources import peak_memory_mib

RESULTS = Path(__file__).resolve().parent / "results"
REPO = Path(__file__).resolve().parent.parent


@functools.cache
def import_revision(rev: str) -> ModuleType:
    """The ``attnres`` package as it was at git revision ``rev``, imported as ``attnres_<sha>``
    from a temporary folder (the package imports itself relatively, so the name is free)."""
    sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True,
                         check=True).stdout.strip()
    name = f"attnres_{sha}"
    archive = subprocess.run(["git", "archive", sha, "attnres"], cwd=REPO, capture_output=True, check=True).stdout
    root = Path(tempfile.mkdtemp(prefix="attnres-revision-"))
    with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
        tar.extractall(root, filter="data")
    (root / "attnres").rename(root / name)
    sys.path.insert(0, str(root))
    return importlib.import_module(name)


def with_revisions(variants: list[str], revisions: list[str], skip: tuple[str, ...] = ()) -> list[str]:
    """``variants`` with each one's ``variant@REV`` right after it (none for those in ``skip``):
    a design's revisions run next to each other in every round."""
    return [f"{v}@{rev}" if rev else v for v in variants for rev in [None, *revisions] if not (rev and v in skip)]


def split_variant(variant: str) -> tuple[str, str | None]:
    """``"block@abc123"`` -> ``("block", "abc123")``; a variant without ``@`` is the current code."""
    name, _, rev = variant.partition("@")
    return name, rev or None


def own_baseline(variant: str, baseline: str) -> str:
    """The ``baseline`` variant of ``variant``'s revision (``block@REV`` -> ``baseline@REV``)."""
    rev = split_variant(variant)[1]
    return baseline if rev is None else f"{baseline}@{rev}"


def ratio_to_own_baseline(times: dict[str, list[float]], baseline: str) -> dict[str, dict]:
    """``ratio_summary`` with each revision's variants against that revision's ``baseline``
    (``block@REV`` against ``baseline@REV``)."""
    out = {}
    for name in times:
        base = own_baseline(name, baseline)
        out[name] = ratio_summary({name: times[name], base: times[base]}, base)[name]
    return out


def span(low: float, high: float, digits: int = 3) -> str:
    """``low..high``, as the results tables write a spread or an interval."""
    return f"{low:.{digits}f}..{high:.{digits}f}"


def against_revisions(measured: dict[str, dict[str, list[float]]]) -> list[dict]:
    """The current code against each revision that ran beside it: for every measurement (a name
    -> the per-round seconds of every variant) and every ``name@REV`` variant whose ``name`` ran
    in the same rounds, the median and min..max of the per-round ratios current / revision."""
    rows = []
    for measurement, times in measured.items():
        for variant, ts in times.items():
            name, rev = split_variant(variant)
            if rev is None or name not in times:
                continue
            ratios = [now / then for now, then in zip(times[name], ts)]
            rows.append(dict(variant=name, revision=rev, measurement=measurement, rounds=len(ratios),
                             now_vs_rev=statistics.median(ratios),
                             spread=span(min(ratios), max(ratios))))
    return rows


def rss_mib() -> float:
    """Current resident set size of this process in MiB."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mib() -> float:
    """Peak RSS of this process image in MiB (VmHWM, as the trainer reports it: getrusage's
    ru_maxrss would carry a large parent's peak into a child across fork and exec)."""
    return peak_memory_mib(torch.device("cpu"))


def interleaved(fns: dict[str, Callable[[], None]], rounds: int, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of every function, one call of each per round, in turn."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def ratio_summary(times: dict[str, list[float]], baseline: str) -> dict[str, dict]:
    """Median seconds, and the median and min..max of per-round ratios to ``baseline``."""
    base = times[baseline]
    out = {}
    for name, ts in times.items():
        ratios = [t / b for t, b in zip(ts, base)]
        out[name] = dict(
            median_s=statistics.median(ts),
            ratio=statistics.median(ratios),
            ratio_min=min(ratios),
            ratio_max=max(ratios),
        )
    return out


def child_memory(script: str, variant: str, extra: list[str] | None = None) -> dict:
    """Run ``script --child variant`` in a fresh interpreter; it prints one JSON line."""
    cmd = [sys.executable, script, "--child", variant, *(extra or [])]
    # Large blocks go straight to mmap and back to the system when freed, so that the peak RSS
    # tracks the peak of live tensors rather than what glibc's heap happens to retain
    # (without it, repeated runs of one variant differ by 20%).
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def report_child(baseline_rss: float, **fields) -> None:
    """Print the child's JSON line: peak growth above ``baseline_rss``."""
    print(json.dumps(dict(growth_mib=peak_rss_mib() - baseline_rss, baseline_mib=baseline_rss, **fields)))


def print_table(rows: list[dict], columns: list[str]) -> None:
    widths = {c: max(len(c), *(len(fmt(r.get(c))) for r in rows)) for c in columns}
    print("  ".join(c.ljust(widths[c]) for c in columns))
    print("  ".join("-" * widths[c] for c in columns))
    for r in rows:
        print("  ".join(fmt(r.get(c)).ljust(widths[c]) for c in columns))


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.3f}" if abs(v) < 100 else f"{v:.0f}"
    return "" if v is None else str(v)


def write_csv(name: str, rows: list[dict]) -> Path:
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{name}.csv"
    keys = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        w.writerows(rows)
    return path


def machine() -> str:
    return f"{os.cpu_count()} CPU cores, torch {torch.__version__}, {torch.get_num_threads()} threads, {allocator()}"


def allocator() -> str:
    """The glibc malloc settings this process runs under (they move CPU timings: see BENCHMARKS.md)."""
    fixed = [f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("MALLOC_") and k.endswith("_")]
    return "malloc " + (" ".join(fixed) if fixed else "defaults")
