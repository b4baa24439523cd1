"""The reference LM with every stream: causality, KV cache, gradients, conversions, errors."""

import pytest
import torch

from attnres import ModelConfig, Trace, Transformer, param_groups
from attnres.model import sample
from attnres.ops.rmsnorm import RMSNorm
from attnres.streams import Decoder

from .conftest import DECODED, DESIGNS, NO_BACKEND, randomize_stream, tiny_config, tiny_model


def tokens(b=2, t=12, seed=0, vocab=64):
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def test_causality(design):
    model = tiny_model(design)
    randomize_stream(model)
    x = tokens()
    base = model(x)
    for t in (0, 5, 11):
        y = x.clone()
        y[:, t] = (y[:, t] + 1) % 64
        changed = model(y)
        torch.testing.assert_close(changed[:, :t], base[:, :t], atol=1e-6, rtol=0)
        assert (changed[:, t:] - base[:, t:]).abs().max() > 0


def test_kv_cache_logits_equal_full_forward(design):
    model = tiny_model(design).eval()
    randomize_stream(model)
    x = tokens(t=10)
    full = model(x)
    cache = model.new_cache(2, 10)
    parts = [model(x[:, :4], cache=cache, start_pos=0)]  # prefill
    parts.append(model(x[:, 4:7], cache=cache, start_pos=4))  # a chunk after a prefix
    for t in range(7, 10):  # one token at a time
        parts.append(model(x[:, t : t + 1], cache=cache, start_pos=t))
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["cpu", "naive", "torch"])
def test_decoding_without_autograd_equals_the_full_forward_on_every_backend(design, backend):
    """The passes of generation (autograd off, one position per sequence after the prompt, each
    asked for as a decode pass): the AttnRes family reads its sources from one buffer (its
    ``Decoder``) on the backends that decode (cpu, naive) and routes as in training on the
    others. The logits of a prompt of 4 then 6 single positions, batch 2, equal the full
    forward's within fp32 round-off, across the block boundaries of every design (blocks of 2
    and 3 sublayers, uneven ones, 6 sublayers)."""
    options = {} if design in NO_BACKEND else {"backend": backend}
    if not options and backend != "cpu":
        pytest.skip(f"{design} has no routing backend")
    if design == "full-input-query" and backend != "naive":
        pytest.skip("input-dependent queries run on the naive backend only")
    model = tiny_model(design, **options).eval()
    randomize_stream(model)
    x = tokens(t=10)
    with torch.no_grad():
        full = model(x)
        cache = model.new_cache(2, 10)
        parts = [model(x[:, :4], cache=cache, start_pos=0)]
        parts += [model(x[:, t:t + 1], cache=cache, start_pos=t, decode=True) for t in range(4, 10)]
        decodes = isinstance(model.stream.decoder(torch.zeros(2, 1, 32)), Decoder)
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)
    assert torch.equal(torch.cat(parts, 1).argmax(-1), full.argmax(-1))
    assert decodes == (design in DECODED and backend in ("cpu", "naive")), (design, backend)


class DecoderCalls:
    """``model.stream.decoder`` wrapped (the real one runs): what each call gave."""

    def __init__(self, monkeypatch, stream):
        self.made = []
        real = stream.decoder

        def decoder(like):
            self.made.append(real(like))
            return self.made[-1]

        monkeypatch.setattr(stream, "decoder", decoder)


def test_generate_asks_for_a_decode_pass_for_each_token_after_the_prompt(design, monkeypatch):
    """The prompt runs as an ordinary pass; each of the tokens fed back after it as a decode
    pass, which the AttnRes family runs on its decoder (the default backend decodes on the CPU),
    the others on the stream itself."""
    model = tiny_model(design).eval()
    randomize_stream(model)
    calls = DecoderCalls(monkeypatch, model.stream)
    out = model.generate(tokens(b=2, t=5), 6)
    assert out.shape == (2, 11)
    assert len(calls.made) == 5  # 6 new tokens: the last is not fed back
    family = design in DECODED
    assert all(isinstance(d, Decoder) == family for d in calls.made), design
    assert all(d is model.stream for d in calls.made if not family)


