"""The mixing rules without a pseudo-query (docs/METHOD.md section 9): DenseFormer, Full's learned
mixing and its sliding window, each against its equations written out, and the invariants that
tie them to PreNorm and Full."""

import pytest
import torch

from attnres import Trace, Transformer, build_stream
from attnres.ops import weighted_depth_sum

from .conftest import randomize_stream, tiny_config
from .stream_cases import RandomSublayers, randomized, run

D, M = 12, 7


def norm(h, g, eps=1e-6):
    return g * (h / torch.sqrt((h**2).mean(-1, keepdim=True) + eps))


def written_out(e, sublayers, mix, gains, g_out, m=M):
    """Drive the equations: ``h_i = mix(i, [e, v_0, ..., v_{i-1}])``, ``x_i = RMSNorm_{g_i}(h_i)``,
    ``v_i = F_i(x_i)``; the output ``RMSNorm_{g_out}(mix(M, all sources))``."""
    vs, reads = [e], []
    for i in range(m):
        x = norm(mix(i, vs), gains[i])
        reads.append(x)
        vs.append(sublayers(i, x))
    return reads, norm(mix(m, vs), g_out)


def assert_reads(stream, e, ref_reads, ref_out, tol=1e-10):
    reads, out, _ = run(stream, e, RandomSublayers())
    for i, (a, b) in enumerate(zip(reads, ref_reads)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=f"read {i}")
    torch.testing.assert_close(out, ref_out, atol=tol, rtol=tol)


# -- the equations -------------------------------------------------------------------------------

def test_denseformer_reads_a_weighted_sum_of_every_output():
    stream = randomized(build_stream("denseformer", dim=D, num_sublayers=M))
    a = stream.source_weights.detach()
    e = torch.randn(5, D, dtype=torch.float64)

    def mix(i, vs):  # sum_{j=-1}^{i-1} a_{i,j} v_j
        return sum(a[i, j] * v for j, v in enumerate(vs))

    assert_reads(stream, e, *written_out(e, RandomSublayers(), mix, [n.weight for n in stream.norms],
                                         stream.final_norm.weight))


@pytest.mark.parametrize("heads", [1, 3])
def test_learned_mixing_reads_a_softmax_of_its_logits_per_head(heads):
    stream = randomized(build_stream("full", dim=D, num_sublayers=M, mixing="learned", heads=heads))
    logits = stream.mixing_logits.detach()
    assert logits.shape == (M + 1, M + 1, heads) and stream.pseudo_queries is None and stream.key_gains is None
    hd = D // heads
    e = torch.randn(5, D, dtype=torch.float64)

    def mix(i, vs):  # per head slice: sum_j softmax_j(l_{i,j,h}) v_j
        h = torch.zeros_like(vs[0])
        for hh in range(heads):
            alpha = torch.softmax(logits[i, :len(vs), hh], 0)
            h[..., hh * hd:(hh + 1) * hd] = sum(w * v[..., hh * hd:(hh + 1) * hd] for w, v in zip(alpha, vs))
        return h

    assert_reads(stream, e, *written_out(e, RandomSublayers(), mix, [n.weight for n in stream.norms],
                                         stream.final_norm.weight))


def window_attention(stream, window, eps=1e-6):
    """Full's routing over ``e`` and the last ``window`` outputs, written out (one head)."""
    w, k = stream.pseudo_queries.detach(), stream.key_gains.detach()

    def mix(i, vs):
        seen = [vs[0], *vs[1:][-window:]] if window else vs
        scores = torch.stack([(w[i] * norm(v, k[i], eps)).sum(-1) for v in seen])
        return sum(a[..., None] * v for a, v in zip(torch.softmax(scores, 0), seen))

    return mix


@pytest.mark.parametrize("backend", ["naive", "torch", "cpu"])
@pytest.mark.parametrize("window", [1, 3])
def test_a_window_routes_over_the_embedding_and_the_last_outputs(window, backend):
    stream = randomized(build_stream("full", dim=D, num_sublayers=M, window=window, backend=backend))
    assert stream.sources_read(M) == [0, *range(M + 1 - window, M + 1)]
    e = torch.randn(5, D, dtype=torch.float64)
    assert_reads(stream, e, *written_out(e, RandomSublayers(), window_attention(stream, window),
                                         [n.weight for n in stream.norms], stream.final_norm.weight))


