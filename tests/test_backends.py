"""Every registered backend against the naive reference: forward and every gradient.

The tests parametrize over ``ops.BACKENDS``, so a new backend is tested here without a new test;
one that cannot serve a case on this machine (its declared devices, dtypes or ablations, a
missing compiler) is skipped, saying why.
"""

import gc
import warnings
import weakref

import pytest
import torch

from attnres import build_stream, ops
from attnres.ops import (
    BACKENDS,
    BackendOps,
    Request,
    depth_attention,
    depth_attention_naive,
    rms_norm,
)
from attnres.ops import registry

OTHERS = [name for name in BACKENDS if name != registry.REFERENCE]  # tested against naive
EVERY = list(BACKENDS)  # naive included, where a test checks an invariant of its own
SCORING = [name for name, b in BACKENDS.items() if b.scores_ahead]
DECODING = [name for name, b in BACKENDS.items() if b.decodes and name != registry.REFERENCE]
DTYPES = [pytest.param(torch.float32, 1e-5, id="fp32"), pytest.param(torch.float64, 1e-12, id="fp64")]

SHAPES = [
    pytest.param(1, 6, 1, (5,), id="H1-D6-N1"),
    pytest.param(1, 41, 4, (2, 3), id="H1-D41-N4"),  # the kernels' sums by 4 vectors, 1 vector, 1 number
    pytest.param(2, 10, 3, (7,), id="H2-D10-N3"),
    pytest.param(4, 172, 9, (2, 5), id="H4-D172-N9"),  # heads of 43 numbers, from offsets past 0
    pytest.param(8, 96, 5, (3, 4), id="H8-D96-N5"),
    # heads of 96 and 80 numbers: the kernels' 64-byte vectors where the build has AVX-512 (a head
    # of a multiple of 16 fp32 numbers), four vectors then two, and four then one
    pytest.param(1, 96, 3, (4,), id="H1-D96-N3"),
    pytest.param(2, 160, 4, (3,), id="H2-D160-N4"),
]


class Norm:
    """A read's pre-norm as the backends take it: a gain (or None) and an epsilon."""

    def __init__(self, weight, eps=1e-5):
        self.weight, self.eps = weight, eps


def use(name, dtype=torch.float32, score="softmax", key_norm=True):
    """The functions of backend ``name``, or a skip saying why it cannot serve these inputs here."""
    problem = BACKENDS[name].problem(Request("cpu", dtype, score, key_norm))
    if problem:
        pytest.skip(f"backend {name!r} cannot run this case here: {problem}")
    return ops.backend(name)


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


def assert_grads_close(fast, ref, tol):
    for a, b in zip(fast, ref):
        assert (a is None) == (b is None)
        if a is not None:
            assert_close_to_scale(a, b, tol)


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


# -- inference: each source scored once -----------------------------------------------------------

# a few tokens (decoding: stacked weighted sums) and more than FEW_TOKENS (one op per source)
TOKENS = [pytest.param((2, 3), id="6-tokens"), pytest.param((1, 70), id="70-tokens")]