def test_a_decode_request_with_autograd_on_is_refused(design):
    """Nothing of a decode pass is differentiable: asked for with autograd on, every design
    refuses, saying so (a pass with gradients is an ordinary one)."""
    model = tiny_model(design)
    with pytest.raises(RuntimeError, match=r"stream: a decode pass runs with autograd off .*\(decode=False\)"):
        model(tokens(t=1), decode=True)
    with pytest.raises(RuntimeError, match="a decode pass runs with autograd off"):
        model.stream.decoder(torch.zeros(2, 1, 32))


@pytest.mark.parametrize("backend", ["cpu", "naive"])
@pytest.mark.parametrize("design", ["full", "block", "mhar", "mhar-uneven", "delta", "block-sigmoid-nokeynorm"])
def test_a_decode_pass_of_several_positions_equals_the_ordinary_pass(design, backend):
    """The decode read takes any number of positions: a decode pass over a whole prompt, and
    over a chunk after a cached prefix, gives the ordinary pass's logits."""
    model = tiny_model(design, backend=backend).eval()
    randomize_stream(model)
    x = tokens(t=10)
    with torch.no_grad():
        assert isinstance(model.stream.decoder(torch.zeros(2, 10, 32)), Decoder)
        full = model(x)
        torch.testing.assert_close(model(x, decode=True), full, atol=1e-5, rtol=1e-5)
        cache = model.new_cache(2, 10)
        parts = [model(x[:, :4], cache=cache, decode=True), model(x[:, 4:], cache=cache, start_pos=4, decode=True)]
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_greedy_generate_matches_argmax_of_full_forwards(design):
    model = tiny_model(design).eval()
    randomize_stream(model)
    prompt = tokens(b=2, t=5)
    out = model.generate(prompt, 6)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], prompt)
    seq = prompt
    for _ in range(6):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


def test_sampling_respects_top_k():
    logits = torch.tensor([[0.0, 5.0, 4.0, -1.0]]).repeat(200, 1)
    picks = sample(logits, temperature=1.0, top_k=2, generator=torch.Generator().manual_seed(0))
    assert set(picks.flatten().tolist()) == {1, 2}


def test_every_parameter_gets_a_gradient_and_moves(design):
    model = tiny_model(design)
    x = tokens(seed=1)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(param_groups(model, 0.0), lr=1e-2)
    # Zero inits chain first gradients: a key gain's gradient is zero while its query is zero.
    # In delta the query's gradient is itself zero until the gate has moved, so its key gains
    # first move at step 3 (gate at step 1, pseudo-query and null at step 2).
    steps = 3 if design == "delta" else 2
    for step in range(steps):
        opt.zero_grad()
        model.loss(x[:, :-1], x[:, 1:]).backward()
        if step == 0:
            missing = [n for n, p in model.named_parameters() if p.grad is None]
            assert not missing, f"no gradient: {missing}"
        opt.step()
    frozen = [n for n, p in model.named_parameters() if torch.equal(p, before[n])]
    assert not frozen, f"did not move after {steps} steps: {frozen}"


def test_loss_falls_on_a_repeated_batch(design):
    model = tiny_model(design)
    x = tokens(b=4, t=16, seed=2)
    opt = torch.optim.AdamW(param_groups(model, 0.0), lr=3e-3)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = model.loss(x[:, :-1], x[:, 1:])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.5


