"""Build and load the CPU kernels' library on first use: a PyTorch C++ extension
(``torch.utils.cpp_extension``, with ninja) of the kernels (``csrc/depth_attention_cpu.cpp``,
``csrc/multi_stream_cpu.cpp``: plain C++ with OpenMP, no PyTorch headers) and of their operators
(``csrc/cpu_ops.cpp``: ``TORCH_LIBRARY(attnres, ...)``, the ``attnres::cpu_*`` schemas and CPU
implementations). Loading it defines the operators; ``cpu_ops`` gives them their fake and autograd
formulas.

Every file compiles with ``flags()``: ``FLAGS`` (``-O3``, ``-ffp-contract=fast``, OpenMP, C++17)
and the instruction set's (``ISA_FLAGS``): ``-march=native`` for the CPU the build runs on unless
``$ATTNRES_CPU_ISA`` forces one of the x86 paths, ``avx2`` (x86-64-v3: AVX2 and FMA, the kernels'
vectors 256 bits wide) or ``avx512`` (x86-64-v4: AVX-512, vectors of 512 bits), each checked by the
same parity tests (``tests/test_cpu_isa.py``). The kernels take their vector width from the
instruction set they are compiled for (``ATTNRES_VEC_BYTES`` in ``csrc/cpu_kernels.h``).
cpp_extension adds only include paths, two macro definitions, ``-fPIC`` and a ``-std`` that ours,
coming after it, overrides, and links with ``-shared`` and PyTorch's libraries. The kernels link
OpenMP as ``libgomp.so.1``; PyTorch's CPU build loads its own copy under that name first, so the
kernels share PyTorch's OpenMP runtime (one thread pool, not two competing ones).

The build lives under ``attnres.cache.cache_dir()`` (``$ATTNRES_CACHE_DIR``, else
``$XDG_CACHE_HOME/attnres``, else ``~/.cache/attnres``), in ``cpu_kernels/<key>``, the key a hash
of everything that changes the build (``build_inputs``): the sources, the flags, the compiler's
and ninja's versions, the CPU's feature flags, the PyTorch build (version and commit) and its
include paths, and the environment (the interpreter's prefix and version): an edited source,
another machine, another environment (the serving one, ``.venv-serve``, has its own) or another
ninja gets a build of its own, so that two environments side by side never rebuild each other's
kernels, and a build is made once. A cold build takes 13 to 60 s (two idle cores compile the
three files in parallel in about 13 s; docs/ARCHITECTURE.md), and the process that builds says so
once on stderr; later processes only load it (ninja finds nothing to do).

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
#: the compiler flags of every file but the instruction set's; cpp_extension adds -fPIC and links
#: with -shared
FLAGS = ("-O3", "-ffp-contract=fast", "-fopenmp", "-std=c++17")
LINK_FLAGS = ("-fopenmp",)
#: ``$ATTNRES_CPU_ISA`` -> the flags of that instruction set; ``native`` (the default) compiles for
#: the CPU the build runs on, the others force one x86 path (tuned for this CPU all the same)
ISA_FLAGS = {
    "native": ("-march=native",),
    "avx2": ("-march=x86-64-v3", "-mtune=native"),
    "avx512": ("-march=x86-64-v4", "-mtune=native", "-mprefer-vector-width=512"),
}
#: the CPU features (``/proc/cpuinfo``'s names) each forced path needs
ISA_NEEDS = {"avx2": ("avx2", "fma"), "avx512": ("avx512f", "avx512bw", "avx512dq", "avx512vl")}


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


def isa() -> str:
    """The instruction set the kernels are built for: ``$ATTNRES_CPU_ISA`` (``native`` when
    unset), checked against this CPU (``check_isa``)."""
    return check_isa(os.environ.get("ATTNRES_CPU_ISA", "native") or "native", _cpu_features())


def check_isa(name: str, features: str) -> str:
    """``name`` when ``ISA_FLAGS`` has it and a CPU with ``features`` (``/proc/cpuinfo``'s
    flags line) runs it; ``BuildError`` naming what is wrong otherwise."""
    if name not in ISA_FLAGS:
        raise BuildError(f"ATTNRES_CPU_ISA={name!r} is not one of {sorted(ISA_FLAGS)}")
    have = set(features.partition(":")[2].split())
    lacking = [feature for feature in ISA_NEEDS.get(name, ()) if feature not in have]
    if lacking:
        raise BuildError(f"ATTNRES_CPU_ISA={name}: this CPU lacks {', '.join(lacking)}; unset it to build for the "
                         f"CPU as it is")
    return name


def flags() -> tuple[str, ...]:
    """Every compiler flag of the build: ``FLAGS`` and the instruction set's (``isa``)."""
    return ISA_FLAGS[isa()] + FLAGS