@pytest.mark.parametrize("lead", TOKENS)
@pytest.mark.parametrize("heads,score,key_norm", [
    (1, "softmax", True), (4, "softmax", True), (2, "sigmoid", True), (3, "softmax", False),
])
@pytest.mark.parametrize("backend", SCORING)
def test_attend_scored_equals_attend(heads, score, key_norm, lead, backend):
    """Each source scored once against all five queries, then two of them gathered: the same
    outputs and log-sum-exp as the reference computing those two queries' logits itself."""
    fns = use(backend, torch.float64, score, key_norm)
    g = torch.Generator().manual_seed(heads)
    dt = torch.float64
    sources = [torch.randn(*lead, 12, generator=g, dtype=dt) * (1 + j) for j in range(4)]
    qs = torch.randn(5, 12, generator=g, dtype=dt)
    ks = (1 + 0.2 * torch.randn(5, 12, generator=g, dtype=dt)) if key_norm else None
    kw = dict(heads=heads, score=score, key_norm=key_norm)
    scores = [fns.score_source(v, qs, ks, heads=heads, key_norm=key_norm) for v in sources]
    assert scores[0].shape == (*lead, 5, heads)
    weight = 1 + 0.1 * torch.randn(12, generator=g, dtype=dt)
    outs, lse = fns.attend_scored([sc[..., 2:4, :] for sc in scores], sources, score=score, norm=Norm(weight))
    ref, ref_lse = ops.backend("naive").attend(qs[2:4], sources, None if ks is None else ks[2:4], **kw)
    torch.testing.assert_close(outs[0], rms_norm(ref[0], weight, 1e-5), atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(outs[1], ref[1], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=1e-12)
    with pytest.raises(ValueError, match="3 score tensors for 4 sources"):
        fns.attend_scored(scores[:3], sources)


# -- streams on every backend ---------------------------------------------------------------------

def drive(stream, e, weights):
    state = stream.init(e)
    reads = []
    for i, w in enumerate(weights):
        x = stream.read(state, i)
        reads.append(x)
        state = stream.write(state, i, torch.tanh(x @ w))
    return reads, stream.output(state)


def stream_pair(kind, options, m, dtype, seed, lead=(2, 3), dim=12):
    """``(fast, ref, weights, e)``: the stream as ``options`` say and its per-sublayer naive
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


@pytest.mark.parametrize("kind", ["block", "delta"])
@pytest.mark.parametrize("m,s,heads", [(7, 3, 1), (8, 4, 2), (6, 1, 3), (5, 5, 1), (9, 2, 6)])
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("backend", EVERY)
def test_two_phase_stream_matches_per_sublayer_naive(kind, m, s, heads, dtype, tol, backend):
    use(backend, dtype)
    assert_stream_matches_naive(kind, dict(block_size=s, heads=heads, backend=backend), m, dtype, tol)


@pytest.mark.parametrize("kind,options", [
    ("block", dict(block_size=3, heads=2, two_phase=False)),
    ("delta", dict(block_size=2, heads=3, two_phase=False)),
    ("full", dict(heads=2)),
    ("full", dict(heads=1, score="sigmoid")),
])
@pytest.mark.parametrize("backend", OTHERS)
def test_per_read_stream_with_prepared_sources_matches_naive(kind, options, backend):
    """Every source prepared once and read by many sublayers: what the backend prepared carries
    the gradient of all of its reads."""
    use(backend, torch.float64, options.get("score", "softmax"))
    assert_stream_matches_naive(kind, dict(options, backend=backend), 7, torch.float64, 1e-12)


@pytest.mark.parametrize("backend", EVERY)
def test_two_phase_is_used_and_prepares_each_source_once(monkeypatch, backend):
    fns = use(backend)
    calls, prepared = [], []
    real_attend, real_prepare = fns.attend, fns.prepare

    def counting_attend(queries, sources, gains=None, **kw):
        calls.append((queries.shape[0], len(sources)))
        return real_attend(queries, sources, gains, **kw)

    def counting_prepare(v, **kw):
        prepared.append(v)
        return real_prepare(v, **kw)

    monkeypatch.setattr(fns, "attend", counting_attend)
    monkeypatch.setattr(fns, "prepare", counting_prepare)
    stream = build_stream("block", dim=8, num_sublayers=7, block_size=3, backend=backend)
    drive(stream, torch.randn(2, 8), [torch.randn(8, 8) for _ in range(7)])
    # blocks open at sublayers 0, 3, 6; the last also holds the output query (virtual sublayer 7)
    assert calls == [(3, 1), (3, 2), (2, 3)]
    # six visits of completed sources, but each of e, B_0, B_1 is prepared once
    assert len(prepared) == 3


@pytest.mark.parametrize("kind,m,options", [
    ("block", 7, dict(block_size=3)),
    ("block", 9, dict(block_size=2, heads=3)),
    ("block", 6, dict(block_size=1, score="sigmoid")),
    ("block", 5, dict(block_size=5, key_norm=False)),
    ("delta", 7, dict(block_size=2, heads=2)),
])
@pytest.mark.parametrize("lead", TOKENS)
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("backend", EVERY)
def test_inference_path_matches_naive(kind, m, options, dtype, tol, lead, backend):
    """With autograd off, Block and Delta score each completed block once on a backend that
    scores ahead (the inference path): every read and the output equal the per-sublayer
    reference."""
    use(backend, dtype, options.get("score", "softmax"), options.get("key_norm", True))
    fast, ref, weights, e = stream_pair(kind, dict(options, backend=backend), m, dtype, seed=m, lead=lead)
    with torch.no_grad():
        state = fast.init(e)
        routed = state.routed if kind == "delta" else state
        if BACKENDS[backend].scores_ahead:  # the inference path is taken: every completed source scored
            assert routed.memo.scores is not None and len(routed.memo.scores) == len(routed.blocks) > 0
        else:
            assert routed.memo.scores is None
        f_reads, f_out = drive(fast, e, weights)
        r_reads, r_out = drive(ref, e, weights)
    for a, b in zip(f_reads + [f_out], r_reads + [r_out]):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@pytest.mark.parametrize("backend", SCORING)
def test_inference_scores_each_source_once(monkeypatch, backend):
    fns = use(backend)
    scored, phase_one = [], []
    real_scores, real_attend = fns.score_source, fns.attend

    def counting_scores(v, queries, gains=None, **kw):
        scored.append(queries.shape[0])
        return real_scores(v, queries, gains, **kw)

    def counting_attend(queries, sources, gains=None, **kw):
        phase_one.append(len(sources))
        return real_attend(queries, sources, gains, **kw)

    monkeypatch.setattr(fns, "score_source", counting_scores)
    monkeypatch.setattr(fns, "attend", counting_attend)
    stream = build_stream("block", dim=8, num_sublayers=7, block_size=3, backend=backend)
    weights = [torch.randn(8, 8) for _ in range(7)]
    with torch.no_grad():
        drive(stream, torch.randn(2, 8), weights)
    # e, B_0, B_1 scored once each, against every site from the block they open to the output
    assert scored == [8, 5, 2] and phase_one == []
    scored.clear()
    drive(stream, torch.randn(2, 8), weights)  # autograd on: the differentiable phase 1
    # a backend that reads logits in training scores each source once here too, and phase 1 reads them
    assert scored == ([8, 5, 2] if BACKENDS[backend].scores_in_training else []) and phase_one == [1, 2, 3]
    scored.clear()
    per_read = build_stream("block", dim=8, num_sublayers=7, block_size=3, two_phase=False, backend=backend)
    with torch.no_grad():  # nothing reads scores when every read routes on its own
        drive(per_read, torch.randn(2, 8), weights)
    assert scored == []


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


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("score,key_norm", [("softmax", True), ("sigmoid", True), ("softmax", False)])
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("gated", [False, True], ids=["", "gated"])
@pytest.mark.parametrize("norm", ["none", "gain", "no-gain"])
@pytest.mark.parametrize("backend", DECODING)
def test_decode_read_matches_naive(backend, dtype, score, key_norm, heads, gated, norm):
    """A decode pass's read (one call over the buffer's first ``count`` sources, Delta's
    ``base + gate * mix``, the read's norm) against the reference: every count from one source
    to the buffer's capacity less one, two sequences of one position; D = 172 (heads of 172 or
    43 numbers: the kernels' sums by four vectors, one vector and single numbers)."""
    fns = use(backend, dtype, score, key_norm)
    g = torch.Generator().manual_seed(heads + 10 * gated)
    D = 172
    buffer = torch.randn(6, 2, 1, D, generator=g, dtype=dtype) * torch.arange(1, 7, dtype=dtype).view(6, 1, 1, 1)
    query = torch.randn(D, generator=g, dtype=dtype) * (D // heads) ** -0.5  # logits of order one
    base = torch.randn(2, 1, D, generator=g, dtype=dtype) if gated else None
    weight = 1 + 0.3 * torch.randn(D, generator=g, dtype=dtype)
    read_norm = {"none": None, "gain": Norm(weight), "no-gain": Norm(None)}[norm]
    tol = dict(atol=1e-12, rtol=1e-12) if dtype == torch.float64 else dict(atol=2e-6, rtol=2e-6)
    for count in range(1, 6):
        args = dict(heads=heads, eps=1e-6, score=score, key_norm=key_norm, base=base, gate=0.7, norm=read_norm)
        with torch.no_grad():
            got = fns.decode_read(buffer, count, query, **args)
        want = ops.backend("naive").decode_read(buffer, count, query, **args)
        assert got.dtype == dtype and got.shape == (2, 1, D)
        torch.testing.assert_close(got, want, **tol)


# -- the multi-stream designs' operations (HC, mHC, GR) ------------------------------------------

STREAM_SHAPES = [
    pytest.param(1, 7, (2,), id="n1-D7"),
    pytest.param(2, 5, (3, 1), id="n2-D5"),
    pytest.param(3, 10, (17,), id="n3-D10"),
    pytest.param(4, 96, (2, 9), id="n4-D96"),
    pytest.param(4, 41, (3,), id="n4-D41"),
    pytest.param(5, 33, (4,), id="n5-D33"),
    pytest.param(8, 20, (2,), id="n8-D20"),
]


def stream_inputs(n, dim, lead, dtype, seed=0, expanded=False):
    """``(leaf, inputs)``: the streams ``H`` ``[..., n, D]`` (with ``expanded``, the embedding
    broadcast to every stream, as a stream's init makes it; ``leaf`` is what its gradient goes
    to) and every other operand."""
    g = torch.Generator().manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()

    leaf = draw(*lead, dim) if expanded else draw(*lead, n, dim)
    H = leaf.unsqueeze(-2).expand(*lead, n, dim) if expanded else leaf
    return leaf, dict(H=H, w=draw(*lead, n), A=draw(*lead, n, n), b=draw(*lead, n), v=draw(*lead, dim),
                      z=draw(*lead, n, dim), g=draw(dim), hidden=draw(*lead, 3), up=draw(n * dim, 3))


#: each operation: how it is called on a backend's operations, and the operands besides H its
#: gradients go to
STREAM_OPS = {
    "mix": (lambda o, x: o.stream_mix(x["H"], x["w"]), "w"),
    "update": (lambda o, x: o.stream_update(x["H"], x["A"], x["b"], x["v"]), "Abv"),
    "update-transposed": (lambda o, x: o.stream_update(x["H"], x["A"], x["b"], x["v"], transposed=True), "Abv"),
    "update-identity": (lambda o, x: o.stream_update(x["H"], None, x["b"], x["v"]), "bv"),
    "gated": (lambda o, x: o.gated_mix(x["H"], x["z"]), "z"),
    "gated-lowrank": (lambda o, x: o.gated_mix_lowrank(x["H"], x["hidden"], x["up"]), ("hidden", "up")),
    "rms-norm": (lambda o, x: o.rms_norm(x["H"], x["g"], 1e-5), "g"),
}


@pytest.mark.parametrize("op", list(STREAM_OPS))
@pytest.mark.parametrize("expanded", [False, True], ids=["", "expanded"])
@pytest.mark.parametrize("n,dim,lead", STREAM_SHAPES)
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("backend", OTHERS)
def test_stream_ops_match_naive(op, expanded, n, dim, lead, dtype, tol, backend):
    use(backend, dtype)
    leaf, x = stream_inputs(n, dim, lead, dtype, expanded=expanded)
    call, which = STREAM_OPS[op]
    inputs = [leaf] + [x[name] for name in which]
    fast, ref = call(ops.backend(backend), x), call(ops.backend("naive"), x)
    torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)
    cot = torch.randn_like(ref)
    assert_grads_close(grads(fast, inputs, cot), grads(ref, inputs, cot), 10 * tol)


@pytest.mark.parametrize("op", list(STREAM_OPS))
@pytest.mark.parametrize("backend", EVERY)
def test_stream_ops_gradcheck_fp64(op, backend):
    use(backend, torch.float64)
    _, x = stream_inputs(3, 6, (2, 2), torch.float64, seed=1)
    call, which = STREAM_OPS[op]
    names = ["H", *which]
    assert torch.autograd.gradcheck(lambda *given: call(ops.backend(backend), dict(x, **dict(zip(names, given)))),
                                    [x[name] for name in names])


@pytest.mark.parametrize("op", [*STREAM_OPS, "sinkhorn"])
@pytest.mark.parametrize("backend", OTHERS)
def test_stream_ops_take_a_gradient_that_is_not_contiguous(op, backend):
    """The gradient of ``(out * c).sum()`` with ``c`` of the output's last two dims is ``c``
    expanded over the output (stride 0): a kernel reads a contiguous copy of it, which must live until the kernel
    has read it."""
    use(backend)
    leaf, x = stream_inputs(3, 20, (256,), torch.float32)
    if op == "sinkhorn":
        inputs, call = [x["A"]], lambda o, x: o.sinkhorn(x["A"], 5)
    else:
        call, which = STREAM_OPS[op]
        inputs = [leaf] + [x[name] for name in which]
    c = torch.randn(call(ops.backend("naive"), x).shape[-2:], generator=torch.Generator().manual_seed(1))
    got = torch.autograd.grad((call(ops.backend(backend), x) * c).sum(), inputs)
    want = torch.autograd.grad((call(ops.backend("naive"), x) * c).sum(), inputs)
    assert_grads_close(got, want, 1e-4)


@pytest.mark.parametrize("backend", OTHERS)
def test_stream_ops_leave_frozen_inputs_without_gradient(backend):
    use(backend)
    _, x = stream_inputs(3, 8, (5,), torch.float32)
    x["A"].requires_grad_(False)
    x["v"].requires_grad_(False)
    ops.backend(backend).stream_update(x["H"], x["A"], x["b"], x["v"]).sum().backward()
    assert x["A"].grad is None and x["v"].grad is None and x["H"].grad is not None and x["b"].grad is not None
    x["z"].requires_grad_(False)
    ops.backend(backend).gated_mix(x["H"], x["z"]).sum().backward()
    assert x["z"].grad is None
    x["up"].requires_grad_(False)
    ops.backend(backend).gated_mix_lowrank(x["H"], x["hidden"], x["up"]).sum().backward()
    assert x["up"].grad is None and x["hidden"].grad is not None


SINKHORN = [
    pytest.param(1, 20, (3,), id="n1"),
    pytest.param(2, 1, (4,), id="n2-1it"),
    pytest.param(3, 7, (17,), id="n3-7it"),
    pytest.param(4, 20, (2, 9), id="n4-20it"),
    pytest.param(5, 3, (6,), id="n5-3it"),
    pytest.param(8, 4, (3,), id="n8-4it"),
]


@pytest.mark.parametrize("n,iterations,lead", SINKHORN)
@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("backend", OTHERS)
def test_sinkhorn_matches_naive_through_its_iterations(n, iterations, lead, dtype, tol, backend):
    """The backward is autograd's through every iteration (not the implicit gradient at
    convergence): after few iterations, far from doubly stochastic, the two would differ."""
    use(backend, dtype)
    g = torch.Generator().manual_seed(n)
    logits = (3 * torch.randn(*lead, n, n, generator=g, dtype=dtype)).requires_grad_()
    fast = ops.backend(backend).sinkhorn(logits, iterations)
    ref = ops.sinkhorn(logits, iterations)
    torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)
    cot = torch.randn_like(ref)
    assert_grads_close(grads(fast, [logits], cot), grads(ref, [logits], cot), 10 * tol)


