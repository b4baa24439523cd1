"""Every registered backend against the naive reference: forward and every gradient.

The tests parametrize over ``ops.BACKENDS``, so a new backend is tested here without a new test;
one that cannot serve a case on this machine (its declared devices, dtypes or ablations, a
missing compiler) is skipped, saying why.

The inference and stream passes are in ``test_backend_streams.py``, HC's, mHC's and GR's
operations in ``test_backend_stream_ops.py``; the inputs and helpers all share are
``backend_cases.py``.
"""

import gc
import warnings
import weakref

import pytest
import torch

from attnres import build_stream, ops
from attnres.ops import BACKENDS, BackendOps, Request, depth_attention, depth_attention_naive, rms_norm
from attnres.ops import registry
from tests.backend_cases import DTYPES, EVERY, OTHERS, SHAPES, Norm, assert_grads_close, drive, grads, make, use


# -- one read -----------------------------------------------------------------------------------

@pytest.mark.parametrize("heads,dim,n,lead", SHAPES)
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("backend", OTHERS)
def test_read_matches_naive(heads, dim, n, lead, dtype, tol, backend):
    use(backend, dtype)
    query, gain, sources = make(dim, n, lead, dtype)
    fast = depth_attention(query, sources, gain, heads=heads, backend=backend)
    ref = depth_attention(query, sources, gain, heads=heads, backend="naive")
    torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)
    cot = torch.randn_like(ref)
    assert_grads_close(grads(fast, [query, gain, *sources], cot), grads(ref, [query, gain, *sources], cot), 10 * tol)


@pytest.mark.parametrize("score,key_norm", [("sigmoid", True), ("softmax", False), ("sigmoid", False)])
@pytest.mark.parametrize("backend", OTHERS)
def test_ablations_match_naive(score, key_norm, backend):
    use(backend, torch.float64, score, key_norm)
    query, gain, sources = make(12, 4, (3, 2), torch.float64)
    gain = gain if key_norm else None
    inputs = [query, *sources] + ([gain] if gain is not None else [])
    kw = dict(heads=3, score=score, key_norm=key_norm)
    fast = depth_attention(query, sources, gain, backend=backend, **kw)
    ref = depth_attention(query, sources, gain, backend="naive", **kw)
    torch.testing.assert_close(fast, ref, atol=1e-12, rtol=1e-12)
    cot = torch.randn_like(ref)
    for a, b in zip(grads(fast, inputs, cot), grads(ref, inputs, cot)):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("heads", [1, 2, 4])
@pytest.mark.parametrize("backend", EVERY)
def test_read_gradcheck_fp64(heads, backend):
    use(backend, torch.float64)
    query, gain, sources = make(12, 3, (2, 3), torch.float64, seed=heads)
    assert torch.autograd.gradcheck(
        lambda q, k, *s: depth_attention(q, list(s), k, heads=heads, backend=backend), (query, gain, *sources)
    )


@pytest.mark.parametrize("backend", EVERY)
def test_frozen_inputs_get_no_gradient(backend):
    use(backend)
    query, gain, sources = make(8, 3, (4,), torch.float32)
    gain.requires_grad_(False)
    sources[1].requires_grad_(False)
    out = depth_attention(query, sources, gain, heads=2, backend=backend)
    out.sum().backward()
    assert gain.grad is None and sources[1].grad is None
    assert query.grad is not None and sources[0].grad is not None
    # and nothing at all when only a frozen query and gain meet trainable sources
    q2 = query.detach()
    out = depth_attention(q2, [s.detach().requires_grad_() for s in sources], gain, backend=backend)
    assert out.requires_grad


# -- several queries (phase 1 of a block) ---------------------------------------------------------

