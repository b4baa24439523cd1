"""Every registered backend against the naive reference through whole passes: each stream
design's two-phase and per-read paths, inference that scores each source once, and a decode
pass's read (the shared cases: ``backend_cases.py``)."""

import pytest
import torch

from attnres import build_stream, ops
from attnres.ops import BACKENDS, rms_norm
from tests.backend_cases import (
    DECODING,
    DTYPES,
    EVERY,
    OTHERS,
    SCORING,
    Norm,
    assert_close_to_scale,
    drive,
    stream_pair,
    use,
)


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
