"""depth_attention against the worked example (METHOD.md section 2) and a per-head formula."""

import math

import pytest
import torch

from attnres.ops import RMSNorm, depth_attention, rms_norm, sinkhorn
from attnres.ops.rmsnorm import RMSNormFunction, rms_norm_backward, rms_norm_forward

EPS_TINY = 1e-12  # "eps -> 0" in the worked example (docs/METHOD.md section 2)


def worked_example_sources():
    e = torch.tensor([2.0, 0.0, 0.0])
    v0 = torch.tensor([0.0, 4.0, 0.0])
    v1 = torch.tensor([0.0, 0.0, 6.0])
    return [e, v0, v1]


def test_worked_example_scores_weights_and_mix():
    sources = worked_example_sources()
    w = torch.tensor([0.0, math.log(2) / math.sqrt(3), 0.0])
    h, weights = depth_attention(w, sources, torch.ones(3), eps=EPS_TINY, return_weights=True)
    assert weights.shape == (3, 1)
    # scores are [0, ln 2, 0] up to the softmax's shift: log-weight differences recover them
    scores = weights[:, 0].log() - weights[0, 0].log()
    torch.testing.assert_close(scores, torch.tensor([0.0, math.log(2), 0.0]), atol=1e-6, rtol=0)
    torch.testing.assert_close(weights[:, 0], torch.tensor([0.25, 0.5, 0.25]), atol=1e-6, rtol=0)
    torch.testing.assert_close(h, torch.tensor([0.5, 2.0, 1.5]), atol=1e-6, rtol=0)


def test_worked_example_other_weights():
    sources = worked_example_sources()
    w = torch.tensor([math.log(2) / math.sqrt(3), 0.0, 0.0])  # score ln 2 on e
    h, weights = depth_attention(w, sources, eps=EPS_TINY, return_weights=True)
    torch.testing.assert_close(weights[:, 0], torch.tensor([0.5, 0.25, 0.25]), atol=1e-6, rtol=0)
    torch.testing.assert_close(h, torch.tensor([1.0, 1.0, 1.5]), atol=1e-6, rtol=0)


def test_uniform_weights_give_the_mean_not_the_sum():
    sources = worked_example_sources()
    h = depth_attention(torch.zeros(3), sources)
    torch.testing.assert_close(h, torch.tensor([2.0, 4.0, 6.0]) / 3)


def reference(query, sources, gain, heads, eps=1e-6, score="softmax", key_norm=True):
    """Per-head loop with einsum, written independently of the library's op."""
    dim = sources[0].shape[-1]
    hd = dim // heads
    outs, all_w = [], []
    for h in range(heads):
        sl = slice(h * hd, (h + 1) * hd)
        logits = []
        for v in sources:
            k = v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) if key_norm else v
            if gain is not None:
                k = k * gain
            q = query[..., sl]
            logits.append(torch.einsum("...d,...d->...", k[..., sl], q.expand_as(k[..., sl])))
        logits = torch.stack(logits)  # [N, ...]
        if score == "softmax":
            w = (logits - logits.max(0).values).exp()
            w = w / w.sum(0)
        else:
            w = 1 / (1 + (-logits).exp())
        outs.append(torch.einsum("n...,n...d->...d", w, torch.stack([v[..., sl] for v in sources])))
        all_w.append(w)
    return torch.cat(outs, -1), torch.stack(all_w, -1)


CASES = [
    pytest.param(1, 6, 3, id="H1-D6-N3"),
    pytest.param(2, 10, 4, id="H2-D10-N4"),
    pytest.param(4, 12, 5, id="H4-D12-N5"),
    pytest.param(4, 20, 1, id="H4-D20-N1"),
]


@pytest.mark.parametrize("heads,dim,n", CASES)
def test_matches_independent_formula(heads, dim, n):
    g = torch.Generator().manual_seed(heads * 100 + dim)
    sources = [torch.randn(2, 3, dim, generator=g) * (j + 1) for j in range(n)]
    query = torch.randn(dim, generator=g)
    gain = 1 + 0.3 * torch.randn(dim, generator=g)
    out, w = depth_attention(query, sources, gain, heads=heads, return_weights=True)
    ref_out, ref_w = reference(query, sources, gain, heads)
    assert out.shape == (2, 3, dim) and w.shape == (n, 2, 3, heads)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w, ref_w, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("score,key_norm", [("sigmoid", True), ("softmax", False), ("sigmoid", False)])
def test_ablations_match_formula(score, key_norm):
    g = torch.Generator().manual_seed(7)
    sources = [torch.randn(5, 8, generator=g) for _ in range(4)]
    query = torch.randn(8, generator=g) * 0.5
    gain = None if not key_norm else 1 + 0.1 * torch.randn(8, generator=g)
    out = depth_attention(query, sources, gain, heads=2, score=score, key_norm=key_norm)
    ref, _ = reference(query, sources, gain, 2, score=score, key_norm=key_norm)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_per_token_query_matches_formula():
    g = torch.Generator().manual_seed(3)
    sources = [torch.randn(4, 6, generator=g) for _ in range(3)]
    query = torch.randn(4, 6, generator=g)  # one query per token (input-dependent ablation)
    out = depth_attention(query, sources, heads=3)
    ref, _ = reference(query, sources, None, 3)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("heads,dim", [(1, 6), (2, 10), (4, 12)])