@pytest.mark.parametrize("heads,queries", [(1, 1), (2, 3), (4, 5)])
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("backend", EVERY)
def test_attend_matches_per_query_naive_including_lse(heads, queries, dtype, tol, backend):
    fns = use(backend, dtype)
    g = torch.Generator().manual_seed(queries)
    sources = [torch.randn(3, 12, generator=g, dtype=dtype).requires_grad_() for _ in range(4)]
    qs = torch.randn(queries, 12, generator=g, dtype=dtype).requires_grad_()
    ks = (1 + 0.2 * torch.randn(queries, 12, generator=g, dtype=dtype)).requires_grad_()
    outs, lse = fns.attend(qs, sources, ks, heads=heads)
    out = torch.stack(outs)
    ref_out, ref_lse = [], []
    for s in range(queries):
        o, w = depth_attention_naive(qs[s], sources, ks[s], heads=heads, return_weights=True)
        ref_out.append(o)
        # lse from the naive weights: w_j = exp(l_j - lse), so lse = l_j - log w_j for any j;
        # recompute the logits independently for j = 0
        k0 = sources[0] / torch.sqrt(sources[0].pow(2).mean(-1, keepdim=True) + 1e-6) * ks[s]
        l0 = (k0.view(3, heads, -1) * qs[s].view(heads, -1)).sum(-1)
        ref_lse.append(l0 - w[0].log())
    ref_out, ref_lse = torch.stack(ref_out), torch.stack(ref_lse)
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)
    torch.testing.assert_close(lse.to(dtype), ref_lse, atol=tol, rtol=tol)
    c1, c2 = torch.randn_like(out), torch.randn_like(ref_lse)
    inputs = [qs, ks, *sources]
    assert_grads_close(grads((out, lse), inputs, (c1, c2.to(lse.dtype))), grads((ref_out, ref_lse), inputs, (c1, c2)),
                       10 * tol)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("backend", OTHERS)
def test_attend_with_an_unused_output(score, backend):
    """Each query has its own output: the gradient of the ones in use is exact, and an unused
    one contributes nothing (no zero-filled gradient is materialized for it)."""
    fns = use(backend, torch.float64, score)
    g = torch.Generator().manual_seed(7)
    dt = torch.float64
    sources = [torch.randn(2, 5, 12, generator=g, dtype=dt).requires_grad_() for _ in range(3)]
    qs = torch.randn(3, 12, generator=g, dtype=dt).requires_grad_()
    ks = (1 + 0.2 * torch.randn(3, 12, generator=g, dtype=dt)).requires_grad_()
    outs, _ = fns.attend(qs, sources, ks, heads=2, score=score)
    refs = [depth_attention_naive(qs[s], sources, ks[s], heads=2, score=score) for s in range(3)]
    cot = torch.randn(2, 5, 12, generator=g, dtype=dt)
    inputs = [qs, ks, *sources]
    used = [(outs[0], refs[0]), (outs[2], refs[2])]
    fast = grads([o for o, _ in used], inputs, [cot, 2 * cot])
    ref = grads([r for _, r in used], inputs, [cot, 2 * cot])
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)
    assert fast[0][1].abs().max() == 0  # the unused query's row gets no gradient


# where the norm runs in the backend's own pass it rounds on its own; bf16 to one unit in the last place
NORM_DTYPES = [pytest.param(torch.float32, 1e-6, id="fp32"), pytest.param(torch.bfloat16, 1e-2, id="bf16")]


