"""Stream invariants: the protocol used directly, with random sublayer outputs."""

import math

import pytest
import torch

from attnres import Trace, build_stream
from attnres.ops import rms_norm
from attnres.streams import BlockState, Decoder, DeltaState, gated_branch_mix
from attnres.streams.attnres import FullState

from .stream_cases import D, M, RandomSublayers, randomized, run


def test_block_with_block_size_one_equals_full():
    full = randomized(build_stream("full", dim=D, num_sublayers=M, heads=2))
    block = build_stream("block", dim=D, num_sublayers=M, heads=2, block_size=1).double()
    block.load_state_dict(full.state_dict())
    e = torch.randn(4, D, dtype=torch.float64)
    f_reads, f_out, _ = run(full, e, RandomSublayers())
    b_reads, b_out, _ = run(block, e, RandomSublayers())
    for i, (a, b) in enumerate(zip(f_reads, b_reads)):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0, msg=f"read {i}")
    torch.testing.assert_close(f_out, b_out, atol=1e-12, rtol=0)


def full_attnres_reference(e, sublayers, w, k, g, g_out, eps=1e-6, heads=1):
    """METHOD.md sections 2 and 4 written out with plain loops: sources are the raw new outputs."""
    vs = [e]
    reads = []
    hd = D // heads

    def route(site):
        h = torch.zeros_like(e)
        for hh in range(heads):
            sl = slice(hh * hd, (hh + 1) * hd)
            keys = [k[site] * (v / torch.sqrt((v**2).mean(-1, keepdim=True) + eps)) for v in vs]
            scores = torch.stack([(key[..., sl] * w[site][sl]).sum(-1) for key in keys])
            alpha = torch.softmax(scores, 0)
            h[..., sl] = sum(a[..., None] * v[..., sl] for a, v in zip(alpha, vs))
        return h

    for i in range(M):
        h = route(i)
        x = g[i] * (h / torch.sqrt((h**2).mean(-1, keepdim=True) + eps))
        reads.append(x)
        vs.append(sublayers(i, x))
    h = route(M)
    return reads, g_out * (h / torch.sqrt((h**2).mean(-1, keepdim=True) + eps))


@pytest.mark.parametrize("heads", [1, 3])
def test_full_matches_written_out_spec(heads):
    stream = randomized(build_stream("full", dim=D, num_sublayers=M, heads=heads))
    e = torch.randn(5, D, dtype=torch.float64)
    reads, out, _ = run(stream, e, RandomSublayers())
    g = [n.weight for n in stream.norms]
    ref_reads, ref_out = full_attnres_reference(
        e, RandomSublayers(), stream.pseudo_queries, stream.key_gains, g, stream.final_norm.weight, heads=heads
    )
    for a, b in zip(reads, ref_reads):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(out, ref_out, atol=1e-10, rtol=1e-10)


def test_mhar_with_one_head_equals_single_head_and_heads_differ():
    single = randomized(build_stream("block", dim=D, num_sublayers=M, block_size=2))
    one_head = build_stream("block", dim=D, num_sublayers=M, block_size=2, heads=1).double()
    one_head.load_state_dict(single.state_dict())
    four = build_stream("block", dim=D, num_sublayers=M, block_size=2, heads=4).double()
    four.load_state_dict(single.state_dict())
    e = torch.randn(3, D, dtype=torch.float64)
    a, b, c = (run(s, e, RandomSublayers())[1] for s in (single, one_head, four))
    torch.testing.assert_close(a, b, atol=0, rtol=0)
    assert (a - c).abs().max() > 1e-3  # heads > 1 is a different routing on the same params


def test_full_stores_new_outputs_not_cumulative_sums():
    stream = build_stream("full", dim=D, num_sublayers=M)
    e = torch.randn(2, D)
    vs = [torch.randn(2, D) for _ in range(M)]
    state = stream.init(e)
    for i, v in enumerate(vs):
        stream.read(state, i)
        state = stream.write(state, i, v)
    assert len(state.sources) == M + 1
    assert all(a is b for a, b in zip(state.sources, [e] + vs))


