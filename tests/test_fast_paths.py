"""Every fast path against its naive twin: forward and every gradient."""

import importlib
import warnings

import pytest
import torch

from attnres import build_stream
from attnres.ops import (
    cpu_build,
    depth_attention,
    depth_attention_multi,
    depth_attention_naive,
    merge_norm,
    merge_partial,
    mix_scored,
    rms_norm,
    source_scores,
)

# The CPU kernels need a C++ compiler (g++ or $CXX); where none works, the tests that run them
# say why they were skipped, and those of the fallback still run.
needs_kernels = pytest.mark.skipif(cpu_build.build_problem() is not None,
                                   reason=f"CPU kernels unavailable: {cpu_build.build_problem()}")

FAST_BACKENDS = ["torch", pytest.param("cpu", marks=needs_kernels)]

SHAPES = [
    pytest.param(1, 6, 1, (5,), id="H1-D6-N1"),
    pytest.param(1, 9, 4, (2, 3), id="H1-D9-N4"),
    pytest.param(2, 10, 3, (7,), id="H2-D10-N3"),
    pytest.param(4, 12, 9, (2, 5), id="H4-D12-N9"),
    pytest.param(8, 96, 5, (3, 4), id="H8-D96-N5"),
]


def make(dim, n, lead, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    sources = [(torch.randn(*lead, dim, generator=g, dtype=dtype) * (1 + j)).requires_grad_() for j in range(n)]
    query = (0.5 * torch.randn(dim, generator=g, dtype=dtype)).requires_grad_()
    gain = (1 + 0.3 * torch.randn(dim, generator=g, dtype=dtype)).requires_grad_()
    return query, gain, sources


def assert_close_to_scale(actual, expected, tol):
    """``max |a - b| <= tol * max |b|``: float32 gradients are sums of many rounded terms, so
    elementwise relative error is meaningless for entries near zero; the error is measured
    against the gradient's scale (fp32 paths, naive included, sit near 1e-6 of fp64 truth)."""
    scale = expected.abs().max().clamp_min(1e-30)
    err = (actual - expected).abs().max()
    assert err <= tol * scale, f"max error {err:.3e} > {tol:.0e} x scale {scale:.3e}"


def grads(out, inputs, cot):
    return torch.autograd.grad(out, inputs, cot, allow_unused=True)


@pytest.mark.parametrize("heads,dim,n,lead", SHAPES)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["fp32", "fp64"])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_fast_backend_matches_naive(heads, dim, n, lead, dtype, tol, backend):
    query, gain, sources = make(dim, n, lead, dtype)
    fast = depth_attention(query, sources, gain, heads=heads, backend=backend)
    ref = depth_attention(query, sources, gain, heads=heads, backend="naive")
    torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)
    cot = torch.randn_like(ref)
    for a, b in zip(grads(fast, [query, gain, *sources], cot), grads(ref, [query, gain, *sources], cot)):
        torch.testing.assert_close(a, b, atol=tol * 10, rtol=tol * 10)


@pytest.mark.parametrize("score,key_norm", [("sigmoid", True), ("softmax", False), ("sigmoid", False)])
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_fast_backend_ablations_match_naive(score, key_norm, backend):
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
@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_fast_backend_gradcheck_fp64(heads, backend):
    query, gain, sources = make(12, 3, (2, 3), torch.float64, seed=heads)
    assert torch.autograd.gradcheck(
        lambda q, k, *s: depth_attention(q, list(s), k, heads=heads, backend=backend), (query, gain, *sources)
    )


@pytest.mark.parametrize("backend", FAST_BACKENDS)
def test_frozen_inputs_get_no_gradient(backend):
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