@pytest.mark.parametrize("dtype,tol", NORM_DTYPES)
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("backend", EVERY)
def test_phase_one_with_the_first_norm_fused_is_the_norm_of_the_output(dtype, tol, score, backend):
    fns = use(backend, dtype, score)
    query, gain, sources = make(12, 3, (2, 5), dtype)
    weight = 1 + 0.3 * torch.randn(12).to(dtype)
    qs, ks = torch.stack([query, -query]), torch.stack([gain, gain])
    fused, _ = fns.attend(qs, sources, ks, heads=2, score=score, norm=Norm(weight))
    plain, _ = fns.attend(qs, sources, ks, heads=2, score=score)
    assert fused[0].dtype == dtype and torch.equal(fused[1], plain[1])
    torch.testing.assert_close(fused[0], rms_norm(plain[0], weight, 1e-5), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_torch_backend_fused_norms_are_bit_for_bit(dtype, score):
    """The ``torch`` backend normalizes with ``rms_norm``'s own arithmetic: phase 1's first
    output and a merge with the norm fused equal the norm applied after, bit for bit."""
    fns = use("torch", dtype, score)
    query, gain, sources = make(12, 3, (2, 5), dtype)
    weight = 1 + 0.3 * torch.randn(12).to(dtype)
    qs, ks = torch.stack([query, -query]), torch.stack([gain, gain])
    fused, _ = fns.attend(qs, sources, ks, heads=2, score=score, norm=Norm(weight))
    plain, _ = fns.attend(qs, sources, ks, heads=2, score=score)
    assert torch.equal(fused[0], rms_norm(plain[0], weight, 1e-5))
    o1, lse1, partial, query, gain, weight = merge_inputs(dtype, heads=3)
    kw = dict(heads=3, score=score)
    fused = fns.merge(o1, lse1, partial, query, gain, norm=Norm(weight), **kw)
    separate = rms_norm(fns.merge(o1, lse1, partial, query, gain, **kw), weight, 1e-5)
    assert fused.dtype == dtype and torch.equal(fused, separate)


@pytest.mark.parametrize("heads,score", [(1, "softmax"), (3, "softmax"), (2, "sigmoid")])
@pytest.mark.parametrize("backend", EVERY)
def test_phase_one_with_the_first_norm_fused_gradients(heads, score, backend):
    fns = use(backend, torch.float64, score)
    query, gain, sources = make(12, 3, (2, 3), torch.float64, seed=heads)
    weight = (1 + 0.3 * torch.randn(12, dtype=torch.float64)).requires_grad_()
    qs = torch.stack([query, -query]).detach().requires_grad_()
    ks = torch.stack([gain, 2 * gain]).detach().requires_grad_()
    inputs = (qs, ks, weight, *sources)
    kw = dict(heads=heads, score=score)

    def fused(q, k, w, *src):
        outs, lse = fns.attend(q, list(src), k, norm=Norm(w), **kw)
        return (*outs, lse) if score == "softmax" else outs

    def separate(q, k, w, *src):
        outs, lse = fns.attend(q, list(src), k, **kw)
        outs = (rms_norm(outs[0], w, 1e-5), *outs[1:])
        return (*outs, lse) if score == "softmax" else outs

    assert torch.autograd.gradcheck(fused, inputs)
    a_out, b_out = fused(*inputs), separate(*inputs)
    cots = [torch.randn_like(t) for t in a_out]
    for a, b in zip(grads(a_out, inputs, cots), grads(b_out, inputs, cots)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", OTHERS)
def test_prepared_values_must_match_the_sources(backend):
    fns = use(backend)
    query, gain, sources = make(12, 3, (4,), torch.float32)
    if fns.prepare(sources[0]) is None:
        pytest.skip(f"backend {backend!r} prepares nothing: it normalizes inside")
    with pytest.raises(ValueError, match="prepared has 1 entries for 3 sources"):
        fns.attend(query[None], sources, gain[None], prepared=[None])


# -- phase 2: the merge ---------------------------------------------------------------------------

@pytest.mark.parametrize("score,key_norm", [("softmax", True), ("sigmoid", True), ("softmax", False)])
@pytest.mark.parametrize("norm", [False, True], ids=["", "norm"])
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("backend", EVERY)
def test_merge_equals_routing_with_the_partial(score, key_norm, norm, dtype, tol, backend):
    """Phase 1 over the completed sources, then the partial merged in: the read over all of
    them (the two-phase identity, METHOD.md section 3), its norm included, forward and gradients."""
    fns = use(backend, dtype, score, key_norm)
    query, gain, sources = make(12, 4, (3, 2), dtype)
    weight = (1 + 0.3 * torch.randn(12, generator=torch.Generator().manual_seed(1), dtype=dtype)).requires_grad_()
    gain = gain if key_norm else None
    read_norm = Norm(weight) if norm else None
    completed, partial = sources[:-1], sources[-1]
    kw = dict(heads=3, score=score, key_norm=key_norm)
    o1, lse1 = fns.attend(query[None], completed, None if gain is None else gain[None], **kw)
    merged = fns.merge(o1[0], lse1[0], partial, query, gain, norm=read_norm, **kw)
    ref = depth_attention_naive(query, sources, gain, **kw)
    ref = rms_norm(ref, weight, 1e-5) if norm else ref
    torch.testing.assert_close(merged, ref, atol=tol, rtol=tol)
    cot = torch.randn_like(ref)
    inputs = [query, *sources] + ([gain] if gain is not None else []) + ([weight] if norm else [])
    assert_grads_close(grads(merged, inputs, cot), grads(ref, inputs, cot), 10 * tol)


@pytest.mark.parametrize("heads,score", [(1, "softmax"), (3, "softmax"), (2, "sigmoid")])
@pytest.mark.parametrize("backend", EVERY)
def test_merge_gradcheck_fp64(heads, score, backend):
    fns = use(backend, torch.float64, score)
    g = torch.Generator().manual_seed(heads)
    dt = torch.float64
    o1, partial = (torch.randn(2, 3, 12, generator=g, dtype=dt).requires_grad_() for _ in range(2))
    lse1 = torch.randn(2, 3, heads, generator=g, dtype=dt).requires_grad_(score == "softmax")
    query, gain = torch.randn(12, generator=g, dtype=dt), 1 + 0.3 * torch.randn(12, generator=g, dtype=dt)
    weight = (1 + 0.3 * torch.randn(12, generator=g, dtype=dt)).requires_grad_()
    inputs = (o1, lse1, partial, query.requires_grad_(), gain.requires_grad_())
    assert torch.autograd.gradcheck(lambda *t: fns.merge(*t, heads=heads, score=score), inputs)
    assert torch.autograd.gradcheck(lambda *t: fns.merge(*t[:5], heads=heads, score=score, norm=Norm(t[5])),
                                    (*inputs, weight))


def merge_inputs(dtype, heads, seed=3):
    g = torch.Generator().manual_seed(seed)
    o1, partial = (torch.randn(2, 3, 12, generator=g).to(dtype).requires_grad_() for _ in range(2))
    lse1 = torch.randn(2, 3, heads, generator=g).requires_grad_()
    query = (0.5 * torch.randn(12, generator=g)).to(dtype).requires_grad_()
    gain = (1 + 0.3 * torch.randn(12, generator=g)).to(dtype).requires_grad_()
    weight = (1 + 0.3 * torch.randn(12, generator=g)).to(dtype).requires_grad_()
    return o1, lse1, partial, query, gain, weight


@pytest.mark.parametrize("dtype,tol", NORM_DTYPES)
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
@pytest.mark.parametrize("backend", EVERY)
def test_merge_with_the_norm_fused_is_the_norm_of_the_merge(dtype, tol, score, backend):
    fns = use(backend, dtype, score)
    o1, lse1, partial, query, gain, weight = merge_inputs(dtype, heads=3)
    kw = dict(heads=3, score=score)
    fused = fns.merge(o1, lse1, partial, query, gain, norm=Norm(weight), **kw)
    separate = rms_norm(fns.merge(o1, lse1, partial, query, gain, **kw), weight, 1e-5)
    assert fused.dtype == dtype
    torch.testing.assert_close(fused, separate, atol=tol, rtol=tol)


@pytest.mark.parametrize("heads,score", [(1, "softmax"), (3, "softmax"), (2, "sigmoid")])
@pytest.mark.parametrize("backend", EVERY)
def test_merge_with_the_norm_fused_gradients(heads, score, backend):
    fns = use(backend, torch.float64, score)
    inputs = tuple(t.detach().double().requires_grad_() for t in merge_inputs(torch.float32, heads))
    kw = dict(heads=heads, score=score)
    o1, lse1, partial, query, gain, weight = inputs
    fused = fns.merge(o1, lse1, partial, query, gain, norm=Norm(weight), **kw)
    separate = rms_norm(fns.merge(o1, lse1, partial, query, gain, **kw), weight, 1e-5)
    cot = torch.randn_like(fused)
    for a, b in zip(grads(fused, inputs, cot), grads(separate, inputs, cot)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", [name for name in OTHERS if name in ("torch", "cpu")])
def test_phase_one_outputs_beyond_the_first_are_freed_after_their_merge(backend):
    """The memory-efficient backends: the second query's phase-1 output lives only until its
    merge has run; neither phase 1 nor the merge keeps it for backward."""
    fns = use(backend)
    query, gain, sources = make(12, 4, (3, 2), torch.float32)
    outs, lse = fns.attend(torch.stack([query, 2 * query]), sources[:-1], torch.stack([gain, gain]))
    probe = weakref.ref(outs[1])
    merged = fns.merge(outs[1], lse[1], sources[-1], 2 * query, gain, norm=Norm(None, 1e-6))
    loss = (outs[0] ** 2).sum() + (merged ** 2).sum()
    del outs
    gc.collect()
    assert probe() is None
    loss.backward()  # and backward still has all it needs
    assert all(s.grad is not None for s in sources) and query.grad is not None


# -- the registry -------------------------------------------------------------------------------

def test_every_backend_offers_the_interface():
    """Each registered backend is one ``BackendOps`` object that implements the methods its
    registry line declares, and no others (those raise, naming the backend)."""
    for name, b in BACKENDS.items():
        if b.setup is not None and b.setup():
            continue  # not importable here (its tests skip, saying why)
        backend_ops = ops.backend(name)
        assert isinstance(backend_ops, BackendOps) and backend_ops.name == name
        declared = {"attend": True, "merge": True, "prepare": True, "score_source": b.scores_ahead,
                    "attend_scored": b.scores_ahead, "decode_read": b.decodes,
                    "source_grad": b.defers_source_grads}
        for method, offered in declared.items():
            implemented = getattr(type(backend_ops), method) is not getattr(BackendOps, method)
            twin = name == "naive" and method == "source_grad"  # the reference of cpu's, for tests
            assert implemented == offered or twin, (name, method)
    with pytest.raises(NotImplementedError, match="backend 'torch' has no decode pass"):
        ops.backend("torch").decode_read(torch.zeros(2, 1, 8), 1, torch.zeros(8))


def test_backend_errors_and_single_warning():
    q = torch.zeros(2, 8)  # a per-token query
    sources = [torch.randn(2, 8)]
    with pytest.raises(RuntimeError, match="backend='torch' cannot run: .*per-token queries"):
        depth_attention(q, sources, backend="torch")
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        depth_attention(torch.zeros(8), sources, backend="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry._warned.clear()
        depth_attention(q, sources)
        depth_attention(q, sources)
    assert len([w for w in caught if "per-token" in str(w.message)]) == 1
    with pytest.raises(ValueError, match="backend='fast' is not one of"):
        build_stream("full", dim=8, num_sublayers=2, backend="fast")


def test_an_explicit_backend_that_cannot_serve_the_options_raises_before_any_work():
    with pytest.raises(ValueError, match="backend='torch' cannot run: .*per-token queries"):
        build_stream("full", dim=8, num_sublayers=2, query="input", backend="torch")
    with pytest.raises(ValueError, match="backend='triton' cannot run: .*score/key-norm ablations"):
        build_stream("block", dim=8, num_sublayers=2, score="sigmoid", backend="triton")
    # auto routes the input-dependent ablation on the reference, as naive does
    stream = build_stream("block", dim=8, num_sublayers=4, query="input")
    twin = build_stream("block", dim=8, num_sublayers=4, query="input", backend="naive")
    with torch.no_grad():
        stream.query_proj.normal_(0, 0.1)
    twin.load_state_dict(stream.state_dict())
    e, weights = torch.randn(3, 8), [torch.randn(8, 8) for _ in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        a, b = drive(stream, e, weights), drive(twin, e, weights)
    for x, y in zip(a[0] + [a[1]], b[0] + [b[1]]):
        assert torch.equal(x, y)


def test_auto_picks_by_device_and_dtype():
    pick = registry.pick
    assert pick("auto", Request("cpu", torch.bfloat16)).name == "torch"  # the kernels take fp32/fp64
    assert pick("auto", Request("cpu", torch.float32, per_token_query=True)).name == "naive"
    cpu_ok = BACKENDS["cpu"].setup() is None
    assert pick("auto", Request("cpu", torch.float64)).name == ("cpu" if cpu_ok else "torch")
    with pytest.raises(RuntimeError, match="backend='cpu' cannot run: .*float32 or float64.*bfloat16"):
        pick("cpu", Request("cpu", torch.bfloat16))
    with pytest.raises(RuntimeError, match="backend='cpu' cannot run: .*CPU tensors, got cuda"):
        pick("cpu", Request("cuda", torch.float32))