@pytest.mark.parametrize("design_", ["delta"])
def test_delta_at_init_is_exactly_prenorm_then_routing_moves(design_):
    pre = tiny_model("prenorm", seed=5)
    delta = Transformer(tiny_config(residual="delta", block_size=2, heads=2))
    missing, unexpected = delta.load_state_dict(pre.state_dict(), strict=False)
    assert not unexpected
    assert sorted(missing) == ["stream.gates", "stream.key_gains", "stream.null", "stream.pseudo_queries"]
    x = tokens(seed=3)
    assert torch.equal(delta(x), pre(x))  # fp32, bit for bit
    routing = {n: p.detach().clone() for n, p in delta.named_parameters() if n in missing}
    opt = torch.optim.AdamW(param_groups(delta, 0.0), lr=1e-2)
    moved_by_step = []
    for step in range(3):
        opt.zero_grad()
        delta.loss(x[:, :-1], x[:, 1:]).backward()
        if step == 0:  # the zero init leaves only the gates a non-zero first gradient
            nonzero = {n for n, p in delta.named_parameters() if n in routing and p.grad.abs().max() > 0}
            assert nonzero == {"stream.gates"}
        opt.step()
        named = dict(delta.named_parameters())
        moved_by_step.append({n for n in routing if not torch.equal(named[n], routing[n])})
    assert moved_by_step[0] == {"stream.gates"}
    assert moved_by_step[1] == {"stream.gates", "stream.null", "stream.pseudo_queries"}
    assert moved_by_step[2] == set(routing)
    assert not torch.equal(delta(x), pre(x))


@pytest.mark.parametrize("kind", ["hc", "mhc"])
def test_hyper_connections_at_init_equal_prenorm(kind):
    # The output norms n * h (hc: sum of streams) where PreNorm norms h: equal up to eps alone,
    # so eps is made negligible against the small init's mean square.
    pre = tiny_model("prenorm", seed=5, norm_eps=1e-12)
    hc = Transformer(tiny_config(residual=kind, streams=3, norm_eps=1e-12))
    hc.load_state_dict(pre.state_dict(), strict=False)
    x = tokens(seed=4)
    torch.testing.assert_close(hc(x), pre(x), atol=1e-5, rtol=1e-5)


def test_prenorm_state_dict_loads_into_every_stream(design):
    pre = tiny_model("prenorm")
    model = tiny_model(design, seed=1)
    missing, unexpected = model.load_state_dict(pre.state_dict(), strict=False)
    own = {n for n, _ in model.named_parameters()} - set(pre.state_dict())
    assert set(missing) == own
    assert all(n.startswith("stream.") for n in missing)
    if design != "gr":  # GR replaces the pre-norms; every other stream keeps their names
        assert not unexpected
    for name, value in pre.state_dict().items():
        if name in model.state_dict():
            assert torch.equal(model.state_dict()[name], value)


def test_param_groups_keep_vectors_and_routing_out_of_decay():
    model = tiny_model("mhar")
    decay, no_decay = param_groups(model, 0.1)
    ids = {id(p) for p in no_decay["params"]}
    named = dict(model.named_parameters())
    for name in ["stream.pseudo_queries", "stream.key_gains", "stream.norms.0.weight", "stream.final_norm.weight"]:
        assert id(named[name]) in ids, name
    for name in ["layers.0.attn.wq.weight", "layers.2.mlp.w2.weight", "tok_embeddings.weight"]:
        assert id(named[name]) not in ids, name
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_tied_embeddings_share_one_tensor():
    model = Transformer(tiny_config(tie_embeddings=True))
    assert model.lm_head.weight is model.tok_embeddings.weight
    assert len(param_groups(model, 0.1)[0]["params"]) == len([p for p in model.parameters() if p.ndim == 2])


def test_depth_weights_capture():
    model = tiny_model("mhar")  # M = 6, block_size 3
    x = tokens(b=2, t=7)
    plain = model(x)
    logits, weights = model(x, return_depth_weights=True)
    torch.testing.assert_close(plain, logits, atol=1e-5, rtol=1e-5)  # traced reads route one by one
    assert sorted(weights) == list(range(7))
    expected_sources = [1, 2, 2, 2, 3, 3, 3]  # [e] [e,P] [e,P] [e,B0] [e,B0,P] [e,B0,P] out [e,B0,B1]
    for site, w in weights.items():
        assert w.shape == (expected_sources[site], 2, 7, 4)
        torch.testing.assert_close(w.sum(0), torch.ones(2, 7, 4))
    assert torch.equal(model(x), plain)  # a traced pass leaves nothing behind: the fast path again
    trace = Trace()
    model(x, trace=trace)
    assert sorted(trace.read_rms) == list(range(7)) and trace.read_rms[0].shape == (2, 7)