@pytest.mark.parametrize("heads,queries", [(1, 1), (2, 3), (4, 5)])
def test_multi_query_matches_per_query_naive_including_lse(heads, queries):
    g = torch.Generator().manual_seed(queries)
    dt = torch.float64
    sources = [torch.randn(3, 12, generator=g, dtype=dt).requires_grad_() for _ in range(4)]
    qs = torch.randn(queries, 12, generator=g, dtype=dt).requires_grad_()
    ks = (1 + 0.2 * torch.randn(queries, 12, generator=g, dtype=dt)).requires_grad_()
    outs, lse = depth_attention_multi(qs, sources, ks, heads=heads)
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
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)
    c1, c2 = torch.randn_like(out), torch.randn_like(lse)
    inputs = [qs, ks, *sources]
    for a, b in zip(grads((out, lse), inputs, (c1, c2)), grads((ref_out, ref_lse), inputs, (c1, c2))):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_multi_query_with_an_unused_output(score):
    """Each query has its own output: the gradient of the ones in use is exact, and an unused
    one contributes nothing (no zero-filled gradient is materialized for it)."""
    g = torch.Generator().manual_seed(7)
    dt = torch.float64
    sources = [torch.randn(2, 5, 12, generator=g, dtype=dt).requires_grad_() for _ in range(3)]
    qs = torch.randn(3, 12, generator=g, dtype=dt).requires_grad_()
    ks = (1 + 0.2 * torch.randn(3, 12, generator=g, dtype=dt)).requires_grad_()
    outs, _ = depth_attention_multi(qs, sources, ks, heads=2, score=score)
    refs = [depth_attention_naive(qs[s], sources, ks[s], heads=2, score=score) for s in range(3)]
    cot = torch.randn(2, 5, 12, generator=g, dtype=dt)
    inputs = [qs, ks, *sources]
    used = [(outs[0], refs[0]), (outs[2], refs[2])]
    fast = grads([o for o, _ in used], inputs, [cot, 2 * cot])
    ref = grads([r for _, r in used], inputs, [cot, 2 * cot])
    for a, b in zip(fast, ref):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)
    assert fast[0][1].abs().max() == 0  # the unused query's row gets no gradient


@pytest.mark.parametrize("score,key_norm", [("softmax", True), ("sigmoid", True), ("softmax", False)])
def test_merge_partial_equals_routing_with_the_partial(score, key_norm):
    query, gain, sources = make(12, 4, (3, 2), torch.float64)
    gain = gain if key_norm else None
    completed, partial = sources[:-1], sources[-1]
    kw = dict(heads=3, score=score, key_norm=key_norm)
    o1, lse1 = depth_attention_multi(query[None], completed, None if gain is None else gain[None], **kw)
    merged = merge_partial(o1[0], lse1[0], partial, query, gain, **kw)
    ref = depth_attention_naive(query, sources, gain, **kw)
    torch.testing.assert_close(merged, ref, atol=1e-12, rtol=1e-12)
    cot = torch.randn_like(ref)
    inputs = [query, *sources] + ([gain] if gain is not None else [])
    for a, b in zip(grads(merged, inputs, cot), grads(ref, inputs, cot)):
        torch.testing.assert_close(a, b, atol=1e-11, rtol=1e-11)


@pytest.mark.parametrize("heads,score", [(1, "softmax"), (3, "softmax"), (2, "sigmoid")])
def test_merge_partial_gradcheck_fp64(heads, score):
    g = torch.Generator().manual_seed(heads)
    dt = torch.float64
    o1, partial = (torch.randn(2, 3, 12, generator=g, dtype=dt).requires_grad_() for _ in range(2))
    lse1 = torch.randn(2, 3, heads, generator=g, dtype=dt).requires_grad_(score == "softmax")
    query, gain = torch.randn(12, generator=g, dtype=dt), 1 + 0.3 * torch.randn(12, generator=g, dtype=dt)
    inputs = (o1, lse1, partial, query.requires_grad_(), gain.requires_grad_())
    assert torch.autograd.gradcheck(
        lambda *t: merge_partial(*t, heads=heads, score=score), inputs
    )


def merge_inputs(dtype, heads, seed=3):
    g = torch.Generator().manual_seed(seed)
    o1, partial = (torch.randn(2, 3, 12, generator=g).to(dtype).requires_grad_() for _ in range(2))
    lse1 = torch.randn(2, 3, heads, generator=g).requires_grad_()
    query = (0.5 * torch.randn(12, generator=g)).to(dtype).requires_grad_()
    gain = (1 + 0.3 * torch.randn(12, generator=g)).to(dtype).requires_grad_()
    weight = (1 + 0.3 * torch.randn(12, generator=g)).to(dtype).requires_grad_()
    return o1, lse1, partial, query, gain, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_merge_norm_forward_is_the_norm_of_the_merge_bit_for_bit(dtype, score):
    o1, lse1, partial, query, gain, weight = merge_inputs(dtype, heads=3)
    kw = dict(heads=3, score=score)
    fused = merge_norm(o1, lse1, partial, query, gain, weight, 1e-5, **kw)
    separate = rms_norm(merge_partial(o1, lse1, partial, query, gain, **kw), weight, 1e-5)
    assert fused.dtype == dtype and torch.equal(fused, separate)


