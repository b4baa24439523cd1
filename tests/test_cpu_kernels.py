"""The fused CPU kernels (``backend="cpu"``) against the naive twin and the PyTorch path:
multi-query reads, the fused pre-norm, the merges, broadcast and strided sources, the thread
count; and how the backend is chosen. The per-read checks shared with the PyTorch path (shapes,
ablations, gradcheck, frozen inputs) run on both backends in ``test_fast_paths.py``."""

import importlib
import warnings

import pytest
import torch

from attnres import build_stream
from attnres.ops import cpu_build, depth_attention, depth_attention_multi, merge, merge_and_norm, resolve_backend
from attnres.ops.cpu_kernels import depth_attention_multi_cpu

from .test_fast_paths import assert_stream_matches_naive, grads, make, needs_kernels

ops_module = importlib.import_module("attnres.ops.depth_attention")


@needs_kernels
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("heads,queries,used", [(1, 1, (0,)), (2, 3, (0, 2)), (4, 2, (1,)), (3, 3, (0, 1, 2))])
@pytest.mark.parametrize("norm", [False, True], ids=["", "norm"])
def test_multi_query_equals_the_torch_path(score, heads, queries, used, norm):
    """Several queries (phase 1 of a block), the lse output, outputs left unused, and the first
    output through its fused pre-norm (with a gain that gets its gradient): every output and
    every gradient equal the PyTorch path's."""
    g = torch.Generator().manual_seed(heads * 10 + queries)
    dt = torch.float64
    sources = [(torch.randn(2, 5, 12, generator=g, dtype=dt) * (1 + j)).requires_grad_() for j in range(4)]
    qs = torch.randn(queries, 12, generator=g, dtype=dt).requires_grad_()
    ks = (1 + 0.2 * torch.randn(queries, 12, generator=g, dtype=dt)).requires_grad_()
    weight = (1 + 0.3 * torch.randn(12, generator=g, dtype=dt)).requires_grad_()
    inputs = [qs, ks, weight, *sources]
    results = []
    for multi in (depth_attention_multi, depth_attention_multi_cpu):
        outs, lse = multi(qs, sources, ks, heads=heads, score=score, norm=(weight, 1e-5) if norm else None)
        picked = [outs[s] for s in used] + ([lse] if score == "softmax" else [])
        cots = [torch.randn(t.shape, generator=torch.Generator().manual_seed(k), dtype=dt) for k, t in enumerate(picked)]
        results.append((outs, lse, grads(picked, inputs, cots)))
    (a_outs, a_lse, a_grads), (b_outs, b_lse, b_grads) = results
    for a, b in zip([*a_outs, a_lse], [*b_outs, b_lse]):
        torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-12)
    for a, b in zip(a_grads, b_grads):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(b, a, atol=1e-11, rtol=1e-11)


@needs_kernels
def test_fused_norm_gradcheck_fp64():
    g = torch.Generator().manual_seed(3)
    dt = torch.float64
    sources = [torch.randn(3, 8, generator=g, dtype=dt).requires_grad_() for _ in range(3)]
    qs = torch.randn(2, 8, generator=g, dtype=dt).requires_grad_()
    ks = (1 + 0.2 * torch.randn(2, 8, generator=g, dtype=dt)).requires_grad_()
    weight = (1 + 0.3 * torch.randn(8, generator=g, dtype=dt)).requires_grad_()

    def fused(q, k, w, *src):
        outs, lse = depth_attention_multi_cpu(q, list(src), k, heads=2, norm=(w, 1e-5))
        return (*outs, lse)

    assert torch.autograd.gradcheck(fused, (qs, ks, weight, *sources))


@needs_kernels
def test_broadcast_and_strided_sources():
    """A row shared by every token (Delta's null source, expanded) is read without a copy; a
    strided source is read as a contiguous copy; both equal their contiguous twins, and the
    broadcast row's gradient is the sum over tokens."""
    g = torch.Generator().manual_seed(5)
    dt = torch.float64
    null = torch.randn(12, generator=g, dtype=dt).requires_grad_()
    wide = torch.randn(2, 5, 24, generator=g, dtype=dt).requires_grad_()
    plain = torch.randn(2, 5, 12, generator=g, dtype=dt).requires_grad_()
    query = torch.randn(12, generator=g, dtype=dt).requires_grad_()
    strided = wide[..., ::2]
    sources = [null.expand(2, 5, 12), strided, plain]
    twins = [null.expand(2, 5, 12).contiguous(), strided.contiguous(), plain]
    fast = depth_attention(query, sources, heads=2, backend="cpu")
    ref = depth_attention(query, twins, heads=2, backend="naive")
    torch.testing.assert_close(fast, ref, atol=1e-12, rtol=1e-12)
    cot = torch.randn(ref.shape, generator=g, dtype=dt)
    for a, b in zip(grads(fast, [query, null, wide, plain], cot), grads(ref, [query, null, wide, plain], cot)):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)


