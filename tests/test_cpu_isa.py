"""The CPU kernels' builds: one per instruction set (``ATTNRES_CPU_ISA``), each passing the
kernels' parity tests, and one per environment and build tool, never rebuilt by another."""

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from attnres.ops.backends import cpu_build

LOADED = "from attnres.ops.backends import cpu_build; print(cpu_build.load_library())"


def test_an_instruction_set_is_refused_by_name_or_by_what_the_cpu_lacks():
    with pytest.raises(cpu_build.BuildError, match=r"ATTNRES_CPU_ISA='sse9' is not one of \['avx2', 'avx512', "
                                                   r"'native'\]"):
        cpu_build.check_isa("sse9", "flags\t: fpu sse2 avx2 fma")
    with pytest.raises(cpu_build.BuildError, match="ATTNRES_CPU_ISA=avx512: this CPU lacks avx512f, avx512bw, "
                                                   "avx512dq, avx512vl; unset it"):
        cpu_build.check_isa("avx512", "flags\t: fpu sse2 avx2 fma")
    assert cpu_build.check_isa("avx2", "flags\t: fpu sse2 avx2 fma") == "avx2"
    assert cpu_build.check_isa("native", "Features\t: fp asimd") == "native"


def test_the_key_covers_the_flags_the_environment_and_the_build_tool(monkeypatch):
    """Each of what changes a build changes its key: the instruction set's flags, the
    interpreter's prefix (another environment), PyTorch's include paths and ninja's version."""
    cxx = cpu_build.compiler()
    key = cpu_build.build_key(cxx)
    inputs = cpu_build.build_inputs(cxx)
    ninja = shutil.which("ninja")  # the environment's own, first on PATH once build_inputs ran
    assert ninja == str(Path(sys.executable).parent / "ninja") or not (Path(sys.executable).parent / "ninja").exists()
    version = subprocess.run([ninja, "--version"], capture_output=True, text=True, check=True).stdout
    assert sys.prefix in inputs and version in inputs
    if cpu_build.check_isa("avx2", cpu_build._cpu_features()) == "avx2":
        monkeypatch.setenv("ATTNRES_CPU_ISA", "avx2")
        assert cpu_build.build_key(cxx) != key
        monkeypatch.delenv("ATTNRES_CPU_ISA")
    monkeypatch.setattr(sys, "prefix", "/another/environment")
    assert cpu_build.build_key(cxx) != key
    monkeypatch.undo()
    assert cpu_build.build_key(cxx) == key


#: the files whose cpu cases run under each forced instruction set: the kernels' own tests and
#: every backend parity file (one read and the merge, whole stream passes, the stream ops)
PARITY_FILES = ("test_cpu_kernels.py", "test_backends.py", "test_backend_streams.py", "test_backend_stream_ops.py")


@pytest.mark.slow
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_each_forced_instruction_set_builds_and_passes_the_parity_tests(isa, tmp_path):
    """The kernels built for ``isa`` (in a cache of their own) run the CPU kernels' tests and the
    backends' parity tests on the cpu backend: every output and gradient against the references."""
    try:
        cpu_build.check_isa(isa, cpu_build._cpu_features())
    except cpu_build.BuildError as err:
        pytest.skip(str(err))
    env = dict(os.environ, ATTNRES_CPU_ISA=isa, ATTNRES_CACHE_DIR=str(tmp_path / "cache"))
    built = subprocess.run([sys.executable, "-c", LOADED], capture_output=True, text=True, env=env, check=False)
    assert built.returncode == 0 and f"building the CPU kernels for this machine and environment ({isa})" \
        in built.stderr, built.stderr
    tests = os.path.dirname(__file__)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                           *(os.path.join(tests, name) for name in PARITY_FILES), "-k", "cpu or kernel"], capture_output=True, text=True, env=env, check=False)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert " passed" in done.stdout.splitlines()[-1]


@pytest.mark.slow
def test_two_environments_side_by_side_keep_their_own_builds(tmp_path):
    """A second virtual environment (its own interpreter prefix, PyTorch from the first's
    site-packages) gets a build of its own; loading in one, then the other, then the first again
    builds nothing more: the first library is the same file, untouched."""
    env = dict(os.environ, ATTNRES_CACHE_DIR=str(tmp_path / "cache"))
    other = tmp_path / "other-env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(other)], check=True)
    site = sysconfig.get_paths()["purelib"]
    mine = other / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (mine / "first-env.pth").write_text(site + "\n")  # the first environment's packages, attnres among them
    ninja = Path(sys.executable).parent / "ninja"
    if ninja.exists():  # the ninja package's command, as the environment would install it
        (other / "bin" / "ninja").symlink_to(ninja)
    python = str(other / "bin" / "python")

    def load(interpreter):
        done = subprocess.run([interpreter, "-c", LOADED], capture_output=True, text=True, env=env, check=False)
        assert done.returncode == 0, done.stderr
        return done.stdout.strip().splitlines()[-1], done.stderr

    first, said = load(sys.executable)
    assert "building the CPU kernels" in said
    stamp = os.stat(first).st_mtime_ns
    second, said = load(python)
    assert second != first and "building the CPU kernels" in said
    again, said = load(sys.executable)
    assert again == first and os.stat(first).st_mtime_ns == stamp and "building" not in said
    again, said = load(python)
    assert again == second and "building" not in said