def test_gradcheck_fp64(heads, dim):
    g = torch.Generator().manual_seed(heads)
    sources = [torch.randn(3, dim, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    query = torch.randn(dim, generator=g, dtype=torch.float64, requires_grad=True)
    gain = (1 + 0.2 * torch.randn(dim, generator=g, dtype=torch.float64)).requires_grad_()

    def fn(q, k, *srcs):
        return depth_attention(q, list(srcs), k, heads=heads)

    assert torch.autograd.gradcheck(fn, (query, gain, *sources))
    # and the gradients equal the independent formula's
    out = fn(query, gain, *sources)
    ref, _ = reference(query, sources, gain, heads)
    cot = torch.randn_like(out)
    grads = torch.autograd.grad(out, [query, gain, *sources], cot)
    ref_grads = torch.autograd.grad(ref, [query, gain, *sources], cot)
    for a, b in zip(grads, ref_grads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8)


def test_output_keeps_source_dtype():
    sources = [torch.randn(4, 8, dtype=torch.bfloat16) for _ in range(3)]
    out, w = depth_attention(torch.randn(8), sources, return_weights=True)
    assert out.dtype == torch.bfloat16 and w.dtype == torch.float32


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(sources=[]), "sources is empty"),
        (dict(sources=[torch.zeros(2, 8), torch.zeros(3, 8)]), r"sources\[1\] has shape \(3, 8\)"),
        (dict(sources=[torch.zeros(2, 8)], heads=3), "heads=3 must be a positive integer dividing D=8"),
        (dict(sources=[torch.zeros(2, 8)], query=torch.zeros(6)), "last dim must be D=8"),
        (dict(sources=[torch.zeros(2, 8)], gain=torch.zeros(4)), r"gain has shape \(4,\)"),
        (dict(sources=torch.zeros(2, 2, 8)), "list or tuple"),
        (dict(sources=[torch.zeros(2, 8)], score="relu"), "score='relu'"),
    ],
    ids=["empty", "mismatched", "heads", "query-dim", "gain-dim", "stacked", "score"],
)
def test_bad_input_raises_clear_value_error(kwargs, match):
    args = dict(query=torch.zeros(8), sources=None, gain=None)
    args.update(kwargs)
    q, s, gn = args.pop("query"), args.pop("sources"), args.pop("gain")
    with pytest.raises(ValueError, match=match):
        depth_attention(q, s, gn, **args)


def test_rms_norm_matches_hf_order():
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    w = torch.randn(16, dtype=torch.bfloat16)
    xf = x.to(torch.float32)
    expected = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(rms_norm(x, w, 1e-6), expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_module_is_rms_norm_with_a_leaner_backward(dtype):
    """The module's own autograd op computes the same values, and the gradients autograd
    derives for ``rms_norm`` (fp64 to the last digits; bf16 within its rounding)."""
    norm = RMSNorm(16, eps=1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.add_(0.3 * torch.randn(16).to(dtype))
    x = torch.randn(3, 4, 16, dtype=dtype, requires_grad=True)
    assert torch.equal(norm(x), rms_norm(x, norm.weight, 1e-5))
    x64 = x.detach().double().requires_grad_()
    w64 = norm.weight.detach().double().requires_grad_()
    assert torch.autograd.gradcheck(lambda a, b: RMSNormFunction.apply(a, b, 1e-5), (x64, w64))
    cot = torch.randn(3, 4, 16, dtype=dtype)
    fast = torch.autograd.grad(norm(x), [x, norm.weight], cot)
    ref = torch.autograd.grad(rms_norm(x, norm.weight, 1e-5), [x, norm.weight], cot)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for a, b in zip(fast, ref):
        assert a.dtype == b.dtype
        torch.testing.assert_close(a.float(), b.float(), atol=tol * b.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("with_weight", [True, False])
def test_rms_norm_in_place_path_rounds_like_the_differentiable_one(dtype, with_weight):
    """Without autograd the norm and its backward reuse buffers (or normalize in place); the
    values must be those of the out-of-place (graph-recording) path bit for bit."""
    x = torch.randn(3, 5, 16, dtype=dtype)
    w = (1 + 0.3 * torch.randn(16)).to(dtype) if with_weight else None
    dy = torch.randn(3, 5, 16, dtype=dtype)
    with torch.no_grad():
        y_lean, rr_lean = rms_norm_forward(x, w, 1e-5)
        dx_lean, dw_lean = rms_norm_backward(dy, x, w, rr_lean)
        y_in_place = rms_norm_forward(x.clone(), w, 1e-5, in_place=True)[0]
    xg = x.clone().requires_grad_()
    y_graph, rr_graph = rms_norm_forward(xg, w, 1e-5)
    dx_graph, dw_graph = rms_norm_backward(dy, xg, w, rr_graph.detach())
    assert torch.equal(y_lean, y_graph) and torch.equal(rr_lean, rr_graph)
    assert torch.equal(y_in_place, y_graph)
    assert torch.equal(dx_lean, dx_graph)
    assert (dw_lean is None) == (not with_weight) and (dw_lean is None or torch.equal(dw_lean, dw_graph))


def test_sinkhorn_is_doubly_stochastic():
    logits = torch.randn(5, 4, 4) * 0.5
    p = sinkhorn(logits, 20)
    torch.testing.assert_close(p.sum(-1), torch.ones(5, 4), atol=1e-5, rtol=0)
    torch.testing.assert_close(p.sum(-2), torch.ones(5, 4), atol=1e-5, rtol=0)
    assert (p > 0).all()