@needs_kernels
def test_thread_count_does_not_change_the_result():
    """Per-thread partial sums of the query and gain gradients, reduced after the kernel."""
    query, gain, sources = make(16, 5, (67,), torch.float64)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = depth_attention(query, sources, gain, heads=4, backend="cpu")
            results.append((out, *grads(out, [query, gain, *sources], torch.ones_like(out))))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-12)


@needs_kernels
@pytest.mark.parametrize("kind", ["block", "delta"])
@pytest.mark.parametrize("m,s,heads", [(7, 3, 1), (9, 2, 6)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["fp32", "fp64"])
def test_two_phase_stream_on_the_kernels_matches_naive(kind, m, s, heads, dtype, tol):
    assert_stream_matches_naive(kind, dict(block_size=s, heads=heads, backend="cpu"), m, dtype, tol)


@needs_kernels
def test_full_stream_on_the_kernels_matches_naive():
    assert_stream_matches_naive("full", dict(heads=2, backend="cpu"), 6, torch.float64, 1e-12)


@needs_kernels
def test_auto_picks_the_kernels_for_fp32_and_fp64_cpu_tensors():
    for dtype in (torch.float32, torch.float64):
        assert resolve_backend("auto", device_type="cpu", dtype=dtype) == "cpu"
    assert resolve_backend("auto", device_type="cpu", dtype=torch.bfloat16) == "torch"
    with pytest.raises(RuntimeError, match="backend='cpu' cannot run: .*float32 or float64.*bfloat16"):
        resolve_backend("cpu", device_type="cpu", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="backend='cpu' cannot run: .*CPU tensors, got cuda"):
        resolve_backend("cpu", device_type="cuda", dtype=torch.float32)
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
        ops_module._warned.clear()
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
        ops_module._warned.clear()


def test_a_failing_build_names_the_compiler_error(monkeypatch, tmp_path):
    fake = tmp_path / "fake-cxx"
    fake.write_text("#!/bin/sh\necho 'fake-cxx 1.0'\n[ \"$1\" = --version ] && exit 0\necho 'error: no space' >&2\nexit 1\n")
    fake.chmod(0o755)
    monkeypatch.setenv("CXX", str(fake))
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path / "cache"))
    cpu_build.load_library.cache_clear()
    cpu_build.build_problem.cache_clear()
    try:
        problem = cpu_build.build_problem()
        assert "failed to compile depth_attention_cpu.cpp" in problem and "error: no space" in problem
        assert list((tmp_path / "cache").iterdir()) == []  # no half-written library left behind
    finally:
        cpu_build.load_library.cache_clear()
        cpu_build.build_problem.cache_clear()


@needs_kernels
def test_the_library_is_built_once_per_source_and_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNRES_CACHE_DIR", str(tmp_path))
    cpu_build.load_library.cache_clear()
    try:
        cpu_build.load_library()
        built = list(tmp_path.glob("attnres_cpu_*.so"))
        assert len(built) == 1
        stamp = built[0].stat().st_mtime_ns
        cpu_build.load_library.cache_clear()
        cpu_build.load_library()  # found in the cache, not rebuilt
        assert list(tmp_path.glob("attnres_cpu_*.so")) == built and built[0].stat().st_mtime_ns == stamp
    finally:
        cpu_build.load_library.cache_clear()