@pytest.mark.parametrize("backend", ["naive", "torch", "cpu"])
def test_a_window_combines_with_learned_mixing(backend):
    if backend == "cpu":
        with pytest.raises(ValueError, match=r"mixing='learned' mixes with plain PyTorch ops, on no routing backend: "
                                             r"backend='cpu' cannot serve it; give one of \['auto', 'torch', 'naive'\]"):
            build_stream("full", dim=D, num_sublayers=M, mixing="learned", backend=backend)
        return
    stream = randomized(build_stream("full", dim=D, num_sublayers=M, mixing="learned", window=2, backend=backend))
    logits = stream.mixing_logits.detach()[..., 0]
    e = torch.randn(5, D, dtype=torch.float64)

    def mix(i, vs):
        among = [0, *range(len(vs))[1:][-2:]]
        alpha = torch.softmax(logits[i, among], 0)
        return sum(w * vs[j] for w, j in zip(alpha, among))

    assert_reads(stream, e, *written_out(e, RandomSublayers(), mix, [n.weight for n in stream.norms],
                                         stream.final_norm.weight))


def test_the_weighted_sum_scales_each_head_slice_by_its_weight():
    sources = [torch.randn(3, 6, dtype=torch.float64) for _ in range(4)]
    w = torch.randn(4, 2, dtype=torch.float64)
    want = torch.cat([sum(w[j, h] * s[:, 3 * h:3 * h + 3] for j, s in enumerate(sources)) for h in range(2)], -1)
    torch.testing.assert_close(weighted_depth_sum(w, sources), want, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match=r"weighted_depth_sum: 3 weights for 4 sources"):
        weighted_depth_sum(w[:3], sources)


# -- the invariants ------------------------------------------------------------------------------

def tokens(b=2, t=8, seed=0):
    return torch.randint(0, 64, (b, t), generator=torch.Generator().manual_seed(seed))


def loss_and_grads(model, x):
    model.zero_grad()
    logits = model(x)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def pair(other: dict, base: dict, randomize=False):
    """Two tiny models with the same weights (``base``'s loaded into ``other`` where names match)."""
    torch.manual_seed(0)
    a = Transformer(tiny_config(**base))
    if randomize:
        randomize_stream(a)
    b = Transformer(tiny_config(**other))
    missing, unexpected = b.load_state_dict(a.state_dict(), strict=False)
    return a, b, set(missing), set(unexpected)


def test_denseformers_first_forward_is_prenorms():
    """At init every weight is 1 and the sum runs left to right as PreNorm's running sum does:
    the logits are PreNorm's bit for bit in fp32, the gradients of every shared parameter equal
    to round-off (the same terms, summed in another order)."""
    prenorm, dense, missing, _ = pair(dict(residual="denseformer"), dict(residual="prenorm"))
    assert missing == {"stream.source_weights"}
    x = tokens()
    p_logits, p_grads = loss_and_grads(prenorm, x)
    d_logits, d_grads = loss_and_grads(dense, x)
    assert torch.equal(d_logits, p_logits)
    for name, g in p_grads.items():
        torch.testing.assert_close(d_grads[name], g, atol=1e-6, rtol=1e-5, msg=name)
    # the weights' own gradient: dL/da_{i,j} = <dL/dh_i, v_j>, nonzero below the diagonal only
    a = d_grads["stream.source_weights"]
    assert torch.count_nonzero(a.triu(1)) == 0 and torch.count_nonzero(a.tril()) > 0


