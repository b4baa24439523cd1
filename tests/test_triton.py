"""The Triton kernels (under TRITON_INTERPRET=1 on CPU) against the naive twin on the shapes that
exercise their tiling (tokens and widths that are not multiples of the tile, 64 tokens, 9
sources, D = 96): forward and every gradient. Their checks with every other backend's (shapes,
multi-query, merges, streams) run in ``test_backends.py``."""

import os

import pytest
import torch

pytest.importorskip("triton")

from attnres.ops import backend, depth_attention, depth_attention_naive  # noqa: E402

from .backend_cases import assert_close_to_scale  # noqa: E402
from .backend_cases import make as make_inputs  # noqa: E402

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU runs need TRITON_INTERPRET=1")

SHAPES = [
    pytest.param(1, 6, 1, (5,), id="H1-D6-N1-T5"),
    pytest.param(2, 10, 4, (2, 3), id="H2-D10-N4-T6"),
    pytest.param(4, 12, 9, (7,), id="H4-D12-N9-T7"),
    pytest.param(3, 96, 5, (8, 8), id="H3-D96-N5-T64"),
    pytest.param(8, 96, 9, (3, 5), id="H8-D96-N9-T15"),
]


def make(dim, n, lead, seed=0):
    return make_inputs(dim, n, lead, torch.float32, seed)


@pytest.mark.parametrize("heads,dim,n,lead", SHAPES)
def test_triton_read_matches_naive(heads, dim, n, lead):
    query, gain, sources = make(dim, n, lead)
    fast = depth_attention(query, sources, gain, heads=heads, backend="triton")
    ref = depth_attention(query, sources, gain, heads=heads, backend="naive")
    torch.testing.assert_close(fast, ref, atol=1e-5, rtol=1e-5)
    cot = torch.randn_like(ref)
    inputs = [query, gain, *sources]
    for a, b in zip(torch.autograd.grad(fast, inputs, cot), torch.autograd.grad(ref, inputs, cot)):
        assert_close_to_scale(a, b, 1e-5)


@pytest.mark.parametrize("heads,dim,n,lead", SHAPES[1:4])
def test_triton_multi_query_and_merge_match_naive(heads, dim, n, lead):
    query, gain, sources = make(dim, n, lead, seed=1)
    g = torch.Generator().manual_seed(2)
    qs = torch.randn(3, dim, generator=g).requires_grad_()
    ks = (1 + 0.2 * torch.randn(3, dim, generator=g)).requires_grad_()
    completed, partial = sources[:-1], sources[-1]
    triton = backend("triton")
    o1, lse1 = triton.attend(qs, completed, ks, heads=heads)
    h = torch.stack([triton.merge(o1[s], lse1[s], partial, qs[s], ks[s], heads=heads) for s in range(3)])
    ref = torch.stack([depth_attention_naive(qs[s], sources, ks[s], heads=heads) for s in range(3)])
    torch.testing.assert_close(h, ref, atol=1e-5, rtol=1e-5)
    cot = torch.randn_like(ref)
    inputs = [qs, ks, *sources]
    for a, b in zip(torch.autograd.grad(h, inputs, cot), torch.autograd.grad(ref, inputs, cot)):
        assert_close_to_scale(a, b, 1e-5)


def test_triton_refuses_what_it_cannot_run(monkeypatch):
    query, gain, sources = make(8, 2, (3,))
    with pytest.raises(RuntimeError, match="backend='triton' cannot run: .*score/key-norm ablations"):
        depth_attention(query, sources, gain, backend="triton", score="sigmoid")
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(RuntimeError, match="runs on CUDA tensors .* got cpu tensors"):
        depth_attention(query, sources, gain, backend="triton")
    # auto never picks Triton for CPU tensors
    torch.testing.assert_close(depth_attention(query, sources, gain), depth_attention(query, sources, gain, backend="naive"))