@pytest.mark.parametrize("backend", OTHERS)
def test_sinkhorn_with_tied_maxima_and_a_small_line(backend):
    """Tied maxima share the shift's gradient as ``amax`` does; a row of exp(-30) has a large
    reciprocal."""
    use(backend)
    logits = torch.tensor([[[1.0, 1.0, 0.0], [0.5, 1.0, -1.0], [-30.0, -30.0, -30.0]],
                           [[2.0, 2.0, 2.0], [2.0, 2.0, 2.0], [0.0, 1.0, 2.0]]], requires_grad=True)
    fast = ops.backend(backend).sinkhorn(logits, 5)
    ref = ops.sinkhorn(logits, 5)
    torch.testing.assert_close(fast, ref, atol=1e-6, rtol=1e-6)
    cot = torch.randn_like(ref)
    assert_grads_close(grads(fast, [logits], cot), grads(ref, [logits], cot), 1e-5)


@pytest.mark.parametrize("backend", EVERY)
def test_sinkhorn_gradcheck_fp64(backend):
    use(backend, torch.float64)
    logits = torch.randn(3, 4, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(2)).requires_grad_()
    assert torch.autograd.gradcheck(lambda x: ops.backend(backend).sinkhorn(x, 6), (logits,))


@pytest.mark.parametrize("iterations", [0, -1, 2.0, True])
@pytest.mark.parametrize("backend", EVERY)
def test_sinkhorn_refuses_a_bad_number_of_iterations(iterations, backend):
    use(backend)
    with pytest.raises(ValueError, match=f"iterations={iterations!r} must be an integer >= 1"):
        ops.backend(backend).sinkhorn(torch.zeros(2, 3, 3), iterations)