def test_learned_mixings_first_forward_is_fulls():
    """Zero logits and zero pseudo-queries both give uniform weights ``1/(i+1)``."""
    full, learned, missing, unexpected = pair(dict(residual="full", mixing="learned", heads=2),
                                              dict(residual="full", heads=2))
    assert missing == {"stream.mixing_logits"} and unexpected == {"stream.pseudo_queries", "stream.key_gains"}
    x = tokens()
    f_logits, f_grads = loss_and_grads(full, x)
    l_logits, l_grads = loss_and_grads(learned, x)
    torch.testing.assert_close(l_logits, f_logits, atol=1e-5, rtol=1e-5)
    for name, g in l_grads.items():
        if name in f_grads:
            torch.testing.assert_close(g, f_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("options", [dict(backend="cpu"), dict(backend="torch"), dict(heads=2, backend="cpu"),
                                     dict(query="input", backend="naive")])
@pytest.mark.parametrize("window", [6, 9])  # M = 6: the depth, and more
def test_a_window_of_at_least_the_depth_is_full(window, options):
    """With any queries (randomized, input-dependent too): the logits and every gradient."""
    full, windowed, missing, unexpected = pair(dict(residual="full", window=window, **options),
                                               dict(residual="full", **options), randomize=True)
    assert not missing and not unexpected
    x = tokens()
    f_logits, f_grads = loss_and_grads(full, x)
    w_logits, w_grads = loss_and_grads(windowed, x)
    torch.testing.assert_close(w_logits, f_logits, atol=1e-6, rtol=1e-6)
    assert w_grads.keys() == f_grads.keys()
    for name, g in f_grads.items():
        torch.testing.assert_close(w_grads[name], g, atol=1e-6, rtol=1e-5, msg=name)


@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_a_windows_gradients_on_a_backend_equal_the_naive_forms(backend, monkeypatch):
    """A short window on the backend (the CPU kernels defer the sources' gradients to a ledger,
    which a window's reads of some sources must feed exactly) against the reference backend."""
    from attnres.ops import routing
    from attnres.ops.source_ledger import tracked

    naive, fast, _, _ = pair(dict(residual="full", window=2, heads=2, backend=backend),
                             dict(residual="full", window=2, heads=2, backend="naive"), randomize=True)
    x = tokens()
    n_logits, n_grads = loss_and_grads(naive, x)
    handed = []  # per windowed read of the fast model: (sources completed, of them handed to the ledger)
    read_sources = routing._read_sources

    def recording(memo, sources, among=None):
        out = read_sources(memo, sources, among)
        if among is not None and len(among) < len(memo.prepared):
            handed.append(sum(tracked(s) is not None for s in out))
        return out

    monkeypatch.setattr(routing, "_read_sources", recording)
    f_logits, f_grads = loss_and_grads(fast, x)
    assert handed, "no read was windowed"
    # the CPU kernels defer a window's sources to the ledger; the torch backend never does
    assert (min(handed) > 0) if backend == "cpu" else (max(handed) == 0), handed
    torch.testing.assert_close(f_logits, n_logits, atol=1e-5, rtol=1e-5)
    for name, g in n_grads.items():
        torch.testing.assert_close(f_grads[name], g, atol=1e-5, rtol=1e-4, msg=name)


def test_every_gradient_of_the_weighted_sums_equals_the_written_out_forms():
    """fp64 gradcheck of the reads of DenseFormer and learned mixing (sources, weights, logits)."""
    sources = [torch.randn(2, 6, dtype=torch.float64, requires_grad=True) for _ in range(3)]
    a = torch.randn(3, dtype=torch.float64, requires_grad=True)
    torch.autograd.gradcheck(lambda a, *s: weighted_depth_sum(a, s), (a, *sources))
    per_head = torch.randn(3, 2, dtype=torch.float64, requires_grad=True)  # [N, H]: a weight per head slice
    torch.autograd.gradcheck(lambda a, *s: weighted_depth_sum(a, s), (per_head, *sources))
    stream = randomized(build_stream("full", dim=6, num_sublayers=2, mixing="learned", heads=2))
    e = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 6, dtype=torch.float64, requires_grad=True)

    class Pass(torch.nn.Module):  # the protocol as a forward, so that functional_call swaps the logits in
        def __init__(self):
            super().__init__()
            self.stream = stream

        def forward(self, e, v):
            state = self.stream.write(self.stream.write(self.stream.init(e), 0, v), 1, v * 2)
            return self.stream.output(state)

    def output(e, v, logits):
        return torch.func.functional_call(Pass(), {"stream.mixing_logits": logits}, (e, v))

    torch.autograd.gradcheck(output, (e, v, stream.mixing_logits.detach().clone().requires_grad_()))