@pytest.mark.parametrize("m,s", [(7, 3), (8, 4), (6, 1), (5, 5)])
def test_block_sources_follow_spec(m, s):
    stream = build_stream("block", dim=D, num_sublayers=m, block_size=s)
    e = torch.randn(D)
    # v_i = 10^i along one axis makes every partial and block sum identifiable
    vs = [torch.full((D,), 10.0**i) for i in range(m)]
    state = stream.init(e)
    for i in range(m):
        n, p = divmod(i, s)
        expected = [e] + [sum(vs[k * s : (k + 1) * s]) for k in range(n)]
        if p > 0:
            expected.append(sum(vs[n * s : i]))  # P_i; empty (absent) at a block start
        got = stream.sources(state)
        assert len(got) == len(expected), f"sublayer {i}"
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b)
        state = stream.write(state, i, vs[i])
    n_blocks = math.ceil(m / s)
    expected = [e] + [sum(vs[k * s : min((k + 1) * s, m)]) for k in range(n_blocks)]
    got = stream.sources(state)  # the output's sources include a partial final block
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kind", ["block", "delta"])
@pytest.mark.parametrize("sizes", [(4, 4, 6, 2), (1, 6, 1), (7, 1), (16,), (1,) * 16])
def test_uneven_block_sources_follow_spec(kind, sizes):
    """METHOD.md section 3, uneven blocks: block k spans sublayers [s_k, s_k + n_k); a read sees the
    completed blocks and the partial sum of its own block; the output, every block."""
    m = sum(sizes)
    stream = build_stream(kind, dim=D, num_sublayers=m, block_sizes=sizes)
    assert stream.num_blocks == len(sizes) and stream.block_sizes == sizes
    e = torch.randn(D)
    vs = [torch.full((D,), 1.5**i) for i in range(m)]
    starts = [sum(sizes[:k]) for k in range(len(sizes))]
    first = [] if kind == "block" else [stream.null]
    state = stream.init(e)
    for i in range(m):
        k = max(k for k, s in enumerate(starts) if s <= i)
        expected = [*first, e] + [sum(vs[s : s + n]) for s, n in zip(starts[:k], sizes[:k])]
        if i > starts[k]:
            expected.append(sum(vs[starts[k] : i]))
        got = stream.sources(state.routed if kind == "delta" else state)
        assert len(got) == len(expected), f"sublayer {i}"
        for a, b in zip(got, expected):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=0)
        state = stream.write(state, i, vs[i])
    expected = [*first, e] + [sum(vs[s : s + n]) for s, n in zip(starts, sizes)]
    got = stream.sources(state.routed if kind == "delta" else state)
    assert len(got) == len(expected)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=0)


def drive_both(kind, m, backend, equal, sizes):
    """Every read, the output and every gradient of two streams that differ only in how their
    blocks are given (``equal``: block_size or num_blocks; ``sizes``: block_sizes)."""
    from attnres.ops import BACKENDS, Request

    problem = BACKENDS[backend].problem(Request("cpu", torch.float32, "softmax", True))
    if problem:
        pytest.skip(f"backend {backend!r} cannot run here: {problem}")
    streams = []
    for options in (equal, dict(block_sizes=sizes)):
        torch.manual_seed(0)
        streams.append(randomized(build_stream(kind, dim=D, num_sublayers=m, heads=2, backend=backend, **options)).float())
    weights = [w.float() for w in RandomSublayers(m=m).weights]
    results = []
    for stream in streams:
        e = torch.randn(3, D, generator=torch.Generator().manual_seed(1)).requires_grad_()
        state, reads = stream.init(e), []
        for i in range(m):
            reads.append(stream.read(state, i))
            state = stream.write(state, i, torch.tanh(reads[-1] @ weights[i]))
        out = stream.output(state)
        loss = sum((r * (k + 1)).sum() for k, r in enumerate(reads)) + out.square().sum()
        results.append([*reads, out, *torch.autograd.grad(loss, [e, *stream.parameters()])])
    return results


