"""Deferred source gradients (``ops.source_ledger``): the ``cpu`` backend's ``source_grad``
against its naive twin, and streams trained with the ledger against the same streams
accumulating every read's term (``defer_source_grads=False``) and against the naive backend."""

import pytest
import torch

from attnres import build_stream
from attnres.ops import backend
from attnres.ops.backends import cpu_build
from attnres.ops.backends.common import inverse_rms
from attnres.ops.source_ledger import DeferredRead, SourceLedger

needs_kernels = pytest.mark.skipif(cpu_build.build_problem() is not None,
                                   reason=f"CPU kernels unavailable: {cpu_build.build_problem()}")


def deferred_reads(g, dt, lead, D, heads, query_counts, missing=()):
    """Random ``DeferredRead``s, one per entry of ``query_counts`` (its number of queries); the
    query numbered ``k`` over all reads gets no upstream gradient when ``k in missing``."""
    reads, k = [], 0
    for S in query_counts:
        grads = []
        for _ in range(S):
            grads.append(None if k in missing else torch.randn(*lead, D, generator=g, dtype=dt))
            k += 1
        reads.append(DeferredRead(torch.randn(S, D, generator=g, dtype=dt), torch.randn(S, *lead, heads, generator=g, dtype=dt),
                                  torch.randn(S, *lead, heads, generator=g, dtype=dt), tuple(grads)))
    return reads


@needs_kernels
@pytest.mark.parametrize("dt", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("score,key_norm", [("softmax", True), ("sigmoid", True), ("softmax", False)])
@pytest.mark.parametrize("with_grad", [False, True], ids=["", "grad"])
def test_source_grad_equals_its_naive_twin(dt, heads, score, key_norm, with_grad):
    """Reads of one and of three queries, one query without an upstream gradient, with and
    without a gradient that reached the source directly."""
    g = torch.Generator().manual_seed(heads + 7 * with_grad)
    lead, D = (2, 5), 16
    v = torch.randn(*lead, D, generator=g, dtype=dt) * 1.5
    r = inverse_rms(v) if key_norm else None
    reads = deferred_reads(g, dt, lead, D, heads, (1, 3), missing=(2,))
    grad = torch.randn(*lead, D, generator=g, dtype=dt) if with_grad else None
    options = dict(heads=heads, eps=1e-6, score=score, key_norm=key_norm)
    want = backend("naive").source_grad(v, r, reads, grad, **options)
    got = backend("cpu").source_grad(v, r, reads, grad, **options)
    tol = 1e-12 if dt == torch.float64 else 2e-5
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@needs_kernels
def test_source_grad_of_a_source_shared_by_every_token():
    """A source ``[D]`` expanded to every token (Delta's null) is read with a zero row stride."""
    g = torch.Generator().manual_seed(5)
    dt = torch.float64
    v = torch.randn(8, generator=g, dtype=dt).expand(3, 4, 8)
    r = inverse_rms(v)
    reads = deferred_reads(g, dt, (3, 4), 8, 2, (2,))
    want = backend("naive").source_grad(v, r, reads, heads=2)
    got = backend("cpu").source_grad(v, r, reads, heads=2)
    torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-12)


DESIGNS = [
    ("full", {}),
    ("block", dict(block_size=2)),
    ("block", dict(block_sizes=(1, 3, 2))),
    ("block", dict(block_size=2, heads=4)),
    ("block", dict(block_size=2, two_phase=False)),
    ("block", dict(block_size=2, score="sigmoid")),
    ("delta", dict(block_size=2, heads=4)),
]


def train_pass(kind, options, backend_name, defer, *, records=None, partial_first=False):
    """Forward and backward of a stream of 6 sublayers (dim 16, fp64, every parameter moved away
    from its initial value); returns every gradient: the input's, the stream's, the sublayers'."""
    torch.manual_seed(0)
    stream = build_stream(kind, dim=16, num_sublayers=6, backend=backend_name, **options).double()
    stream.router.defer_source_grads = defer
    layers = [torch.nn.Linear(16, 16).double() for _ in range(6)]
    with torch.no_grad():
        for p in stream.parameters():
            p.add_(0.5 * torch.randn_like(p))
    e = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    state = stream.init(e)
    if records is not None:
        records.append(state.memo.ledger if hasattr(state, "memo") else state.routed.memo.ledger)
    for i, layer in enumerate(layers):
        state = stream.write(state, i, torch.tanh(layer(stream.read(state, i))))
    out = stream.output(state)
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
    if partial_first:
        # a backward call that stops before the sources: it runs the reads' backward but no source's
        torch.autograd.grad(loss, stream.pseudo_queries, retain_graph=True)
    loss.backward()
    return [e.grad, *(p.grad for p in stream.parameters()), *(l.weight.grad for l in layers)]


def assert_same(got, want, tol=1e-10):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)


@needs_kernels
@pytest.mark.parametrize("kind,options", DESIGNS, ids=[f"{k}-{'-'.join(map(str, o.values()))}" for k, o in DESIGNS])
def test_deferred_gradients_equal_accumulated_ones_and_the_reference(kind, options, monkeypatch):
    made = []
    original = SourceLedger.defer
    monkeypatch.setattr(SourceLedger, "defer", lambda self, index, read: (made.append(index), original(self, index, read)))
    ledgers = []
    deferred = train_pass(kind, options, "cpu", True, records=ledgers)
    assert made, "no read left its source gradients to the ledger"
    assert ledgers[0] is not None and not ledgers[0].pending  # every record was used
    accumulated = train_pass(kind, options, "cpu", False, records=ledgers)
    assert ledgers[1] is None
    reference = train_pass(kind, options, "naive", True)
    assert_same(deferred, accumulated)
    assert_same(deferred, reference)


@needs_kernels
def test_a_backward_that_stops_before_the_sources_leaves_nothing_for_the_next():
    """``autograd.grad`` for the queries alone runs the reads' backward, whose records no
    source uses in that call; the next backward must not add them to its own."""
    want = train_pass("block", dict(block_size=2), "cpu", True)
    got = train_pass("block", dict(block_size=2), "cpu", True, partial_first=True)
    assert_same(got, want, tol=1e-12)


@needs_kernels
def test_no_ledger_without_autograd_or_on_a_backend_that_accumulates():
    stream = build_stream("block", dim=16, num_sublayers=4, block_size=2, backend="cpu")
    e = torch.randn(2, 3, 16)
    with torch.no_grad():
        assert stream.init(e).memo.ledger is None
    assert stream.init(e).memo.ledger is not None
    torch_stream = build_stream("block", dim=16, num_sublayers=4, block_size=2, backend="torch")
    assert torch_stream.init(e).memo.ledger is None
