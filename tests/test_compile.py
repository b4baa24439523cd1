"""torch.compile(fullgraph=True) captures every stream, the AttnRes family's reads on CPU as the
fused kernels' custom ops (``attnres::cpu_*``, which ``backend="auto"`` picks while compiling as
in eager mode), and the compiled forward and backward equal eager."""

import pytest
import torch
from torch._dynamo.backends.common import aot_autograd
from torch.nn import functional as F

from attnres.ops.backends import cpu_build

from .conftest import DESIGNS, tiny_model

# compiling each design costs seconds to tens of seconds: the suite's slow step (make test-slow)
pytestmark = pytest.mark.slow

COMPILED = [d for d in DESIGNS if d not in ("full-input-query", "block-sigmoid-nokeynorm")]
#: the designs that route over depth (ops.routing), and whether they merge (two-phase blocks)
ROUTED = {"full": False, "full-window": False, "block": True, "mhar": True, "mhar-uneven": True, "delta": True}
KERNELS = cpu_build.build_problem() is None


def loss_and_grads(model, fn, x):
    model.zero_grad()
    loss = F.cross_entropy(fn(x).flatten(0, 1), x.flatten())
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def recording_backend():
    """``aot_eager`` that also keeps the names of the ops in the forward and backward graphs it
    was given: dynamo's full-graph capture and AOT autograd, without C++ code generation (which
    would cost a minute per model on two cores)."""
    seen = {"forward": set(), "backward": set()}

    def keep(part):
        def compiler(gm, _inputs):
            seen[part].update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
            return gm
        return compiler

    return aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward")), seen


def check_compiled(design, compiler, **overrides):
    torch._dynamo.reset()
    model = tiny_model(design, n_layers=2, **overrides)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    compiled = torch.compile(model, fullgraph=True, backend=compiler)
    c_loss, c_grads = loss_and_grads(model, compiled, x)
    e_loss, e_grads = loss_and_grads(model, model, x)
    torch.testing.assert_close(c_loss, e_loss, atol=1e-5, rtol=1e-5)
    for name, g in e_grads.items():
        torch.testing.assert_close(c_grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


def cpu_ops(names) -> set[str]:
    return {n.removeprefix("attnres.").removesuffix(".default") for n in names
            if n.startswith("attnres.cpu_")}


def assert_cpu_ops_captured(seen, merges):
    """The reads are the CPU kernels' ops in the captured graphs, forward and backward."""
    want = {"cpu_attend"} | ({"cpu_merge"} if merges else set())
    assert cpu_ops(seen["forward"]) == want
    assert cpu_ops(seen["backward"]) == {f"{op}_backward" for op in want}


@pytest.mark.parametrize("design", COMPILED)
def test_fullgraph_capture_matches_eager(design):
    compiler, seen = recording_backend()
    check_compiled(design, compiler)
    if design in ROUTED and KERNELS:  # backend="auto" picks the CPU kernels while compiling
        assert_cpu_ops_captured(seen, ROUTED[design])
    else:
        assert cpu_ops(seen["forward"] | seen["backward"]) == set()


@pytest.mark.parametrize("name", ["cpu", "torch"])
def test_an_explicit_backend_compiles(name):
    """``backend="cpu"`` is its ops in the graph; ``backend="torch"`` is PyTorch ops alone."""
    if name == "cpu" and not KERNELS:
        pytest.skip(f"CPU kernels unavailable: {cpu_build.build_problem()}")
    compiler, seen = recording_backend()
    check_compiled("mhar", compiler, backend=name)
    if name == "cpu":
        assert_cpu_ops_captured(seen, merges=True)
    else:
        assert cpu_ops(seen["forward"] | seen["backward"]) == set()


def test_inductor_block_matches_eager():
    check_compiled("mhar", "inductor")
