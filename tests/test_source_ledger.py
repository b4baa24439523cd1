"""Deferred source gradients (``ops.source_ledger``): the ``cpu`` backend's ``source_grad``
against its naive twin, and streams trained with the ledger against the same streams
accumulating every read's term (``defer_source_grads=False``) and against the naive backend."""

import threading

import pytest
import torch

from attnres import build_stream
from attnres.ops import backend, depth_attention
from attnres.ops.backends import cpu_build
from attnres.ops.backends.common import inverse_rms
from attnres.ops.source_ledger import DeferredRead, SourceLedger

needs_kernels = pytest.mark.skipif(cpu_build.build_problem() is not None,
                                   reason=f"CPU kernels unavailable: {cpu_build.build_problem()}")


def deferred_reads(g, dt, lead, D, heads, query_counts, missing=()):
    """Random ``DeferredRead``s, one per entry of ``query_counts`` (its number of queries); the
    query numbered ``k`` over all reads gets no upstream gradient when ``k in missing``. The
    queries are scaled so that a head's logit is of order one, as in a trained read (unscaled,
    ``exp(logit - lse)`` reaches 1e5 at D = 172 and the comparison measures cancellation)."""
    reads, k = [], 0
    for S in query_counts:
        grads = []
        for _ in range(S):
            grads.append(None if k in missing else torch.randn(*lead, D, generator=g, dtype=dt))
            k += 1
        queries, lse, ds = (torch.randn(*shape, generator=g, dtype=dt) for shape in
                            ((S, D), (S, *lead, heads), (S, *lead, heads)))
        queries = queries * (D // heads) ** -0.5
        reads.append(DeferredRead(queries, lse, ds, tuple(grads)))
    return reads


@needs_kernels
@pytest.mark.parametrize("dt", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("heads", [1, 4])
@pytest.mark.parametrize("score,key_norm", [("softmax", True), ("sigmoid", True), ("softmax", False)])
@pytest.mark.parametrize("with_grad", [False, True], ids=["", "grad"])
@pytest.mark.parametrize("D", [16, 172])
def test_source_grad_equals_its_naive_twin(dt, heads, score, key_norm, with_grad, D):
    """Reads of one and of three queries, one query without an upstream gradient, with and
    without a gradient that reached the source directly; D = 172 (heads of 172 or 43 numbers)
    covers the kernel's sums by four vectors, by one vector and by single numbers."""
    g = torch.Generator().manual_seed(heads + 7 * with_grad)
    lead = (2, 5)
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
    ("full", dict(heads=4, score="sigmoid")),
    ("block", dict(block_size=2)),
    ("block", dict(block_sizes=(1, 3, 2))),
    ("block", dict(block_size=2, heads=4)),
    ("block", dict(block_size=2, two_phase=False)),
    ("block", dict(block_size=2, score="sigmoid")),
    ("block", dict(block_size=2, key_norm=False)),
    ("delta", dict(block_size=2, heads=4)),
    ("delta", dict(block_size=2, two_phase=False, key_norm=False)),
]


def forward_pass(kind, options, backend_name, defer, dtype=torch.float64):
    """``(loss, e, stream, layers, states)`` of a stream of 6 sublayers (dim 16, every parameter
    moved away from its initial value): ``states``, the state before each sublayer."""
    torch.manual_seed(0)
    stream = build_stream(kind, dim=16, num_sublayers=6, backend=backend_name, **options).to(dtype)
    stream.router.defer_source_grads = defer
    layers = [torch.nn.Linear(16, 16).to(dtype) for _ in range(6)]
    with torch.no_grad():
        for p in stream.parameters():
            p.add_(0.5 * torch.randn_like(p))
    e = torch.randn(2, 5, 16, dtype=dtype, requires_grad=True)
    states = [stream.init(e)]
    for i, layer in enumerate(layers):
        states.append(stream.write(states[-1], i, torch.tanh(layer(stream.read(states[-1], i)))))
    out = stream.output(states[-1])
    loss = (out * torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view_as(out)).sum()
    return loss, e, stream, layers, states


def memo_of(state):
    return state.routed.memo if hasattr(state, "routed") else state.memo


def gradients(e, stream, layers):
    return [e.grad, *(p.grad for p in stream.parameters()), *(l.weight.grad for l in layers)]


def train_pass(kind, options, backend_name, defer, dtype=torch.float64):
    """Every gradient of ``forward_pass``'s loss (the input's, the stream's, the sublayers'), and
    the pass's ledger (None without one), after the backward."""
    loss, e, stream, layers, states = forward_pass(kind, options, backend_name, defer, dtype)
    loss.backward()
    return gradients(e, stream, layers), memo_of(states[0]).ledger


def assert_same(got, want, tol=1e-10):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, atol=tol, rtol=tol)


