"""What the backend tests share: the backends each test runs on, the dtypes with their
tolerances, the shapes of a read, and the helpers that draw inputs and compare results."""

import pytest
import torch

from attnres import build_stream, ops
from attnres.ops import BACKENDS, Request
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


def drive(stream, e, weights):
    """A stream driven through ``len(weights)`` sublayers ``x -> tanh(x @ w)``: each read, and the output."""
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