@pytest.mark.parametrize("backend", ["naive", "torch", "cpu", "triton"])
@pytest.mark.parametrize("kind,m,count", [("block", 16, 4), ("block", 16, 8), ("delta", 12, 3), ("block", 6, 6)])
def test_equal_block_sizes_are_bit_for_bit_num_blocks(kind, m, count, backend):
    """block_sizes=(S,) * N is exactly num_blocks=N, every read and gradient bit for bit."""
    for a, b in zip(*drive_both(kind, m, backend, dict(num_blocks=count), (m // count,) * count)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("backend", ["naive", "torch", "cpu", "triton"])
@pytest.mark.parametrize("kind", ["block", "delta"])
def test_a_shorter_last_block_given_as_sizes_equals_block_size(kind, backend):
    """block_size=3 over 10 sublayers leaves a last block of 1, which the output reads as the
    partial; block_sizes=(3, 3, 3, 1) completes it. The same sources, so the same values (up
    to rounding: the output's read runs through another path)."""
    for a, b in zip(*drive_both(kind, 10, backend, dict(block_size=3), (3, 3, 3, 1))):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("options,match", [
    (dict(block_sizes=(4, 4)), r"block_sizes=\(4, 4\) must be positive integers summing to 7"),
    (dict(block_sizes=(4, 0, 3)), r"block_sizes=\(4, 0, 3\) must be positive integers summing to 7"),
    (dict(block_sizes=(8, -1)), r"block_sizes=\(8, -1\) must be positive integers"),
    (dict(block_sizes=()), r"block_sizes=\(\) must be positive integers"),
    (dict(block_sizes=(3.5, 3.5)), r"block_sizes=\(3.5, 3.5\) must be positive integers"),
    (dict(block_sizes=(4, 3), block_size=2), r"give block_sizes=\(4, 3\) or block_size, not both"),
    (dict(block_sizes=(4, 3), num_blocks=2), r"give block_sizes=\(4, 3\) or num_blocks, not both"),
])
def test_bad_block_sizes_are_refused_naming_them(options, match):
    with pytest.raises(ValueError, match=match):
        build_stream("block", dim=D, num_sublayers=M, **options)


def test_zero_init_queries_give_uniform_weights():
    from attnres.streams import Trace

    stream = build_stream("block", dim=D, num_sublayers=M, block_size=2, heads=3)
    trace = Trace()
    e = torch.randn(2, 5, D)
    run(stream, e, lambda i, x: torch.randn(2, 5, D), trace=trace)
    assert sorted(trace.depth_weights) == list(range(M + 1))
    for site, w in trace.depth_weights.items():
        n = w.shape[0]
        assert w.shape == (n, 2, 5, 3)
        torch.testing.assert_close(w, torch.full_like(w, 1 / n))


def test_hc_at_init_equals_prenorm_reads():
    hc = build_stream("hc", dim=D, num_sublayers=M, streams=3).double()
    pre = build_stream("prenorm", dim=D, num_sublayers=M).double()
    e = torch.randn(4, D, dtype=torch.float64)
    hc_reads, hc_out, _ = run(hc, e, RandomSublayers())
    pre_reads, pre_out, _ = run(pre, e, RandomSublayers())
    for a, b in zip(hc_reads, pre_reads):
        assert torch.equal(a, b)
    torch.testing.assert_close(hc_out, pre_out, atol=1e-6, rtol=0)  # sum of streams: eps only


def test_hc_static_weights_pick_stream_and_mix():
    hc = build_stream("hc", dim=D, num_sublayers=M, streams=3).double()
    with torch.no_grad():
        hc.read_static[0] = torch.tensor([0.0, 0.5, 0.5], dtype=torch.float64)
        hc.mix_static[0] = torch.tensor([[0, 1, 0], [1, 0, 0], [0, 0, 1]], dtype=torch.float64)
        hc.write_static[0] = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    H = torch.randn(2, 3, D, dtype=torch.float64)
    v = torch.randn(2, D, dtype=torch.float64)
    state = hc.join_state((), (H,), 0)  # the streams H before sublayer 0
    x = hc.read(state, 0)
    torch.testing.assert_close(x, rms_norm(0.5 * H[:, 1] + 0.5 * H[:, 2], hc.norms[0].weight))
    H2 = hc.write(state, 0, v).H
    torch.testing.assert_close(H2[:, 0], H[:, 1] + v)
    torch.testing.assert_close(H2[:, 1], H[:, 0] + 2 * v)
    torch.testing.assert_close(H2[:, 2], H[:, 2] + 3 * v)


def test_mhc_mixing_matrix_is_doubly_stochastic_for_random_inputs():
    mhc = build_stream("mhc", dim=D, num_sublayers=M, streams=4)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # live projections: logits = b_res + noise of std ~0.2
        mhc.scales.fill_(1.0)
        mhc.proj.copy_(0.2 / (4 * D) ** 0.5 * torch.randn(mhc.proj.shape, generator=g))
    H = torch.randn(64, 4, D, generator=g) * 3
    for i in range(M):
        P = mhc.mixing_matrix(H, i)
        assert P.shape == (64, 4, 4)
        torch.testing.assert_close(P.sum(-1), torch.ones(64, 4), atol=1e-5, rtol=0)
        torch.testing.assert_close(P.sum(-2), torch.ones(64, 4), atol=1e-5, rtol=0)
        assert P.std() > 0.01  # not a constant: the inputs matter


def test_mhc_at_init_reads_the_stream_average():
    mhc = build_stream("mhc", dim=D, num_sublayers=M, streams=4)
    H = torch.randn(5, 4, D)
    torch.testing.assert_close(mhc.read(mhc.join_state((), (H,), 2), 2), rms_norm(H.mean(-2), mhc.norms[2].weight),
                               atol=1e-5, rtol=1e-5)
    v = torch.randn(5, D)
    e = torch.randn(5, D)
    Hs = mhc.init(e)
    torch.testing.assert_close(mhc.write(Hs, 0, v).H, (e + v).unsqueeze(-2).expand(5, 4, D), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["hc", "mhc", "gr"])
def test_multi_stream_states_carry_what_the_next_site_needs_and_refuse_bare_streams(kind):
    """The state after a write holds what the next site needs from its streams (HC's and mHC's
    projections, GR's normalized branches), equal to preparing them afresh; a bare tensor of
    streams is refused, not unpacked along its first dim."""
    stream = randomized(build_stream(kind, dim=D, num_sublayers=M, streams=2))
    e = torch.randn(2, 5, D)
    state = stream.write(stream.init(e), 0, torch.randn(2, 5, D))
    torch.testing.assert_close(state.prepared, stream.join_state((), (state.H,), 1).prepared)
    before_output = stream.join_state((), (state.H,), M).prepared
    assert (before_output is None) == (kind != "gr")  # GR's output reads its normalized branches
    with pytest.raises(TypeError, match=f"{kind} stream: its state is the PreparedStreams"):
        stream.read(state.H, 1)
    with pytest.raises(RuntimeError, match=f"{kind} stream: the state is prepared for sublayer 1, not for site 2"):
        stream.read(state, 2)  # would read site 1's preparation with site 2's parameters


def test_gr_is_the_branch_average_when_gates_are_one():
    rhat = torch.randn(3, 4, D)
    torch.testing.assert_close(gated_branch_mix(rhat, torch.ones_like(rhat)), rhat.mean(-2))


def test_gr_read_and_write_follow_spec():
    gr = randomized(build_stream("gr", dim=D, num_sublayers=M, streams=3, rank=4))
    R = torch.randn(2, 3, D, dtype=torch.float64)
    v = torch.randn(2, D, dtype=torch.float64)
    i = 2
    rhat = R / torch.sqrt((R**2).mean(-1, keepdim=True) + 1e-6) * (1 + gr.branch_gains[i])
    flat = rhat.reshape(2, 3 * D) / 3
    G = torch.sigmoid(torch.nn.functional.silu(flat @ gr.gate_down[i].T) @ gr.gate_up[i].T).reshape(2, 3, D)
    state = gr.join_state((), (R,), i)  # the branches R before sublayer i
    torch.testing.assert_close(gr.read(state, i), (G * rhat).mean(1))
    s = 2 * torch.sigmoid(flat @ gr.inject[i].T)
    torch.testing.assert_close(gr.write(state, i, v).H, R + s[..., None] * v[:, None, :])


def test_gr_init_gates_are_half_and_writes_are_one():
    gr = build_stream("gr", dim=D, num_sublayers=M, streams=2)
    e = torch.randn(3, D)
    state = gr.init(e)
    torch.testing.assert_close(gr.read(state, 0), 0.5 * rms_norm(e))
    v = torch.randn(3, D)
    torch.testing.assert_close(gr.write(state, 0, v).H, (e + v).unsqueeze(1).expand(3, 2, D))


def test_delta_at_init_reads_exactly_like_prenorm():
    delta = build_stream("delta", dim=D, num_sublayers=M, heads=3, block_size=2)
    pre = build_stream("prenorm", dim=D, num_sublayers=M)
    e = torch.randn(4, D)
    subl = RandomSublayers()
    f = lambda i, x: subl(i, x.double()).float()  # noqa: E731
    d_reads, d_out, _ = run(delta, e, f)
    p_reads, p_out, _ = run(pre, e, f)
    for a, b in zip(d_reads, p_reads):
        assert torch.equal(a, b)
    assert torch.equal(d_out, p_out)


def test_delta_routes_null_e_and_blocks():
    from attnres.streams import Trace

    delta = build_stream("delta", dim=D, num_sublayers=M, block_size=3)
    trace = Trace()
    run(delta, torch.randn(2, D), lambda i, x: torch.randn(2, D), trace=trace)
    # sublayer i routes over null, e, completed blocks, and the partial when p > 0
    for i in range(M):
        n, p = divmod(i, 3)
        assert trace.depth_weights[i].shape[0] == 2 + n + (p > 0)
    assert trace.depth_weights[M].shape[0] == 2 + 3  # null, e, B0, B1, partial B2


@pytest.mark.parametrize(
    "kind,options,match",
    [
        ("nope", {}, "unknown residual kind 'nope'"),
        ("full", dict(heads=5), "heads=5 must be a positive integer dividing dim=12"),
        ("block", dict(block_size=0), r"block_size=0 must be an integer in \[1, 7\]"),
        ("block", dict(block_size=8), r"block_size=8 must be an integer in \[1, 7\]"),
        ("block", dict(num_blocks=9), r"num_blocks=9 must be an integer in \[1, 7\]"),
        ("block", dict(num_blocks=2, block_size=2), "not both"),
        ("prenorm", dict(heads=2), r"option\(s\) \['heads'\] do not apply to kind 'prenorm'"),
        ("mhc", dict(streams=1), "streams=1 must be an integer >= 2"),
        ("full", dict(query="dynamic"), "query='dynamic'"),
    ],
)
def test_build_stream_rejects_bad_options(kind, options, match):
    with pytest.raises(ValueError, match=match):
        build_stream(kind, dim=D, num_sublayers=M, **options)


def test_default_block_count_is_eight():
    s = build_stream("block", dim=D, num_sublayers=16)
    assert (s.block_size, s.num_blocks) == (2, 8)
    s = build_stream("block", dim=D, num_sublayers=4)
    assert (s.block_size, s.num_blocks) == (1, 4)


def decoding_backend(backend):
    from attnres.ops import BACKENDS, Request

    problem = BACKENDS[backend].problem(Request("cpu", torch.float64, "softmax", True))
    if problem:
        pytest.skip(f"backend {backend!r} cannot run here: {problem}")


DECODED = [  # the designs with a decoder, with the options that change what it reads
    ("full", dict(heads=3)),
    ("block", dict(block_size=3)),
    ("block", dict(block_sizes=(1, 4, 2), heads=2)),  # uneven blocks, the last completed before the output
    ("block", dict(num_blocks=2, score="sigmoid", key_norm=False)),  # a last block the output reads as the partial
    ("delta", dict(block_size=2, heads=2)),
    ("delta", dict(block_sizes=(3, 4), own_norms=False)),
]


@pytest.mark.parametrize("backend", ["cpu", "naive"])
@pytest.mark.parametrize("lead", [(), (1,), (2, 1), (3, 4)], ids=str)
@pytest.mark.parametrize("kind,options", DECODED, ids=[f"{k}-{'-'.join(map(str, o.values()))}" for k, o in DECODED])
def test_the_decoder_reads_writes_and_splits_as_the_stream(kind, options, lead, backend):
    """Driven through the protocol, a decoder (autograd off) gives the stream's every read, its
    output and, before every sublayer and the output, its ``split_state`` (fp64, to round-off);
    traced, the same depth weights and read RMS."""
    decoding_backend(backend)
    stream = randomized(build_stream(kind, dim=D, num_sublayers=M, backend=backend, **options))
    e = torch.randn(*lead, D, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        decoder = stream.decoder(e)
        assert isinstance(decoder, Decoder) and decoder.kind == kind
        for trace in (None, Trace(), Trace()):
            d_reads, d_out, d_states = run(decoder, e, RandomSublayers(), trace=trace)
            s_trace = None if trace is None else Trace()
            s_reads, s_out, s_states = run(stream, e, RandomSublayers(), trace=s_trace)
            for a, b in zip(d_reads + [d_out], s_reads + [s_out]):
                torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)
            if trace is not None:
                assert sorted(trace.depth_weights) == sorted(s_trace.depth_weights) == list(range(M + 1))
                for name in ("depth_weights", "read_rms"):
                    for site, w in getattr(s_trace, name).items():
                        torch.testing.assert_close(getattr(trace, name)[site], w, atol=1e-12, rtol=1e-12)
    # a decoder's state is spent by the write that follows it: split a fresh pass at each cut
    for cut in range(M + 1):
        with torch.no_grad():
            state = decoder.init(e)
            for i in range(cut):
                state = decoder.write(state, i, RandomSublayers()(i, decoder.read(state, i)))
            got = decoder.split_state(state)
        want = stream.split_state(s_states[cut])
        assert [len(t) for t in got] == [len(t) for t in want], cut
        for a, b in zip((*got[0], *got[1]), (*want[0], *want[1])):
            torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", ["cpu", "naive"])
@pytest.mark.parametrize("shape", [(1, D), (1, 1, D), (D,)], ids=str)
@pytest.mark.parametrize("kind,state_type", [("full", FullState), ("block", BlockState), ("delta", DeltaState)])
def test_one_token_without_the_flag_runs_the_ordinary_pass(kind, state_type, shape, backend):
    """A pass is a decode pass only when asked for: with autograd off, a flat batch ``[tokens, D]``
    of one token, or one position per sequence, runs the stream's ordinary pass (its own
    state, the inference path's scores where the backend scores ahead), which the decoder
    equals."""
    decoding_backend(backend)
    from attnres.ops import BACKENDS

    stream = randomized(build_stream(kind, dim=D, num_sublayers=M, backend=backend,
                                     **({} if kind == "full" else {"block_size": 3})))
    e = torch.randn(shape, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        state = stream.init(e)
        assert type(state) is state_type
        if kind != "full":
            memo = (state.routed if kind == "delta" else state).memo
            assert (memo.scores is not None) == BACKENDS[backend].scores_ahead
        reads, out, _ = run(stream, e, RandomSublayers())
        d_reads, d_out, _ = run(stream.decoder(e), e, RandomSublayers())
    for a, b in zip(reads + [out], d_reads + [d_out]):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kind,options", [("hc", dict(streams=3)), ("mhc", dict(streams=4, sinkhorn_iterations=5)),
                                          ("gr", dict(streams=2, rank=3))])
@pytest.mark.parametrize("dtype,tol", [pytest.param(torch.float32, 2e-5, id="fp32"),
                                       pytest.param(torch.float64, 1e-11, id="fp64")])
@pytest.mark.parametrize("backend", ["torch", "cpu", "triton"])
def test_multi_stream_designs_on_every_backend_equal_the_reference(kind, options, dtype, tol, backend):
    """HC, mHC and GR with their per-token work on each backend (the CPU kernels, Triton's,
    PyTorch ops): every read, the output and every gradient (the embedding's and every
    parameter's) equal the same stream on the naive backend."""
    from attnres.ops import BACKENDS, Request

    problem = BACKENDS[backend].problem(Request("cpu", dtype))
    if problem:
        pytest.skip(f"backend {backend!r} cannot run here: {problem}")
    weights = [w.to(dtype) for w in RandomSublayers().weights]
    results = []
    for name in (backend, "naive"):
        torch.manual_seed(0)  # GR draws its initial gates
        stream = randomized(build_stream(kind, dim=D, num_sublayers=M, backend=name, **options)).to(dtype)
        e = torch.randn(2, 3, D, generator=torch.Generator().manual_seed(1), dtype=dtype).requires_grad_()
        state, reads = stream.init(e), []
        for i in range(M):
            reads.append(stream.read(state, i))
            state = stream.write(state, i, torch.tanh(reads[-1] @ weights[i]))
        out = stream.output(state)
        loss = sum((r * (k + 1)).sum() for k, r in enumerate(reads)) + out.square().sum()
        results.append([*reads, out, *torch.autograd.grad(loss, [e, *stream.parameters()])])
    for a, b in zip(*results):
        scale = b.abs().max().clamp_min(1e-30)
        assert (a - b).abs().max() <= tol * scale


def test_a_multi_stream_design_refuses_an_unknown_backend():
    with pytest.raises(ValueError, match="backend='gpu' is not one of"):
        build_stream("mhc", dim=D, num_sublayers=M, backend="gpu")