def counting_records(monkeypatch) -> list:
    made = []
    original = SourceLedger.defer
    monkeypatch.setattr(SourceLedger, "defer",
                        lambda self, index, read: (made.append(index), original(self, index, read)))
    return made


@needs_kernels
@pytest.mark.parametrize("kind,options", DESIGNS, ids=[f"{k}-{'-'.join(map(str, o.values()))}" for k, o in DESIGNS])
def test_deferred_gradients_equal_accumulated_ones_and_the_reference(kind, options, monkeypatch):
    made = counting_records(monkeypatch)
    deferred, ledger = train_pass(kind, options, "cpu", True)
    assert made, "no read left its source gradients to the ledger"
    assert ledger is not None and not ledger.pending  # every record used, or dropped with its call
    accumulated, none = train_pass(kind, options, "cpu", False)
    assert none is None
    reference, _ = train_pass(kind, options, "naive", True)
    assert_same(deferred, accumulated)
    assert_same(deferred, reference)


@needs_kernels
@pytest.mark.parametrize("kind,options", [("full", {}), ("block", dict(block_size=2, heads=4))])
def test_deferred_gradients_in_fp32(kind, options):
    deferred, _ = train_pass(kind, options, "cpu", True, torch.float32)
    accumulated, _ = train_pass(kind, options, "cpu", False, torch.float32)
    # the two paths sum a source's gradient in different orders: in fp32 one element of 256 was
    # measured 2.7e-5 apart (relative 1e-4) on an AVX2 build (AMD EPYC), past a 2e-5 bound
    assert_same(deferred, accumulated, tol=5e-5)


@needs_kernels
def test_a_backward_that_stops_before_the_sources_leaves_nothing_behind():
    """``autograd.grad`` for the queries alone runs the reads' backward, whose records no source
    uses in that call: they go when it ends, and the next backward adds nothing of them."""
    want, _ = train_pass("block", dict(block_size=2), "cpu", True)
    loss, e, stream, layers, states = forward_pass("block", dict(block_size=2), "cpu", True)
    ledger = memo_of(states[0]).ledger
    for _ in range(3):
        torch.autograd.grad(loss, stream.pseudo_queries, retain_graph=True)
        assert not ledger.pending
    loss.backward()
    assert_same(gradients(e, stream, layers), want, tol=1e-12)


@needs_kernels
def test_two_backward_calls_on_one_graph_add_up():
    want, _ = train_pass("full", {}, "cpu", True)
    loss, e, stream, layers, _ = forward_pass("full", {}, "cpu", True)
    loss.backward(retain_graph=True)
    loss.backward()
    assert_same(gradients(e, stream, layers), [None if g is None else 2 * g for g in want], tol=1e-12)


