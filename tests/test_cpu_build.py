"""The CPU kernels' build: ``auto`` picks them where they load and falls back with one warning
where no compiler works; an explicit ``backend="cpu"`` says why it cannot run; a failing build
names the compiler's error and leaves no library behind; the library is built once per source,
machine and PyTorch, and an unwritable cache is reported, not a crash."""

import os
import subprocess
import sys
import warnings

import pytest
import torch

from attnres import build_stream
from attnres.cache import cache_dir
from attnres.ops import depth_attention, registry
from attnres.ops.backends import cpu_build

from .backend_cases import make

# The CPU kernels need a C++ compiler (g++ or $CXX); where none works, the tests that load them
# say why they were skipped, and those of the fallback still run.
needs_kernels = pytest.mark.skipif(cpu_build.build_problem() is not None,
                                   reason=f"CPU kernels unavailable: {cpu_build.build_problem()}")


@needs_kernels
def test_auto_picks_the_kernels_for_fp32_and_fp64_cpu_tensors():
    for dtype in (torch.float32, torch.float64):
        assert registry.pick("auto", registry.Request("cpu", dtype)).name == "cpu"
    stream = build_stream("block", dim=8, num_sublayers=4, backend="cpu")
    with torch.no_grad():  # bf16 sources: the explicit backend says why it cannot run
        stream = stream.to(torch.bfloat16)
        with pytest.raises(RuntimeError, match="bfloat16"):
            stream.init(torch.randn(2, 8, dtype=torch.bfloat16))


def test_without_a_compiler_auto_warns_once_and_explicit_raises(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path / "cache"))
    cpu_build.load_library.cache_clear()
    cpu_build.build_problem.cache_clear()
    try:
        query, gain, sources = make(8, 3, (4,), torch.float32)
        registry._warned.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            a = depth_attention(query, sources, gain)
            b = depth_attention(query, sources, gain)
        messages = [str(w.message) for w in caught]
        assert len(messages) == 1 and "torch backend on CPU" in messages[0] and "no-such-compiler" in messages[0]
        torch.testing.assert_close(a, depth_attention(query, sources, gain, backend="torch"))
        torch.testing.assert_close(a, b)
        with pytest.raises(RuntimeError, match="backend='cpu' cannot run: no C\\+\\+ compiler"):
            depth_attention(query, sources, gain, backend="cpu")
    finally:
        cpu_build.load_library.cache_clear()
        cpu_build.build_problem.cache_clear()
        registry._warned.clear()


def test_a_failing_build_names_the_compiler_error(tmp_path):
    """In a process of its own: one that has loaded the kernels does not build them again."""
    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\necho 'fake-cxx 1.0'\n[ \"$1\" = --version ] && exit 0\necho 'error: no space' >&2\nexit 1\n")
    fake.chmod(0o755)
    env = dict(os.environ, CXX=str(fake), ATTNRES_CACHE_DIR=str(tmp_path / "cache"))
    code = "from attnres.ops.backends import cpu_build; print(cpu_build.build_problem())"
    problem = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True).stdout
    assert "failed to compile depth_attention_cpu.cpp" in problem and "error: no space" in problem
    assert list((tmp_path / "cache").rglob("*.so")) == []  # no half-written library left behind


@needs_kernels
def test_the_library_is_built_once_per_source_machine_and_torch(monkeypatch):
    """The library loaded is the build its key names in the cache; a later process loads it as it
    is (ninja finds nothing to do); another PyTorch gets a build of its own."""
    library = cpu_build.load_library()
    compiler = cpu_build.compiler()
    key = cpu_build.build_key(compiler)
    assert library == cache_dir() / "cpu_kernels" / key / f"attnres_cpu_{key}.so"
    stamp = library.stat().st_mtime_ns
    code = "from attnres.ops.backends import cpu_build; print(cpu_build.load_library())"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == str(library) and library.stat().st_mtime_ns == stamp
    monkeypatch.setattr(torch, "__version__", "0.0.0+another")
    assert cpu_build.build_key(compiler) != key


@needs_kernels
def test_an_unwritable_cache_is_a_build_problem_not_a_crash(monkeypatch, tmp_path):
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache directory would go")
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(blocked / "cache"))
    cpu_build.load_library.cache_clear()
    cpu_build.build_problem.cache_clear()
    try:
        problem = cpu_build.build_problem()
        assert problem is not None and "cannot write the kernel cache" in problem and "ATTNRES_CACHE_DIR" in problem
    finally:
        cpu_build.load_library.cache_clear()
        cpu_build.build_problem.cache_clear()