@needs_kernels
@pytest.mark.parametrize("score,key_norm", [("softmax", True), ("sigmoid", True), ("softmax", False)])
@pytest.mark.parametrize("heads", [1, 3])
@pytest.mark.parametrize("norm", [False, True], ids=["", "norm"])
def test_merge_equals_the_torch_path(score, key_norm, heads, norm):
    """Phase 2 on the kernels, with and without the fused pre-norm: the output and the gradients
    of all six inputs equal the PyTorch merge's, with autograd on and off."""
    g = torch.Generator().manual_seed(heads + 10 * norm)
    dt = torch.float64
    o1 = torch.randn(2, 5, 12, generator=g, dtype=dt).requires_grad_()
    lse1 = torch.randn(2, 5, heads, generator=g, dtype=dt).requires_grad_()
    partial = (2 * torch.randn(2, 5, 12, generator=g, dtype=dt)).requires_grad_()
    query = torch.randn(12, generator=g, dtype=dt).requires_grad_()
    gain = (1 + 0.2 * torch.randn(12, generator=g, dtype=dt)).requires_grad_() if key_norm else None
    weight = (1 + 0.3 * torch.randn(12, generator=g, dtype=dt)).requires_grad_()
    inputs = [t for t in (o1, lse1, partial, query, gain, weight) if t is not None]
    kw = dict(heads=heads, score=score, key_norm=key_norm)

    def run(backend):
        if norm:
            return merge_and_norm(o1, lse1, partial, query, gain, weight, 1e-5, backend=backend, **kw)
        return merge(o1, lse1, partial, query, gain, backend=backend, **kw)

    fast, ref = run("cpu"), run("torch")
    torch.testing.assert_close(fast, ref, atol=1e-12, rtol=1e-12)
    cot = torch.randn(ref.shape, generator=g, dtype=dt)
    for a, b in zip(grads(fast, inputs, cot), grads(ref, inputs, cot)):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)
    with torch.no_grad():
        torch.testing.assert_close(run("cpu"), ref, atol=1e-12, rtol=1e-12)


@needs_kernels
def test_merge_gradcheck_fp64():
    g = torch.Generator().manual_seed(11)
    dt = torch.float64
    o1 = torch.randn(3, 8, generator=g, dtype=dt).requires_grad_()
    lse1 = torch.randn(3, 2, generator=g, dtype=dt).requires_grad_()
    partial = torch.randn(3, 8, generator=g, dtype=dt).requires_grad_()
    query = torch.randn(8, generator=g, dtype=dt).requires_grad_()
    gain = (1 + 0.2 * torch.randn(8, generator=g, dtype=dt)).requires_grad_()
    weight = (1 + 0.3 * torch.randn(8, generator=g, dtype=dt)).requires_grad_()
    assert torch.autograd.gradcheck(
        lambda *t: merge_and_norm(*t[:5], t[5], 1e-5, heads=2, backend="cpu"), (o1, lse1, partial, query, gain, weight)
    )
    assert torch.autograd.gradcheck(lambda *t: merge(*t, heads=2, backend="cpu"), (o1, lse1, partial, query, gain))


@needs_kernels
def test_sources_of_mixed_dtypes_are_read_in_the_first_ones():
    """The kernels read every source through the first one's pointer type: others are converted
    (and their gradients come back in their own dtype), as the PyTorch path converts them. (That
    path takes an fp32 source's key norm in fp32, hence fp32 tolerances.)"""
    query, gain, sources = make(12, 3, (2, 5), torch.float64)
    sources[1] = sources[1].detach().float().requires_grad_()
    fast = depth_attention(query, sources, gain, heads=3, backend="cpu")
    ref = depth_attention(query, sources, gain, heads=3, backend="torch")
    assert fast.dtype == ref.dtype == torch.float64
    torch.testing.assert_close(fast, ref, atol=1e-6, rtol=1e-6)
    cot = torch.randn_like(ref)
    for a, b in zip(grads(fast, [query, gain, *sources], cot), grads(ref, [query, gain, *sources], cot)):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)


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


@needs_kernels
def test_double_backward_through_the_kernels_raises():
    """The kernels' backward is not differentiable: a second-order gradient says so instead of
    silently dropping the terms that pass through the kernels."""
    query, gain, sources = make(8, 3, (4,), torch.float64)
    out = depth_attention(query, sources, gain, heads=2, backend="cpu")
    (g,) = torch.autograd.grad((out**2).sum(), [query], create_graph=True)  # a gradient that has a graph
    # the query reaches g only through the kernels' backward, whose outputs carry no graph
    with pytest.raises(RuntimeError, match="differentiate twice|appears to not have been used in the graph"):
        torch.autograd.grad(g.sum(), [query])
