"""The fused CPU kernels (``backend="cpu"``) against the PyTorch path, where they must agree to
rounding: multi-query reads, the fused pre-norm, the merges; what only they do: broadcast and
strided sources, the thread count, mixed dtypes. The build and its cache are checked in
``test_cpu_build.py``; the kernels' checks against the naive reference (shapes, ablations,
gradcheck, frozen inputs, streams) run with every other backend's in ``test_backends.py``,
``test_backend_streams.py`` and ``test_backend_stream_ops.py``."""

import pytest
import torch

from attnres import build_stream
from attnres.ops import backend, depth_attention
from attnres.ops.backends import cpu_build, cpu_ops, cpu_streams
from attnres.ops.backends.common import inverse_rms
from attnres.ops.backends.naive import gated_mix_naive

from .backend_cases import Norm, grads, make

# The CPU kernels need a C++ compiler (g++ or $CXX); where none works, the tests that run them
# say why they were skipped, and those of the fallback still run.
needs_kernels = pytest.mark.skipif(cpu_build.build_problem() is not None,
                                   reason=f"CPU kernels unavailable: {cpu_build.build_problem()}")


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
    for fns in (backend("torch"), backend("cpu")):
        outs, lse = fns.attend(qs, sources, ks, heads=heads, score=score, norm=Norm(weight) if norm else None)
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
        outs, lse = backend("cpu").attend(q, list(src), k, heads=2, norm=Norm(w))
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


def assert_same_on_1_2_and_3_threads(call, inputs):
    """``call()`` and the gradients of its sum with respect to ``inputs`` agree (fp64, to 1e-12)
    run on 1, 2 and 3 threads: a kernel's per-thread partial sums do not change the result."""
    threads, results = torch.get_num_threads(), []
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = call()
            results.append((out, *grads(out, inputs, torch.ones_like(out))))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            torch.testing.assert_close(b, a, atol=1e-12, rtol=1e-12)


@needs_kernels
def test_thread_count_does_not_change_the_result():
    """Per-thread partial sums of the query and gain gradients, reduced after the kernel."""
    query, gain, sources = make(16, 5, (67,), torch.float64)
    assert_same_on_1_2_and_3_threads(lambda: depth_attention(query, sources, gain, heads=4, backend="cpu"),
                                     [query, gain, *sources])


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

    def run(name):
        return backend(name).merge(o1, lse1, partial, query, gain, norm=Norm(weight) if norm else None, **kw)

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
    cpu = backend("cpu")
    assert torch.autograd.gradcheck(
        lambda *t: cpu.merge(*t[:5], heads=2, norm=Norm(t[5])), (o1, lse1, partial, query, gain, weight)
    )
    assert torch.autograd.gradcheck(lambda *t: cpu.merge(*t, heads=2), (o1, lse1, partial, query, gain))


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
def test_a_half_precision_partial_is_merged_in_fp32():
    """A pass runs on the backend chosen from its embedding; a later bf16 partial (sublayers under
    CPU autocast) is merged in fp32 and returned in bf16, as the reference does (to bf16's
    rounding: the PyTorch path mixes in bf16)."""
    g = torch.Generator().manual_seed(2)
    o1 = torch.randn(2, 5, 12, generator=g).requires_grad_()
    lse1 = torch.randn(2, 5, 3, generator=g).requires_grad_()
    partial = torch.randn(2, 5, 12, generator=g).bfloat16().requires_grad_()
    query, gain, weight = (torch.randn(12, generator=g).requires_grad_() for _ in range(3))
    inputs = [o1, lse1, partial, query, gain, weight]
    for norm in (None, Norm(weight)):
        fast, ref = (backend(n).merge(o1, lse1, partial, query, gain, heads=3, norm=norm) for n in ("cpu", "naive"))
        assert fast.dtype == ref.dtype == (torch.bfloat16 if norm is None else torch.float32)
        torch.testing.assert_close(fast, ref, atol=1e-2, rtol=1e-2)
        cot = torch.randn(ref.shape, generator=g).to(ref.dtype)
        for a, b in zip(grads(fast, inputs, cot), grads(ref, inputs, cot)):
            assert (a is None) == (b is None) and (a is None or a.dtype == b.dtype)
            if a is not None:
                torch.testing.assert_close(a.float(), b.float(), atol=1e-2, rtol=1e-2)
        with torch.no_grad():
            torch.testing.assert_close(backend("cpu").merge(o1, lse1, partial, query, gain, heads=3, norm=norm), fast)


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


