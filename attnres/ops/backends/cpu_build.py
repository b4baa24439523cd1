"""Compile and load the fused CPU kernels (``csrc/depth_attention_cpu.cpp`` and
``csrc/multi_stream_cpu.cpp``, one library) on first use.

The kernels are plain C++ with OpenMP, no PyTorch headers: one ``g++`` call of about two seconds.
The shared library is cached under ``attnres.cache.cache_dir()`` (``$ATTNRES_CACHE_DIR``, else
``$XDG_CACHE_HOME/attnres``, else ``~/.cache/attnres``), named by a hash of the source, the
compiler, its flags and the CPU's feature flags (the build targets the CPU it runs on,
``-march=native``), so an edited source or another machine gets its own build. Concurrent
first uses (several ranks of a distributed job) each build into a temporary file and rename it
into place, so nobody loads a half-written library.

It links OpenMP as ``libgomp.so.1``; PyTorch's CPU build loads its own copy under that name
first, so the kernels share PyTorch's OpenMP runtime (one thread pool, not two competing ones).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from ...cache import cache_dir

SOURCES = tuple(Path(__file__).with_name("csrc") / name for name in ("depth_attention_cpu.cpp", "multi_stream_cpu.cpp"))
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-std=c++17", "-shared", "-fPIC")


class BuildError(RuntimeError):
    """The kernels could not be compiled or loaded here; the message says why."""


def _cpu_features() -> str:
    """The CPU's feature flags (what ``-march=native`` compiles for), or the platform's name."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _compiler() -> str:
    return os.environ.get("CXX", "g++")


def _build_key(compiler: str) -> str:
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise BuildError(f"no C++ compiler: running {compiler!r} failed ({err}); set CXX to one") from err
    digest = hashlib.sha256()
    for part in (*(source.read_bytes() for source in SOURCES), " ".join(FLAGS).encode(), version.encode(),
                 _cpu_features().encode()):
        digest.update(part)
    return digest.hexdigest()[:16]


def _compile(compiler: str, target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
    except OSError as err:
        raise BuildError(f"cannot write the kernel cache {target.parent} ({err}); set ATTNRES_CACHE_DIR") from err
    names = " and ".join(source.name for source in SOURCES)
    try:
        done = subprocess.run([compiler, *FLAGS, *map(str, SOURCES), "-o", tmp], capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise BuildError(f"{compiler} failed to compile {names}:\n{done.stderr[-2000:]}")
        os.replace(tmp, target)
    except (OSError, subprocess.SubprocessError) as err:
        raise BuildError(f"running {compiler} on {names} failed: {err}") from err
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@functools.cache
def load_library() -> ctypes.CDLL:
    """The compiled kernels, built on the first call; raises ``BuildError`` saying why not."""
    import torch  # noqa: F401  (PyTorch's libgomp must be loaded before the kernels')

    compiler = _compiler()
    target = cache_dir() / f"attnres_cpu_{_build_key(compiler)}.so"
    if not target.exists():
        _compile(compiler, target)
    try:
        return ctypes.CDLL(str(target))
    except OSError as err:
        raise BuildError(f"could not load {target}: {err}") from err


@functools.cache
def build_problem() -> str | None:
    """Why the CPU kernels cannot run here (compiler missing or failing), or None when they can."""
    try:
        load_library()
    except BuildError as err:
        return str(err)
    return None
