"""torch.compile(fullgraph=True) captures every stream on the torch backend, and the compiled
forward and backward equal eager."""

import pytest
import torch
from torch.nn import functional as F

from .conftest import DESIGNS, tiny_model

COMPILED = [d for d in DESIGNS if d not in ("full-input-query", "block-sigmoid-nokeynorm")]


def loss_and_grads(model, fn, x):
    model.zero_grad()
    loss = F.cross_entropy(fn(x).flatten(0, 1), x.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def check_compiled(design, backend):
    torch._dynamo.reset()
    model = tiny_model(design, n_layers=2)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, fullgraph=True, backend=backend)
    c_loss, c_grads = loss_and_grads(model, compiled, x)
    e_loss, e_grads = loss_and_grads(model, model, x)
    torch.testing.assert_close(c_loss, e_loss, atol=1e-5, rtol=1e-5)
    for name, g in e_grads.items():
        torch.testing.assert_close(c_grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("design", COMPILED)
def test_fullgraph_capture_matches_eager(design):
    # aot_eager runs dynamo's full-graph capture and AOT autograd without C++ code generation,
    # which would cost a minute per model on two cores
    check_compiled(design, "aot_eager")


def test_inductor_block_matches_eager():
    check_compiled("mhar", "inductor")