@pytest.mark.parametrize("design", ["mhar", "full", "delta"])
def test_a_traced_decode_pass_routes_its_buffer_on_the_reference(design):
    """A decode pass (autograd off, one position per sequence) runs on the design's decoder;
    traced, its reads route the buffered sources on the reference path: the same logits, and at
    every site weights over as many sources as the design has there, summing to 1."""
    model = tiny_model(design).eval()  # 6 sublayers; MHAR blocks of 3, Delta of 2 (after null)
    randomize_stream(model)
    x = tokens(b=2, t=1)
    with torch.no_grad():
        assert isinstance(model.stream.decoder(torch.zeros(2, 1, 32)), Decoder)
        plain = model(x, decode=True)
        logits, weights = model(x, decode=True, return_depth_weights=True)
        torch.testing.assert_close(plain, model(x), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits, plain, atol=1e-5, rtol=1e-5)
    expected = {"mhar": [1, 2, 2, 2, 3, 3, 3], "full": [1, 2, 3, 4, 5, 6, 7], "delta": [2, 3, 3, 4, 4, 5, 5]}[design]
    assert sorted(weights) == list(range(7))
    for site, w in weights.items():
        assert w.shape == (expected[site], 2, 1, model.stream.heads), site
        torch.testing.assert_close(w.sum(0), torch.ones(2, 1, model.stream.heads))


@pytest.mark.parametrize(
    "overrides,match",
    [
        (dict(n_heads=5), "n_heads=5 must divide dim=32"),
        (dict(n_kv_heads=3), "n_kv_heads=3 must be a positive integer dividing n_heads=4"),
        (dict(residual="nope"), "residual='nope' is not one of"),
        (dict(residual="prenorm", heads=4), "heads=4 does not apply to residual='prenorm'"),
        (dict(residual="block", block_size=0), "block_size=0"),
        (dict(residual="full", heads=3), "heads=3 must be a positive integer dividing dim=32"),
        (dict(dim=0), "dim=0 must be a positive integer"),
    ],
)
def test_config_errors(overrides, match):
    with pytest.raises(ValueError, match=match):
        Transformer(tiny_config(**overrides))