@pytest.mark.parametrize("heads,score", [(1, "softmax"), (3, "softmax"), (2, "sigmoid")])
def test_merge_norm_gradients(heads, score):
    inputs = tuple(t.detach().double().requires_grad_() for t in merge_inputs(torch.float32, heads))
    kw = dict(heads=heads, score=score)
    assert torch.autograd.gradcheck(lambda *t: merge_norm(*t, 1e-5, **kw), inputs)
    fused = merge_norm(*inputs, 1e-5, **kw)
    o1, lse1, partial, query, gain, weight = inputs
    separate = rms_norm(merge_partial(o1, lse1, partial, query, gain, **kw), weight, 1e-5)
    cot = torch.randn_like(fused)
    for a, b in zip(grads(fused, inputs, cot), grads(separate, inputs, cot)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_phase_one_with_the_first_norm_fused_is_bit_for_bit(dtype, score):
    query, gain, sources = make(12, 3, (2, 5), dtype)
    weight = 1 + 0.3 * torch.randn(12).to(dtype)
    qs, ks = torch.stack([query, -query]), torch.stack([gain, gain])
    fused, _ = depth_attention_multi(qs, sources, ks, heads=2, score=score, norm=(weight, 1e-5))
    plain, _ = depth_attention_multi(qs, sources, ks, heads=2, score=score)
    assert torch.equal(fused[0], rms_norm(plain[0], weight, 1e-5)) and torch.equal(fused[1], plain[1])


@pytest.mark.parametrize("heads,score", [(1, "softmax"), (3, "softmax"), (2, "sigmoid")])
def test_phase_one_with_the_first_norm_fused_gradients(heads, score):
    query, gain, sources = make(12, 3, (2, 3), torch.float64, seed=heads)
    weight = (1 + 0.3 * torch.randn(12, dtype=torch.float64)).requires_grad_()
    qs = torch.stack([query, -query]).detach().requires_grad_()
    ks = torch.stack([gain, 2 * gain]).detach().requires_grad_()
    inputs = (qs, ks, weight, *sources)
    kw = dict(heads=heads, score=score)

    def fused(q, k, w, *src):
        outs, lse = depth_attention_multi(q, list(src), k, norm=(w, 1e-5), **kw)
        return (*outs, lse) if score == "softmax" else outs

    def separate(q, k, w, *src):
        outs, lse = depth_attention_multi(q, list(src), k, **kw)
        outs = (rms_norm(outs[0], w, 1e-5), *outs[1:])
        return (*outs, lse) if score == "softmax" else outs

    assert torch.autograd.gradcheck(fused, inputs)
    a_out, b_out = fused(*inputs), separate(*inputs)
    cots = [torch.randn_like(t) for t in a_out]
    for a, b in zip(grads(a_out, inputs, cots), grads(b_out, inputs, cots)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


def test_cached_key_statistics_must_match_the_sources():
    query, gain, sources = make(12, 3, (4,), torch.float32)
    with pytest.raises(ValueError, match="inv_rms has 1 entries for 3 sources"):
        depth_attention_multi(query[None], sources, gain[None], inv_rms=[None])


def test_phase_one_outputs_beyond_the_first_are_freed_after_their_merge():
    """The second query's phase-1 output lives only until its merge has run: neither phase 1
    nor the merge keeps it for backward."""
    import gc
    import weakref

    query, gain, sources = make(12, 4, (3, 2), torch.float32)
    outs, lse = depth_attention_multi(torch.stack([query, 2 * query]), sources[:-1], torch.stack([gain, gain]))
    probe = weakref.ref(outs[1])
    merged = merge_norm(outs[1], lse[1], sources[-1], 2 * query, gain, None, 1e-6)
    loss = (outs[0] ** 2).sum() + (merged ** 2).sum()
    del outs
    gc.collect()
    assert probe() is None
    loss.backward()  # and backward still has all it needs
    assert all(s.grad is not None for s in sources) and query.grad is not None


def drive(stream, e, weights):
    state = stream.init(e)
    reads = []
    for i, w in enumerate(weights):
        x = stream.read(state, i)
        reads.append(x)
        state = stream.write(state, i, torch.tanh(x @ w))
    return reads, stream.output(state)


@pytest.mark.parametrize("kind", ["block", "delta"])
@pytest.mark.parametrize("m,s,heads", [(7, 3, 1), (8, 4, 2), (6, 1, 3), (5, 5, 1), (9, 2, 6)])
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["fp32", "fp64"])
def test_two_phase_stream_matches_per_sublayer_naive(kind, m, s, heads, dtype, tol):
    assert_stream_matches_naive(kind, dict(block_size=s, heads=heads, backend="torch"), m, dtype, tol)


@pytest.mark.parametrize("kind,options", [
    ("block", dict(block_size=3, heads=2, two_phase=False)),
    ("delta", dict(block_size=2, heads=3, two_phase=False)),
    ("full", dict(heads=2)),
    ("full", dict(heads=1, score="sigmoid")),
])
def test_per_read_torch_path_with_cached_key_stats_matches_naive(kind, options):
    """Every source normalized once and read by many sublayers: the cached inverse RMS carries
    the gradient of all of its reads."""
    assert_stream_matches_naive(kind, dict(options, backend="torch"), 7, torch.float64, 1e-12)


def stream_pair(kind, options, m, dtype, seed, lead=(2, 3), dim=12):
    """``(fast, ref, weights, e)``: the stream on the default backend and its per-sublayer naive
    twin with the same parameters (moved off the zero init, so that every path carries signal),
    ``m`` sublayer weights ``[dim, dim]`` and an embedding ``[*lead, dim]``."""
    g = torch.Generator().manual_seed(seed)
    fast = build_stream(kind, dim=dim, num_sublayers=m, **options).to(dtype)
    ref_options = {k: v for k, v in options.items() if k not in ("two_phase", "backend")}
    if kind != "full":
        ref_options["two_phase"] = False
    ref = build_stream(kind, dim=dim, num_sublayers=m, backend="naive", **ref_options).to(dtype)
    with torch.no_grad():
        for p in fast.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=dtype))
    ref.load_state_dict(fast.state_dict())
    weights = [torch.randn(dim, dim, generator=g, dtype=dtype) / dim**0.5 for _ in range(m)]
    return fast, ref, weights, torch.randn(*lead, dim, generator=g, dtype=dtype)