def _version(command: list[str]) -> str:
    """What ``command`` (a tool's ``--version``) prints, or why it did not run."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as err:
        return f"not run: {err}"
    return done.stdout + done.stderr


def build_inputs(cxx: str) -> list[str]:
    """What changes the build, each as text: the sources, the flags, the compiler's and ninja's
    versions, the CPU's features, the PyTorch build and its include paths, the interpreter's
    prefix and version (one environment's build is not another's: ninja's records name the
    include paths, so a folder shared by two environments would be rebuilt at each switch).
    ``BuildError`` when the compiler does not run."""
    from torch.utils import cpp_extension  # imports setuptools: only when the kernels are wanted

    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as err:
        raise BuildError(f"no C++ compiler: running {cxx!r} failed ({err}); set CXX to one") from err
    _use_ninja_of_this_environment()
    ninja = shutil.which("ninja") or "ninja"
    return [*(path.read_text() for path in (*SOURCES, *HEADERS)), " ".join(flags() + LINK_FLAGS), version,
            _version([ninja, "--version"]), _cpu_features(), torch.__version__, str(torch.version.git_version),
            "\n".join(cpp_extension.include_paths()), sys.prefix, sys.version]


def build_key(cxx: str) -> str:
    """The name of the build for these ``build_inputs`` (16 hex digits); ``BuildError`` when the
    compiler does not run."""
    digest = hashlib.sha256()
    for part in build_inputs(cxx):
        digest.update(part.encode() + b"\0")
    return digest.hexdigest()[:16]


def _loaded_builds() -> set[Path]:
    """The builds of the kernels this process has loaded (a process can hold one: a second would
    define the ``attnres`` operators again, which PyTorch answers by ending the process)."""
    return {Path(p) for p in torch.ops.loaded_libraries if Path(p).name.startswith("attnres_cpu_")}


def _use_ninja_of_this_environment() -> None:
    """Put the environment's own ninja (the ninja package, beside the interpreter) first on PATH,
    where cpp_extension looks for it: whether the environment is activated or not, its builds then
    run one ninja, whose version is part of the build's key (another ninja reads the build's
    records as stale and builds again)."""
    here = Path(sys.executable).parent
    if (here / "ninja").exists() and shutil.which("ninja") != str(here / "ninja"):
        os.environ["PATH"] = f"{here}{os.pathsep}{os.environ.get('PATH', '')}"


@functools.cache
def load_library() -> Path:
    """The library's path, built on the first call in its cache folder and loaded (its operators
    defined); ``BuildError`` saying why not."""
    from torch.utils import cpp_extension  # imports setuptools: only when the kernels are wanted

    _use_ninja_of_this_environment()
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
        if not library.exists():
            print(f"attnres: building the CPU kernels for this machine and environment ({isa()}), 13-60 s, once: "
                  f"{folder}", file=sys.stderr, flush=True)
        try:
            cpp_extension.load(name, [str(s) for s in SOURCES], extra_cflags=list(flags()),
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