@needs_kernels
def test_backward_calls_running_at_once_on_one_graph_each_get_their_own_gradient():
    loss, e, _, _, _ = forward_pass("full", {}, "cpu", True)
    want = torch.autograd.grad(loss, e, retain_graph=True)[0]
    got = [None] * 4

    def run(k):
        got[k] = torch.autograd.grad(loss, e, retain_graph=True)[0]

    threads = [threading.Thread(target=run, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for g in got:
        torch.testing.assert_close(g, want, atol=1e-12, rtol=1e-12)


@needs_kernels
@pytest.mark.parametrize("read", [dict(heads=4), dict(score="sigmoid"), dict(dtype=torch.float32)])
def test_a_users_read_of_a_states_sources_adds_its_gradient(read):
    """A user's ``depth_attention`` over a state's sources, with options or a dtype other than the
    stream's, adds its gradient as without a ledger."""
    results = []
    for defer in (True, False):
        loss, e, stream, layers, states = forward_pass("block", dict(block_size=2), "cpu", defer)
        dtype = read.get("dtype", torch.float64)
        options = {k: v for k, v in read.items() if k != "dtype"}
        sources = [s.to(dtype) for s in states[-1].blocks]
        extra = depth_attention(torch.linspace(-1, 1, 16, dtype=dtype), sources, backend="cpu", **options)
        (loss + extra.double().square().sum()).backward()
        results.append(gradients(e, stream, layers))
    assert_same(*results)


@needs_kernels
@pytest.mark.parametrize("read", [dict(heads=4), dict(score="sigmoid"), dict(first=torch.float64)])
def test_a_tracked_tensor_read_unlike_its_ledger_gets_its_gradient_from_the_read(read):
    """Two reads of a tracked fp32 tensor: one as its ledger computes (it defers), one whose
    options, or computing dtype (its first source's), differ; that one computes the tensor's
    gradient itself. Together they equal the reference."""
    g = torch.Generator().manual_seed(2)
    dt = torch.float32
    ledger = SourceLedger(backend("cpu").source_grad, dict(heads=1, eps=1e-6, score="softmax", key_norm=True), dt)
    v = torch.randn(2, 5, 16, generator=g, dtype=dt, requires_grad=True)
    first = torch.randn(2, 5, 16, generator=g, dtype=dt)
    other_first = first.to(read.get("first", dt))
    query = torch.randn(1, 16, generator=g, dtype=dt)
    options = {k: value for k, value in read.items() if k != "first"}
    cots = [torch.randn(2, 5, 16, generator=g, dtype=dt) for _ in range(2)]
    tracked_v = ledger.track(v, inverse_rms(v))
    (like,), _ = backend("cpu").attend(query, [first, tracked_v])
    (unlike,), _ = backend("cpu").attend(query, [other_first, tracked_v], **options)
    (got,) = torch.autograd.grad((like * cots[0]).sum() + (unlike.to(dt) * cots[1]).sum(), v)
    (want_like,), _ = backend("naive").attend(query, [first, v])
    (want_unlike,), _ = backend("naive").attend(query, [first, v], **options)
    (want,) = torch.autograd.grad((want_like * cots[0]).sum() + (want_unlike * cots[1]).sum(), v)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@needs_kernels
def test_hooks_and_grad_on_a_state_tensor_see_its_whole_gradient():
    seen = []
    for defer in (True, False):
        loss, e, stream, layers, states = forward_pass("block", dict(block_size=2), "cpu", defer)
        block = states[4].blocks[1]
        hooked = []
        block.register_hook(hooked.append)
        seen.append((torch.autograd.grad(loss, block, retain_graph=True)[0], hooked))
        loss.backward()
        assert len(hooked) == 2
    (grad_deferred, hooked_deferred), (grad_accumulated, hooked_accumulated) = seen
    torch.testing.assert_close(grad_deferred, grad_accumulated, atol=1e-12, rtol=1e-12)
    for a, b in zip(hooked_deferred, hooked_accumulated):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@needs_kernels
def test_a_backward_that_builds_a_graph_says_the_kernels_are_differentiable_once():
    """``create_graph=True`` does not defer: differentiating the gradient raises as without a
    ledger, instead of leaving out what the deferred terms would have added."""
    for defer in (True, False):
        loss, e, _, _, _ = forward_pass("block", dict(block_size=2), "cpu", defer)
        (g,) = torch.autograd.grad(loss, e, create_graph=True)
        assert g.requires_grad
        with pytest.raises(RuntimeError, match="differentiate twice"):
            g.square().sum().backward()


@needs_kernels
def test_no_ledger_without_autograd_or_on_a_backend_that_accumulates():
    stream = build_stream("block", dim=16, num_sublayers=4, block_size=2, backend="cpu")
    e = torch.randn(2, 3, 16)
    with torch.no_grad():
        assert stream.init(e).memo.ledger is None
    assert stream.init(e).memo.ledger is not None
    torch_stream = build_stream("block", dim=16, num_sublayers=4, block_size=2, backend="torch")
    assert torch_stream.init(e).memo.ledger is None