@pytest.mark.parametrize("shape", [(4,), (4, 2)])
def test_a_weighted_sum_of_bf16_sources_keeps_only_the_sources_for_backward(shape):
    """The sum runs in fp32 over bf16 sources; what backward keeps is the sources and weights
    themselves (no fp32 copy per source), and every gradient equals autograd through the
    written-out fp32 form, cast back."""
    torch.manual_seed(0)
    sources = [torch.randn(3, 5, 8, dtype=torch.bfloat16, requires_grad=True) for _ in range(4)]
    weights = torch.randn(*shape, requires_grad=True)
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = weighted_depth_sum(weights, sources)
    assert out.dtype == torch.bfloat16
    assert {t.data_ptr() for t in saved} == {t.data_ptr() for t in [weights, *sources]}
    g = torch.randn_like(out)
    grads = torch.autograd.grad(out, [weights, *sources], g)

    w = weights if len(shape) == 1 else weights.repeat_interleave(4, dim=1)
    w = w[:, None] if len(shape) == 1 else w
    expected = sum(v.float() * w[j] for j, v in enumerate(sources)).to(torch.bfloat16)
    assert torch.equal(out, expected)
    reference = torch.autograd.grad(sum(v.float() * w[j] for j, v in enumerate(sources)), [weights, *sources],
                                    g.float())
    torch.testing.assert_close(grads[0], reference[0], atol=1e-4, rtol=1e-4)
    for mine, theirs in zip(grads[1:], reference[1:]):
        assert mine.dtype == torch.bfloat16 and torch.equal(mine, theirs.to(torch.bfloat16))


def test_traced_weights_keep_fulls_columns():
    """A traced read records one row per source of Full (zero outside the window); learned
    mixing's and DenseFormer's weights are the same for every token."""
    e = torch.randn(2, 3, D, dtype=torch.float64)
    for kind, options in [("full", dict(window=2)), ("full", dict(mixing="learned", window=2, heads=3)),
                          ("denseformer", {})]:
        stream = randomized(build_stream(kind, dim=D, num_sublayers=M, **options))
        trace = Trace()
        run(stream, e, RandomSublayers(), trace=trace)
        heads = options.get("heads", 1)
        for site in range(M + 1):
            w = trace.depth_weights[site]
            assert w.shape == (site + 1, 2, 3, heads), (kind, options, site)
            if options.get("window") and site > 2:
                assert torch.count_nonzero(w[1:site - 1]) == 0 and torch.all(w[[0, site - 1, site]] != 0)
            if kind == "denseformer":
                torch.testing.assert_close(w[..., 0], stream.source_weights[site, :site + 1, None, None].detach()
                                           .expand(-1, 2, 3))
            if options.get("window"):
                torch.testing.assert_close(w[stream.sources_read(site)].sum(0), torch.ones(2, 3, heads,
                                                                                          dtype=w.dtype))


# -- refusals --------------------------------------------------------------------------------------

@pytest.mark.parametrize("options,match", [
    (dict(mixing="learned", query="input"),
     r"mixing='learned' has input-independent weights and no keys; it cannot combine with query='input' "
     r"\(options of mixing='attention'\)"),
    (dict(mixing="learned", score="sigmoid", key_norm=False),
     r"it cannot combine with score='sigmoid', key_norm=False"),
    (dict(mixing="learned", backend="triton"), r"backend='triton' cannot serve it; give one of \['auto', 'torch', 'naive'\]"),
    (dict(mixing="static"), r"mixing='static' is not one of \('attention', 'learned'\)"),
    (dict(window=0), r"window=0 must be None \(every source\) or an integer >= 1"),
    (dict(window="8"), r"window='8' must be None \(every source\) or an integer >= 1"),
])
def test_bad_mixing_options_are_refused_naming_them(options, match):
    with pytest.raises(ValueError, match=match):
        build_stream("full", dim=D, num_sublayers=M, **options)


def test_denseformer_takes_no_routing_options():
    with pytest.raises(ValueError, match=r"option\(s\) \['heads'\] do not apply to kind 'denseformer'; it accepts none"):
        build_stream("denseformer", dim=D, num_sublayers=M, heads=2)
    with pytest.raises(ValueError, match=r"window=8 does not apply to residual='block'"):
        tiny_config(residual="block", window=8)
