"""Build and load the CPU kernels' library on first use: a PyTorch C++ extension
(``torch.utils.cpp_extension``, with ninja) of the kernels (``csrc/depth_attention_cpu.cpp``,
``csrc/multi_stream_cpu.cpp``: plain C++ with OpenMP, no PyTorch headers) and of their operators
(``csrc/cpu_ops.cpp``: ``TORCH_LIBRARY(attnres, ...)``, the ``attnres::cpu_*`` schemas and CPU
implementations). Loading it defines the operators; ``cpu_ops`` gives them their fake and autograd
formulas.

Every file compiles with ``FLAGS``, the flags the kernels are tuned and checked with (``-O3``,
``-march=native`` for the CPU the build runs on, ``-ffp-contract=fast``, OpenMP, C++17):
cpp_extension adds only include paths, two macro definitions, ``-fPIC`` and a ``-std`` that ours,
coming after it, overrides, and links with ``-shared`` and PyTorch's libraries. The kernels link
OpenMP as ``libgomp.so.1``; PyTorch's CPU build loads its own copy under that name first, so the
kernels share PyTorch's OpenMP runtime (one thread pool, not two competing ones).

The build lives under ``attnres.cache.cache_dir()`` (``$ATTNRES_CACHE_DIR``, else
``$XDG_CACHE_HOME/attnres``, else ``~/.cache/attnres``), in ``cpu_kernels/<key>``, the key a hash
of the sources, the flags, the compiler's version, the CPU's feature flags and the PyTorch build
(version and commit) with the Python it runs under: an edited source, another machine or another
environment (the serving one has its own torch) gets a build of its own, and a build is made
once. A cold build takes about 20 s of CPU time, 13 s of wall time on two idle cores (the
three files compile in parallel; docs/ARCHITECTURE.md); later processes only load it (ninja
finds nothing to do).

Several processes starting at once (the ranks of a distributed job): cpp_extension lets one of
them build in a folder while the others poll a lock file (``FileBaton``) until it is gone, but a
builder killed mid-build would leave that file behind and every later process waiting on it for
ever. So each process first takes an ``flock`` on ``build.lock`` in the folder, which the
operating system releases however its holder ends; a baton file found while holding it is a dead
builder's and is removed. One process builds; the others wait on the ``flock``, then load the
library it built.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from ...cache import cache_dir

CSRC = Path(__file__).with_name("csrc")
#: what the library is built from: the kernels, then their operators (the header they share below)
SOURCES = tuple(CSRC / name for name in ("depth_attention_cpu.cpp", "multi_stream_cpu.cpp", "cpu_ops.cpp"))
HEADERS = (CSRC / "cpu_kernels.h",)
#: the compiler flags of every file; cpp_extension adds -fPIC and links with -shared
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-fopenmp", "-std=c++17")
LINK_FLAGS = ("-fopenmp",)


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


def compiler() -> str:
    """The C++ compiler cpp_extension runs: ``$CXX``, else ``c++``."""
    return os.environ.get("CXX", "c++")


def build_key(cxx: str) -> str:
    """The name of the build for this source, compiler ``cxx``, CPU and PyTorch (16 hex digits);
    ``BuildError`` when the compiler does not run."""
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise BuildError(f"no C++ compiler: running {cxx!r} failed ({err}); set CXX to one") from err
    digest = hashlib.sha256()
    for part in (*(path.read_bytes() for path in (*SOURCES, *HEADERS)), " ".join(FLAGS + LINK_FLAGS).encode(),
                 version.encode(), _cpu_features().encode(), torch.__version__.encode(),
                 str(torch.version.git_version).encode(), sys.implementation.cache_tag.encode()):
        digest.update(part)
    return digest.hexdigest()[:16]


def _loaded_builds() -> set[Path]:
    """The builds of the kernels this process has loaded (a process can hold one: a second would
    define the ``attnres`` operators again, which PyTorch answers by ending the process)."""
    return {Path(p) for p in torch.ops.loaded_libraries if Path(p).name.startswith("attnres_cpu_")}


@functools.cache
def load_library() -> Path:
    """The library's path, built on the first call in its cache folder and loaded (its operators
    defined); ``BuildError`` saying why not."""
    from torch.utils import cpp_extension  # imports setuptools: only when the kernels are wanted

    if shutil.which("ninja") is None and (Path(sys.executable).parent / "ninja").exists():
        # cpp_extension runs the ninja on PATH: the environment's own (the ninja package) when a
        # virtual environment's interpreter runs without the environment on PATH
        os.environ["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    if not cpp_extension.is_ninja_available():
        raise BuildError("ninja is not installed (pip install ninja): cpp_extension builds with it")
    cxx = compiler()
    key = build_key(cxx)
    folder, name = cache_dir() / "cpu_kernels" / key, f"attnres_cpu_{key}"
    library = folder / f"{name}.so"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        lock = open(folder / "build.lock", "a")  # noqa: SIM115  (held until the load is done)
    except OSError as err:
        raise BuildError(f"cannot write the kernel cache {folder} ({err}); set ATTNRES_CACHE_DIR") from err
    names = ", ".join(source.name for source in SOURCES)
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (folder / "lock").unlink(missing_ok=True)  # cpp_extension's baton, left by a builder that died
        others = _loaded_builds() - {library.resolve()}
        if others:
            raise BuildError(f"another build of the kernels is loaded in this process ({others.pop()}); "
                             f"{library} cannot be loaded beside it")
        try:
            cpp_extension.load(name, [str(s) for s in SOURCES], extra_cflags=list(FLAGS),
                               extra_ldflags=list(LINK_FLAGS), build_directory=str(folder),
                               is_python_module=False, verbose=False)
        except OSError as err:  # the library was built and could not be loaded
            raise BuildError(f"could not load {library}: {err}") from err
        except (RuntimeError, subprocess.SubprocessError) as err:
            raise BuildError(f"{cxx} failed to compile {names}:\n{str(err)[-2000:]}") from err
    return library


@functools.cache
def build_problem() -> str | None:
    """Why the CPU kernels cannot run here (compiler missing or failing), or None when they can."""
    try:
        load_library()
    except BuildError as err:
        return str(err)
    return None