@needs_kernels
def test_decode_read_splits_many_tokens_over_threads():
    """Enough work for the kernel's threads (64 sequences of one position, 5 sources of 256):
    the same read with 1 and 2 threads as the reference."""
    g = torch.Generator().manual_seed(5)
    buffer = torch.randn(6, 64, 1, 256, generator=g)
    query = 0.1 * torch.randn(256, generator=g)
    want = backend("naive").decode_read(buffer, 5, query, heads=4, norm=Norm(None))
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            with torch.no_grad():
                got = backend("cpu").decode_read(buffer, 5, query, heads=4, norm=Norm(None))
            torch.testing.assert_close(got, want, atol=2e-6, rtol=2e-6)
    finally:
        torch.set_num_threads(threads)


@needs_kernels
@pytest.mark.parametrize("count,buffer,base,message", [
    (0, torch.zeros(3, 2, 1, 8), None, r"given count=0 of \(3, 2, 1, 8\)"),
    (4, torch.zeros(3, 2, 1, 8), None, r"given count=4 of \(3, 2, 1, 8\)"),
    (2, torch.zeros(3, 2, 1, 16)[..., ::2], None, r"contiguous=False"),
    (2, torch.zeros(3, 2, 1, 8), torch.zeros(1, 1, 8), r"base must be one source's shape \(2, 1, 8\), given \(1, 1, 8\)"),
])
def test_decode_read_refuses_a_buffer_it_cannot_read(count, buffer, base, message):
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        backend("cpu").decode_read(buffer, count, torch.zeros(8), base=base, gate=0.5)


@needs_kernels
def test_decode_read_refuses_autograd():
    with pytest.raises(RuntimeError, match=r"decode_read is for a decode pass, with autograd off"):
        backend("cpu").decode_read(torch.randn(2, 1, 1, 8), 2, torch.randn(8))


@needs_kernels
@pytest.mark.parametrize("kind,options", [("full", {}), ("block", dict(block_size=2))])
def test_a_fused_read_norm_promotes_as_rms_norm(kind, options):
    """fp32 data through fp64 norm gains: every read (Full's, a block's first, a merged one) and
    the output come out in the dtype the reference's ``rms_norm`` gives."""
    dtypes = {}
    for name in ("cpu", "naive"):
        stream = build_stream(kind, dim=16, num_sublayers=4, backend=name, **options).double()
        state = stream.init(torch.randn(2, 3, 16))
        reads = []
        for i in range(4):
            reads.append(stream.read(state, i).dtype)
            state = stream.write(state, i, torch.randn(2, 3, 16))
        dtypes[name] = (reads, stream.output(state).dtype)
    assert dtypes["cpu"] == dtypes["naive"]


# -- the custom ops: what a compiled graph calls --------------------------------------------------