@pytest.mark.parametrize("dtype,tol", DTYPES)
@pytest.mark.parametrize("shape,cols,width", [((5, 12), 1, 1), ((3, 4, 12), 5, 5), ((2, 1, 384), 24, 24),
                                              ((3, 40, 96), 4, 24), ((2, 5, 96), 20, 24)])
def test_rms_norm_project_is_the_norm_then_the_product(dtype, tol, shape, cols, width):
    """``width > cols``: the weight is a column slice of a wider matrix, as mHC passes its
    projections (a view that is not contiguous)."""
    g = torch.Generator().manual_seed(cols)
    x = (3 * torch.randn(*shape, generator=g, dtype=dtype)).requires_grad_()
    full = torch.randn(shape[-1], width, generator=g, dtype=dtype).requires_grad_()
    W = full[:, width - cols:]
    fast = ops.rms_norm_project(x, W, 1e-5)
    ref = rms_norm(x, eps=1e-5) @ W
    torch.testing.assert_close(fast, ref, atol=tol, rtol=tol)
    cot = torch.randn_like(ref)
    assert_grads_close(grads(fast, [x, full], cot), grads(ref, [x, full], cot), 10 * tol)
    if dtype == torch.float64 and shape[-2] < 10:
        assert torch.autograd.gradcheck(lambda x, W: ops.rms_norm_project(x, W, 1e-5), (x, W))
