"""The ablation table's switches: the input-dependent query scaled (``query_scale``) and gated
(``query_gate``), and a window's output routing over every source (``window_output``), each
against an independent oracle."""

import pytest
import torch

from attnres import Transformer
from attnres.streams import Trace
from attnres.experiments.designs import parse_design

from .conftest import cli_in_process, randomize_stream, tiny_config


def depth_weights(model, tokens) -> list[torch.Tensor]:
    """Each routing site's depth weights ``[sources, B, T, H]``, sublayers then the output."""
    _, weights = model(tokens, return_depth_weights=True)
    return [weights[site] for site in sorted(weights)]


def tokens(seed=0):
    return torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(seed))


def twin(config, source, **changes):
    """A model of ``config`` with ``changes`` holding ``source``'s parameters (those it has)."""
    torch.manual_seed(0)
    model = Transformer(tiny_config(**{**config, **changes}))
    mine = model.state_dict()
    model.load_state_dict({k: v for k, v in source.state_dict().items() if k in mine}, strict=False)
    return model


def test_a_gated_input_query_at_gate_zero_routes_as_the_static_query_whatever_its_projection():
    config = dict(residual="full", query="input", query_gate=True)
    torch.manual_seed(0)
    gated = Transformer(tiny_config(**config))
    randomize_stream(gated)
    with torch.no_grad():
        gated.stream.query_gates.zero_()
        gated.stream.query_proj.normal_(0, 3.0)  # a projection far from zero
    static = twin(config, gated, query="static", query_gate=False)
    x = tokens()
    for site, (a, b) in enumerate(zip(depth_weights(gated, x), depth_weights(static, x))):
        assert torch.allclose(a, b, atol=1e-6), site
    assert torch.allclose(gated(x), static(x), atol=1e-5)


def test_the_rsqrt_scale_divides_the_input_term_by_the_root_of_the_head_width():
    config = dict(residual="full", query="input", heads=2)
    torch.manual_seed(0)
    scaled = Transformer(tiny_config(**config, query_scale="rsqrt"))
    randomize_stream(scaled)
    plain = twin(config, scaled, query_scale="off")
    with torch.no_grad():  # the same term written out: W / sqrt(D / H), D = 32, H = 2
        plain.stream.query_proj.copy_(scaled.stream.query_proj / 4.0)
    x = tokens(1)
    for a, b in zip(depth_weights(scaled, x), depth_weights(plain, x)):
        assert torch.allclose(a, b, atol=1e-6)


def test_a_windows_output_over_every_source_keeps_the_windows_reads_and_routes_the_output_as_full():
    """At every sublayer the window's weights; at the output Full's routing over every source,
    written out: ``softmax_j(w_M . (k_M * v_j / sqrt(mean(v_j^2) + eps)))``."""
    window = dict(residual="full", window=2)
    torch.manual_seed(0)
    every = Transformer(tiny_config(**window, window_output="all"))
    randomize_stream(every)
    windowed = twin(window, every, window_output="window")
    x = tokens(2)
    a, b = depth_weights(every, x), depth_weights(windowed, x)
    M = every.config.num_sublayers
    assert M > 2 + 1  # the window binds at the later sites and the output
    for site in range(M):
        assert torch.equal(a[site], b[site]), site
    trace = Trace(keep_sources=True)
    every(x, trace=trace)
    sources = torch.stack(trace.sources[M])  # [M + 1, B, T, D]: e and every output
    assert sources.shape[0] == M + 1
    stream = every.stream
    keys = stream.key_gains[M] * sources * torch.rsqrt(sources.pow(2).mean(-1, keepdim=True) + stream.eps)
    expected = torch.softmax(keys @ stream.pseudo_queries[M], dim=0)  # [M + 1, B, T]
    assert torch.allclose(a[M][..., 0], expected, atol=1e-5)
    assert not torch.allclose(a[M], b[M], atol=1e-3)  # the window's own output reads fewer


def test_the_gate_and_the_projection_both_learn():
    config = tiny_config(residual="full", query="input", query_gate=True)
    torch.manual_seed(0)
    model = Transformer(config)
    assert model.stream.query_proj.abs().max() > 0 and model.stream.query_gates.abs().max() == 0
    start = model.stream.query_proj.detach().clone()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for k in range(3):
        x = tokens(10 + k)
        opt.zero_grad()
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
    # site 0 reads e alone: a softmax over one source takes no gradient; every other site learns
    gates, proj = model.stream.query_gates.detach(), model.stream.query_proj.detach()
    assert gates[1:].abs().min() > 0
    assert all(not torch.equal(proj[site], start[site]) for site in range(1, len(gates)))


@pytest.mark.parametrize("assignment,message", [
    ("model.query_gate=true", "query_gate=True applies to the input-dependent query (query='input')"),
    ("model.query_scale=rsqrt", "query_scale='rsqrt' applies to the input-dependent query"),
    ("model.window_output=all", "window_output='all' says what a window's output routing reads"),
])
def test_a_switch_where_it_does_not_apply_is_refused_by_name(assignment, message):
    out = cli_in_process("train", "--preset", "tiny", "--set", "model.residual=full", "--set", assignment)
    assert out.returncode == 2 and message in out.stderr, out.stderr


def test_the_switches_are_design_options():
    assert parse_design("full:query=input:query_gate=true:query_scale=rsqrt") == (
        "full", {"query": "input", "query_gate": True, "query_scale": "rsqrt"})
    assert parse_design("full:window=2:window_output=all") == ("full", {"window": 2, "window_output": "all"})


def test_a_variants_optimizer_field_reaches_its_runs_only():
    from attnres.experiments.compare import plan_comparison
    from attnres.train.config import tiny

    plan = plan_comparison(tiny(), ["full", "full:query=input:query_lr_scale=0.1"], [0], {}, None)
    assert plan.run_config("full", 0).optim.query_lr_scale == 1.0
    scaled = plan.run_config("full:query=input:query_lr_scale=0.1", 0)
    assert scaled.optim.query_lr_scale == 0.1 and scaled.model.query == "input"
    with pytest.raises(ValueError, match=r"'query_lr_scale' is not an option of 'prenorm'"):
        plan_comparison(tiny(), ["prenorm:query_lr_scale=0.1"], [0], {}, None)


@pytest.mark.slow
def test_the_switches_compare_side_by_side(tmp_path):
    designs = ["full", "full:query=input:query_gate=true", "full:query=input:query_scale=rsqrt",
               "full:query=input:query_lr_scale=0.1", "full:window=2:window_output=all"]
    out = cli_in_process("compare", "--preset", "tiny", "--set", "run.progress=false", "--set", "run.tensorboard=false",
                         "--designs", *designs, "--seeds", "0", "1", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    import json

    results = json.loads(next(tmp_path.glob("compare-*/results.json")).read_text())
    assert set(results["designs"]) == set(designs)
    config = json.loads(next(tmp_path.glob("compare-*/full+query=input+query_lr_scale=0.1-seed0/config.json")).read_text())
    assert config["optim"]["query_lr_scale"] == 0.1