def op_cases(dt):
    """One call of every depth-attention ``attnres::cpu_*`` op on tiny inputs of dtype ``dt``, its
    arguments by name: the fused norm, the sigmoid score without key norm, given logits, a gradient
    left out, a backward for a ledger, a merge that keeps nothing."""
    ops = cpu_ops.kernels()
    g = torch.Generator().manual_seed(11)
    lead, D, H = (2, 3), 8, 2

    def rand(*shape, grad=False):
        return torch.randn(*shape, generator=g, dtype=dt).requires_grad_(grad)

    sources = [rand(*lead, D, grad=True) for _ in range(3)]
    fixed = [v.detach() for v in sources]
    qg, weight = rand(2, D, grad=True), (1 + 0.1 * rand(D)).requires_grad_()
    inv_rms = [inverse_rms(v) for v in sources]
    norm = dict(norm_weight=weight, norm_eps=1e-5)
    no_norm = dict(norm_weight=None, norm_eps=None)
    attend = dict(qg=qg, sources=sources, logits=None, heads=H)
    softmax, sigmoid = dict(score="softmax", key_norm=True), dict(score="sigmoid", key_norm=False)
    cases = [(ops.cpu_attend, dict(**attend, inv_rms=inv_rms, **norm, **softmax)),
             (ops.cpu_attend, dict(**attend, inv_rms=[], **no_norm, **sigmoid)),
             (ops.cpu_attend, dict(qg=None, sources=fixed, inv_rms=[], logits=rand(3, 2, *lead, H),
                                  **no_norm, heads=H, score="softmax", key_norm=False))]
    with torch.no_grad():  # what backward is given: no graph
        outs, lse, norm_rr = ops.cpu_attend(**cases[0][1])
    cases.append((ops.cpu_attend_backward, dict(
        grad_outs=[rand(*lead, D), None], grad_lse=rand(2, *lead, H), qg=qg.detach(),
        sources=fixed, inv_rms=inv_rms, lse=lse, norm_weight=weight.detach(), norm_rr=norm_rr,
        norm_eps=1e-5, heads=H, score="softmax", key_norm=True, sources_need=[True, False, True],
        qg_needs=True, weight_needs=True)))
    cases.append((ops.cpu_attend_backward, dict(cases[-1][1], sources_need=[False, True, False], for_ledger=True)))
    cases.append((ops.cpu_attend_backward, dict(cases[-1][1], logits=rand(3, 2, *lead, H))))  # scored when written
    o1, lse1 = rand(*lead, D, grad=True), rand(*lead, H, grad=True)
    partial, query = rand(*lead, D, grad=True), rand(D, grad=True)
    merge = dict(o1=o1, lse1=lse1, partial=partial, qg=query, heads=H, eps=1e-6)
    cases += [(ops.cpu_merge, dict(**merge, **norm, **softmax)),
              (ops.cpu_merge, dict(**merge, **no_norm, **sigmoid)),
              (ops.cpu_merge, dict({k: t.detach() for k, t in merge.items() if torch.is_tensor(t)}, heads=H, eps=1e-6,
                                   norm_weight=weight.detach(), norm_eps=1e-5, **softmax, keep=False))]
    with torch.no_grad():
        out, h, s2, w, r, rr = ops.cpu_merge(**cases[-3][1])
    cases.append((ops.cpu_merge_backward, dict(
        grad=rand(*lead, D), partial=partial.detach(), qg=query.detach(),
        norm_weight=weight.detach(), h=h, s2=s2, w=w, r=r, rr=rr, norm_eps=1e-5, heads=H, eps=1e-6,
        **softmax, o1_needs=True, lse1_needs=False, partial_needs=True, qg_needs=True,
        weight_needs=True)))
    v = rand(*lead, D)
    cases.append((ops.cpu_source_grad, dict(
        source=v, inv_rms=inverse_rms(v), queries=[rand(2, D), rand(1, D)],
        lse=[rand(2, *lead, H), rand(1, *lead, H)], ds=[rand(2, *lead, H), rand(1, *lead, H)],
        grads=[rand(*lead, D), None, rand(*lead, D)], grad=rand(*lead, D), heads=H,
        score="softmax", key_norm=True, logits=[None, None])))
    cases.append((ops.cpu_source_grad, dict(cases[-1][1], logits=[rand(2, *lead, H), None])))  # one read's given
    cases.append((ops.cpu_decode_read, dict(
        sources=rand(4, *lead, D), count=3, query=rand(D), heads=H, eps=1e-6, score="softmax",
        key_norm=True, base=rand(*lead, D), gate=0.5, norm_weight=rand(D), norm_eps=1e-5)))
    return cases