def assert_stream_matches_naive(kind, options, m, dtype, tol):
    fast, ref, weights, e = stream_pair(kind, options, m, dtype, seed=m * 10 + options.get("block_size", 0))
    outs = []
    for stream in (fast, ref):
        e_ = e.clone().requires_grad_()
        reads, out = drive(stream, e_, weights)
        loss = sum((r * (k + 1)).sum() for k, r in enumerate(reads)) + (out**2).sum()
        params = list(stream.parameters())
        outs.append((reads, out, torch.autograd.grad(loss, [e_, *params])))
    (f_reads, f_out, f_grads), (r_reads, r_out, r_grads) = outs
    for a, b in zip(f_reads + [f_out], r_reads + [r_out]):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)
    for a, b in zip(f_grads, r_grads):
        assert_close_to_scale(a, b, tol)


def test_two_phase_is_used_and_reads_completed_blocks_once(monkeypatch):
    import attnres.streams.attnres as mod

    calls = []
    real = mod.multi_query_attention

    def counting(queries, sources, gains=None, **kw):
        calls.append((queries.shape[0], len(sources)))
        return real(queries, sources, gains, **kw)

    normalized = []
    real_inverse_rms = mod.inverse_rms

    def counting_inverse_rms(v, eps):
        normalized.append(v)
        return real_inverse_rms(v, eps)

    monkeypatch.setattr(mod, "multi_query_attention", counting)
    monkeypatch.setattr(mod, "inverse_rms", counting_inverse_rms)
    stream = build_stream("block", dim=8, num_sublayers=7, block_size=3)
    drive(stream, torch.randn(2, 8), [torch.randn(8, 8) for _ in range(7)])
    # blocks open at sublayers 0, 3, 6; the last also holds the output query (virtual sublayer 7)
    assert calls == [(3, 1), (3, 2), (2, 3)]
    # six visits of completed sources, but each of e, B_0, B_1 is normalized once
    assert len(normalized) == 3


# a few tokens (decoding: stacked weighted sums) and more than FEW_TOKENS (one op per source)
TOKENS = [pytest.param((2, 3), id="6-tokens"), pytest.param((1, 70), id="70-tokens")]