def test_forward_input_errors():
    model = tiny_model("block")
    with pytest.raises(ValueError, match="exceeds max_seq_len=64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match=r"token id 64 is outside the vocabulary \[0, 64\)"):
        model(torch.tensor([[1, 64]]))
    with pytest.raises(ValueError, match=r"token id -1 is outside"):
        model(torch.tensor([[-1, 3]]))
    with pytest.raises(ValueError, match="integer tensor"):
        model(torch.zeros(1, 3))
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        model.generate(torch.zeros(1, 60, dtype=torch.long), 5)


def test_config_defaults():
    c = ModelConfig(vocab_size=256, dim=512, n_layers=8, n_heads=8)
    assert (c.n_kv_heads, c.ffn_dim, c.residual) == (8, 1376, "prenorm")
    assert Transformer(ModelConfig(vocab_size=16, dim=16, n_layers=8, n_heads=2, residual="block")).stream.num_blocks == 8


def test_designs_cover_every_kind():
    from attnres import KINDS

    assert {d["residual"] for d in DESIGNS.values()} == set(KINDS)


def test_residual_options_are_the_stream_constructors():
    """Each keyword option of a stream's constructor is one ModelConfig field with its default
    and type (GR's ``rank`` as ``gr_rank``), reaches the stream, and raises for another kind."""
    import dataclasses
    import typing

    from attnres.streams import MODEL_OPTIONS, STREAMS
    from attnres.train.config import apply_override, tiny

    fields = {f.name: f for f in dataclasses.fields(ModelConfig)}
    hints = typing.get_type_hints(ModelConfig)
    for kind, cls in STREAMS.items():
        for name, option in cls.options().items():
            field = cls.config_names.get(name, name)
            if name in cls.wrapper_options:  # for wrapping another model's sublayers
                assert field not in fields
                continue
            assert fields[field].default == option.default and hints[field] == option.type, field
    names = list(fields)
    assert names[names.index("residual") + 1:] == list(MODEL_OPTIONS)  # every field after the kind is an option
    model = Transformer(tiny_config(residual="gr", gr_rank=3, streams=2))
    assert (model.stream.rank, model.stream.streams) == (3, 2)
    with pytest.raises(ValueError, match="gr_rank=3 does not apply to residual='block'"):
        tiny_config(residual="block", gr_rank=3)
    cfg = apply_override(apply_override(tiny(), "model.residual=gr"), "model.gr_rank=5")
    assert cfg.model.gr_rank == 5 and Transformer(cfg.model).stream.rank == 5


def test_generate_by_default_fills_what_the_context_has_room_for():
    from attnres.model import DEFAULT_NEW_TOKENS

    model = tiny_model("block")  # max_seq_len 64
    assert model.generate(tokens(b=2, t=8)).shape == (2, 64)
    long_context = Transformer(tiny_config(residual="prenorm", max_seq_len=300))
    assert long_context.generate(tokens(b=1, t=8)).shape == (1, 8 + DEFAULT_NEW_TOKENS)
    with pytest.raises(ValueError, match="prompt length 64 leaves no room in the context: max_seq_len=64"):
        model.generate(tokens(b=1, t=64))
    with pytest.raises(ValueError, match="prompt length 10 \\+ max_new_tokens 60 exceeds max_seq_len=64"):
        model.generate(tokens(b=1, t=10), 60)


def test_an_epsilon_relative_to_the_initial_scale_reaches_every_norm_of_the_stream():
    """``norm_eps_scale="init"``: the stream's norms (the reads', the final one, Full's key
    norm) take ``norm_eps * init_std**2``; ``"absolute"`` (the default) takes ``norm_eps``."""
    relative = tiny_config(residual="full", norm_eps=1e-6, init_std=0.02, norm_eps_scale="init")
    assert relative.stream_eps == pytest.approx(4e-10, rel=1e-12)
    model = Transformer(relative)
    eps = {model.stream.eps, model.stream.router.eps, model.stream.final_norm.eps,
           *(n.eps for n in model.stream.norms)}
    assert eps == {relative.stream_eps}
    assert Transformer(tiny_config(residual="full", norm_eps=1e-6)).stream.final_norm.eps == 1e-6
    with pytest.raises(ValueError, match=r"norm_eps_scale='embedding' is not one of \('absolute', 'init'\)"):
        tiny_config(norm_eps_scale="embedding")


@pytest.mark.parametrize("kind, eps", [("prenorm", 1e-6), ("block", 1e-12), ("full", 1e-12), ("delta", 1e-6),
                                       ("denseformer", 1e-6), ("hc", 1e-6), ("mhc", 1e-6), ("gr", 1e-6)])
def test_each_residual_kind_has_the_epsilon_found_best_for_it_unless_one_is_given(kind, eps):
    """A config without ``norm_eps`` takes its kind's default (docs/RESULTS.md, "Epsilon for every
    design"), every norm of the model takes it, and one given is kept whatever the kind."""
    config = tiny_config(residual=kind)
    assert config.norm_eps == eps and config.stream_eps == eps
    model = Transformer(config)
    assert {m.eps for m in model.modules() if isinstance(m, RMSNorm) or m is model.stream} == {eps}
    assert tiny_config(residual=kind, norm_eps=1e-5).norm_eps == 1e-5
    assert tiny_config(residual=kind, norm_eps_scale="init").norm_eps == 1e-6  # relative: the setting measured