@needs_kernels
@pytest.mark.parametrize("dt", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_every_custom_op_passes_opcheck(dt):
    """Schema, fake (meta) implementation, autograd registration and AOT dispatch with dynamic
    shapes (``torch.library.opcheck``) of every op, on each of its kinds of call."""
    cases = op_cases(dt)
    names = ("attend", "attend_backward", "merge", "merge_backward", "source_grad", "decode_read")
    assert {op.default.name() for op, _ in cases} == {f"attnres::cpu_{n}" for n in names}
    for op, kwargs in cases:
        torch.library.opcheck(op, (), kwargs)


@needs_kernels
@pytest.mark.parametrize("norm", [False, True], ids=["", "norm"])
@pytest.mark.parametrize("score,key_norm", [("softmax", True), ("sigmoid", False)])
def test_the_ops_equal_the_direct_calls(norm, score, key_norm):
    """A compiled graph calls the ops through their autograd formulas (``attend_via_ops``,
    ``merge_via_ops``); eager mode calls them from autograd functions of its own: the same outputs
    and the same gradients, exactly."""
    g = torch.Generator().manual_seed(7)

    def rand(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=g, dtype=dtype)

    sources = [(rand(2, 5, 12) * (1 + j)).requires_grad_() for j in range(4)]
    qs, ks = rand(3, 12).requires_grad_(), (1 + 0.2 * rand(3, 12)).requires_grad_()
    weight = (1 + 0.3 * rand(12, dtype=torch.float64)).requires_grad_()  # promotes the output
    partial = rand(2, 5, 12).requires_grad_()
    inputs = [qs, ks, weight, partial, *sources]
    kw = dict(heads=3, score=score, key_norm=key_norm, norm=Norm(weight) if norm else None)
    prepared = [inverse_rms(v) for v in sources] if key_norm else None
    results = []
    cpu_backend = backend("cpu")
    for attend, merge in ((cpu_backend.attend, cpu_backend.merge), (cpu_ops.attend_via_ops, cpu_ops.merge_via_ops)):
        outs, lse = attend(qs, sources, ks, prepared=prepared, **kw)
        h = merge(outs[1], lse[1], partial, qs[1], ks[1], **kw)
        picked = [outs[0], outs[2], h] + ([lse] if score == "softmax" else [])
        cots = [torch.randn(t.shape, generator=torch.Generator().manual_seed(k), dtype=t.dtype)
                for k, t in enumerate(picked)]
        results.append((picked, list(grads(picked, inputs, cots))))
    (direct, d_grads), (via_ops, o_grads) = results
    for a, b in zip(direct + d_grads, via_ops + o_grads):
        assert (a is None) == (b is None)
        if a is not None:
            assert a.dtype == b.dtype
            torch.testing.assert_close(b, a, atol=0, rtol=0)
    with torch.no_grad():
        buffer, query = rand(4, 2, 1, 12), rand(12)
        want = cpu_backend.decode_read(buffer, 3, query, heads=3, score=score, key_norm=key_norm,
                                   norm=kw["norm"])
        got = cpu_ops.kernels().cpu_decode_read(buffer, 3, query, 3, 1e-6, score, key_norm, None, 0.0,
                                 weight if norm else None, 1e-5 if norm else None)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@needs_kernels
def test_the_gates_exponential_is_as_close_as_torch_sigmoid():
    """GR's gates come from the kernels' own vectorized exponential (fp32): over the logits a
    gate takes short of underflow, within 2 units in the last place of the exact sigmoid
    (torch.sigmoid's own error here is 1.4e-7 relative), and 0 < gate <= 1 beyond."""
    z = torch.linspace(-80, 80, 100_003)[None, None]  # [1, n=1, D]: the read is the gate itself
    gate = cpu_streams.gated_mix(torch.ones_like(z), z)[0]
    exact = torch.sigmoid(z[0, 0].double())
    assert ((gate.double() - exact).abs() / exact).max() <= 2 * 2.0**-23
    far = torch.tensor([[[-1e4, -200.0, -88.5, 88.5, 200.0, 1e4]]])
    far_gate = cpu_streams.gated_mix(torch.ones_like(far), far)[0]
    assert (far_gate > 0).all() and (far_gate <= 1).all() and far_gate[-1] == 1 and far_gate[0] < 1e-37
    nan = cpu_streams.gated_mix(torch.ones(1, 1, 3), torch.tensor([[[float("nan"), 0.0, 1.0]]]))[0]
    assert nan.isnan().tolist() == [True, False, False]  # a NaN logit is not clamped into a gate
    # the low-rank kernel's gates: logits z = 1 * U from a rank-1 layer, the same exponential
    lowrank = cpu_streams.gated_mix_lowrank(torch.ones(1, 1, 7), torch.ones(1, 1), z[0, 0, :7, None].clone())
    assert torch.equal(lowrank[0], gate[:7])


@needs_kernels
def test_the_lowrank_gates_do_not_depend_on_the_thread_count():
    """Per-thread partial sums of dU, over tokens in blocks of 4 (67 tokens: a partial block)."""
    g = torch.Generator().manual_seed(0)
    R, h, up = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((67, 3, 10), (67, 5), (30, 5)))
    inputs = [t.requires_grad_() for t in (R, h, up)]
    assert_same_on_1_2_and_3_threads(lambda: cpu_streams.gated_mix_lowrank(*inputs), inputs)