@pytest.mark.parametrize("lead", TOKENS)
@pytest.mark.parametrize("heads,score,key_norm", [
    (1, "softmax", True), (4, "softmax", True), (2, "sigmoid", True), (3, "softmax", False),
])
@pytest.mark.parametrize("kernels", [False, pytest.param(True, marks=needs_kernels)], ids=["torch", "cpu-kernels"])
def test_scored_mix_equals_multi_query(heads, score, key_norm, lead, kernels):
    """Each source scored once against all five queries, then two of them gathered: the same
    outputs and log-sum-exp as phase 1 computing those two queries' logits itself."""
    g = torch.Generator().manual_seed(heads)
    dt = torch.float64
    sources = [torch.randn(*lead, 12, generator=g, dtype=dt) * (1 + j) for j in range(4)]
    qs = torch.randn(5, 12, generator=g, dtype=dt)
    ks = (1 + 0.2 * torch.randn(5, 12, generator=g, dtype=dt)) if key_norm else None
    kw = dict(heads=heads, score=score, key_norm=key_norm)
    scores = [source_scores(v, qs, ks, heads=heads, key_norm=key_norm) for v in sources]
    assert scores[0].shape == (*lead, 5, heads)
    weight = 1 + 0.1 * torch.randn(12, generator=g, dtype=dt)
    outs, lse = mix_scored([sc[..., 2:4, :] for sc in scores], sources, score=score, norm=(weight, 1e-5),
                           kernels=kernels)
    ref, ref_lse = depth_attention_multi(qs[2:4], sources, None if ks is None else ks[2:4], **kw)
    torch.testing.assert_close(outs[0], rms_norm(ref[0], weight, 1e-5), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(outs[1], ref[1], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="3 score tensors for 4 sources"):
        mix_scored(scores[:3], sources)


@pytest.mark.parametrize("kind,m,options", [
    ("block", 7, dict(block_size=3)),
    ("block", 9, dict(block_size=2, heads=3)),
    ("block", 6, dict(block_size=1, score="sigmoid")),
    ("block", 5, dict(block_size=5, key_norm=False)),
    ("delta", 7, dict(block_size=2, heads=2)),
])
@pytest.mark.parametrize("lead", TOKENS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)], ids=["fp32", "fp64"])
@pytest.mark.parametrize("backend", ["torch", pytest.param("cpu", marks=needs_kernels)])
def test_inference_path_matches_naive(kind, m, options, dtype, tol, lead, backend):
    """With autograd off, Block and Delta score each completed block once (the inference
    path): every read and the output equal the per-sublayer reference."""
    fast, ref, weights, e = stream_pair(kind, dict(options, backend=backend), m, dtype, seed=m, lead=lead)
    with torch.no_grad():
        state = fast.init(e)
        routed = state.routed if kind == "delta" else state
        assert routed.scores and len(routed.scores) == len(routed.blocks)  # the inference path is taken
        f_reads, f_out = drive(fast, e, weights)
        r_reads, r_out = drive(ref, e, weights)
    for a, b in zip(f_reads + [f_out], r_reads + [r_out]):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def test_inference_scores_each_source_once(monkeypatch):
    import attnres.streams.attnres as mod

    scored, phase_one = [], []
    real_scores, real_multi = mod.source_scores, mod.multi_query_attention

    def counting_scores(v, queries, gains=None, **kw):
        scored.append(queries.shape[0])
        return real_scores(v, queries, gains, **kw)

    def counting_multi(queries, sources, gains=None, **kw):
        phase_one.append(len(sources))
        return real_multi(queries, sources, gains, **kw)

    monkeypatch.setattr(mod, "source_scores", counting_scores)
    monkeypatch.setattr(mod, "multi_query_attention", counting_multi)
    stream = build_stream("block", dim=8, num_sublayers=7, block_size=3)
    weights = [torch.randn(8, 8) for _ in range(7)]
    with torch.no_grad():
        drive(stream, torch.randn(2, 8), weights)
    # e, B_0, B_1 scored once each, against every site from the block they open to the output
    assert scored == [8, 5, 2] and phase_one == []
    scored.clear()
    drive(stream, torch.randn(2, 8), weights)  # autograd on: the differentiable phase 1
    assert scored == [] and phase_one == [1, 2, 3]
    per_read = build_stream("block", dim=8, num_sublayers=7, block_size=3, two_phase=False)
    with torch.no_grad():  # nothing reads scores when every read routes on its own
        drive(per_read, torch.randn(2, 8), weights)
    assert scored == []


def test_backend_errors_and_single_warning():
    q = torch.zeros(2, 8)  # a per-token query
    sources = [torch.randn(2, 8)]
    with pytest.raises(RuntimeError, match="per-token queries"):
        depth_attention(q, sources, backend="torch")
    with pytest.raises(ValueError, match="backend='cuda' is not one of"):
        depth_attention(torch.zeros(8), sources, backend="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # the module, not the function attnres.ops re-exports under the same name
        importlib.import_module("attnres.ops.depth_attention")._warned.clear()
        depth_attention(q, sources)
        depth_attention(q, sources)
    assert len([w for w in caught if "per-token" in str(w.message)]) == 1
    with pytest.raises(ValueError, match="backend='fast' is not one of"):
        build_stream("full", dim=8, num_sublayers=2, backend="fast")
