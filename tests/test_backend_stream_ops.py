"""Every registered backend against the naive reference on the multi-stream designs'
operations (HC, mHC, GR): mixes, updates, gated mixes, Sinkhorn and the fused norm-projection,
forward and every gradient (the shared cases: ``backend_cases.py``)."""

import pytest
import torch

from attnres import ops
from attnres.ops import rms_norm
from tests.backend_cases import OTHERS, EVERY, DTYPES, use, grads, assert_grads_close


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