@needs_kernels
def test_a_large_up_projection_takes_the_product_then_the_gated_kernel(monkeypatch):
    """Past ``LOWRANK_KERNEL_BYTES`` the backend forms the logits with a product and mixes them with
    ``gated_mix``: the same numbers as the reference, forward and backward."""
    monkeypatch.setattr(cpu_streams, "LOWRANK_KERNEL_BYTES", 0)
    monkeypatch.setattr(cpu_streams, "GatedMixLowRankFunction", None)  # would fail if called
    g = torch.Generator().manual_seed(1)
    inputs = [torch.randn(*shape, generator=g).requires_grad_() for shape in ((9, 4, 12), (9, 3), (48, 3))]
    fast, ref = backend("cpu").gated_mix_lowrank(*inputs), backend("naive").gated_mix_lowrank(*inputs)
    torch.testing.assert_close(fast, ref)
    cot = torch.randn_like(ref)
    for a, b in zip(grads(fast, inputs, cot), grads(ref, inputs, cot)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@needs_kernels
@pytest.mark.parametrize("R,h,up,message", [
    ((2, 3, 4), (5, 2), (12, 2), r"h \[\.\.\., r\] \(R's leading dims"),
    ((2, 3, 4), (2, 2), (1, 2), r"up \(1, 2\)"),
    ((2, 3, 4), (2, 0), (12, 0), r"r >= 1"),
])
def test_the_lowrank_kernel_refuses_shapes_it_cannot_read(R, h, up, message):
    with pytest.raises(ValueError, match=message):
        cpu_streams.gated_mix_lowrank(torch.ones(R), torch.ones(h), torch.ones(up))


@needs_kernels
def test_the_gated_kernel_refuses_logits_of_another_shape_and_reads_others_in_rs_dtype():
    with pytest.raises(ValueError, match=r"logits z of R's shape"):
        cpu_streams.gated_mix(torch.ones(2, 3, 4), torch.ones(1, 3, 4))
    R, z = torch.randn(2, 3, 4), torch.randn(2, 3, 4, dtype=torch.float64)
    torch.testing.assert_close(cpu_streams.gated_mix(R, z), gated_mix_naive(R, z.float()))
