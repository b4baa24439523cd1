"""Mixture-of-experts sublayers: the sorted dispatch against its per-expert twin, capacity,
balance loss and bias, the model, training and its log."""

import json
import math
from dataclasses import replace

import pytest
import torch

from attnres.model import ModelConfig, Transformer, lm_loss
from attnres.moe import MoE, ExpertStats, capacity_of, expert_load, moe_naive, expert_swiglu
from attnres.train.config import apply_override, tiny
from attnres.train.trainer import train

D, E, H = 16, 4, 24


def moe(**kw) -> MoE:
    torch.manual_seed(0)
    m = MoE(D, kw.pop("experts", E), kw.pop("top_k", 2), H, **kw).double()
    for p in m.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return m


def tokens(n=40, seed=1):
    return torch.randn(2, n // 2, D, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))


CASES = {
    "top1": dict(top_k=1),
    "top2": dict(top_k=2),
    "top2-shared": dict(top_k=2, shared_experts=2),
    "top3-unnormalized": dict(top_k=3, normalize_top_k=False),
    "ample-capacity": dict(top_k=2, capacity=2.0),
    "tight-capacity": dict(top_k=2, capacity=0.5, shared_experts=1),
    "bias": dict(top_k=2, balance="bias"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_sorted_dispatch_equals_the_per_expert_loop_forward_and_gradients(case):
    m = moe(**CASES[case])
    if m.balance == "bias":
        m.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1], dtype=torch.float64))
    m.train()
    x = tokens().requires_grad_()
    outs, grads, stats = [], [], []
    for fn in (m.forward, lambda x, s: moe_naive(m, x, s)):
        m.zero_grad()
        x.grad = None
        s = ExpertStats()
        y = fn(x, s)
        (y * torch.linspace(-1, 1, y.numel(), dtype=y.dtype).view_as(y)).sum().backward()
        outs.append(y.detach())
        grads.append({"x": x.grad.clone(), **{n: p.grad.clone() for n, p in m.named_parameters()}})
        stats.append(s)
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-12, atol=1e-12)
    assert set(grads[0]) == set(grads[1])
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], rtol=1e-12, atol=1e-12, msg=name)
    assert torch.equal(stats[0].load(), stats[1].load())
    assert [float(d) for d in stats[0].dropped] == [float(d) for d in stats[1].dropped]
    if m.capacity:
        assert stats[0].dropped and (float(stats[0].dropped[0]) > 0) == (case == "tight-capacity")


def test_capacity_keeps_the_first_tokens_in_order_and_only_in_training():
    """Every token prefers expert 0 (top-1): with capacity 1.0, 8 tokens and 4 experts, expert 0
    takes ceil(1.0 * 8 / 4) = 2 tokens, the first two; the rest add nothing. In evaluation none is
    dropped."""
    m = moe(top_k=1, capacity=1.0)
    with torch.no_grad():
        m.gate.weight.zero_()
        m.gate.weight[0, 0] = 50.0
    x = torch.randn(1, 8, D, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[..., 0] = 1.0  # expert 0's logit is 50 for every token
    own = expert_swiglu(x[0], m.w1[0], m.w3[0], m.w2[0])  # gate weight p_0 = 1 - 3e-22: 1 in fp64
    assert capacity_of(1.0, 8, 4) == 2
    m.train()
    stats = ExpertStats()
    y = m(x, stats)[0]
    torch.testing.assert_close(y[:2], own[:2])
    assert torch.equal(y[2:], torch.zeros_like(y[2:]))
    assert float(stats.dropped[0]) == 6 and stats.load()[0].tolist() == [8, 0, 0, 0]
    m.eval()
    torch.testing.assert_close(m(x)[0], own)


def test_balance_loss_is_one_when_the_router_is_uniform_and_follows_its_equation():
    m = moe(top_k=2)
    with torch.no_grad():
        m.gate.weight.zero_()
    stats = ExpertStats()
    m(tokens(), stats)
    assert stats.aux[0].detach().item() == pytest.approx(1.0, abs=1e-12)  # E * sum_e f_e / E, whatever the choice
    # written out: E * sum_e f_e P_e for random routing
    m = moe(top_k=2)
    stats = ExpertStats()
    x = tokens().reshape(-1, D)
    m(x, stats)
    p = torch.softmax(x @ m.gate.weight.detach().T, -1)
    chosen = p.topk(2, -1).indices
    f = torch.stack([(chosen == e).sum() for e in range(E)]).double() / chosen.numel()
    assert stats.aux[0].detach().item() == pytest.approx(float(E * (f * p.mean(0)).sum()), rel=1e-12)
    assert stats.load().sum() == chosen.numel()
    assert expert_load(stats.load()).sum().item() == pytest.approx(1.0)


def test_the_bias_chooses_experts_but_not_their_weights():
    m = moe(top_k=1, normalize_top_k=False, balance="bias")
    x = tokens()
    probs = torch.softmax(x @ m.gate.weight.T, -1)
    m.expert_bias[3] = 10.0  # every token now chooses expert 3, weighted by its own probability
    y = m(x)
    expected = expert_swiglu(x.reshape(-1, D), m.w1[3], m.w3[3], m.w2[3]) * probs.reshape(-1, E)[:, 3:]
    torch.testing.assert_close(y.reshape(-1, D), expected)
    m.expert_bias.zero_()
    m.bias_rate = 0.1
    m.update_bias(torch.tensor([3.0, 1.0, 2.0, 2.0]))  # mean 2: over-loaded down, under-loaded up
    assert m.expert_bias.tolist() == pytest.approx([-0.1, 0.1, 0.0, 0.0])
    # a bf16 model keeps an fp32 bias, whose small steps still add up past 0.25
    m = MoE(D, E, 2, H, balance="bias").to(torch.bfloat16)
    for _ in range(400):
        m.update_bias(torch.tensor([5.0, 1.0, 1.0, 1.0]))
    assert m.expert_bias.dtype == torch.float32 and m.w1.dtype == torch.bfloat16
    assert m.expert_bias.tolist() == pytest.approx([-0.4, 0.4, 0.4, 0.4], abs=1e-4)


def test_top_k_routing_follows_its_equation_token_by_token():
    """Each token on its own: y = sum over its top-k experts of p_e / sum(p_top-k) * expert_e(x)
    (normalized for k = 2), and p_e alone for k = 1, whose router then still learns from the
    output; both dispatches get the router a gradient."""
    for k in (1, 2):
        m = moe(top_k=k)
        x = tokens(n=12).reshape(-1, D)
        y = m(x)
        for n in range(x.shape[0]):
            p = torch.softmax(m.gate.weight.detach() @ x[n], -1)
            top = p.topk(k).indices
            g = p[top] / p[top].sum() if k > 1 else p[top]
            expected = sum(g[j] * expert_swiglu(x[n : n + 1], m.w1[e], m.w3[e], m.w2[e])[0] for j, e in enumerate(top))
            torch.testing.assert_close(y[n], expected, rtol=1e-12, atol=1e-12)
        for fn in (m.forward, lambda x: moe_naive(m, x)):
            m.zero_grad()
            fn(x).pow(2).sum().backward()
            assert m.gate.weight.grad.abs().max() > 1e-3


def moe_config(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=64, dim=32, n_layers=2, n_heads=2, max_seq_len=64, residual="block",
                                 num_blocks=2, moe_experts=4, moe_top_k=2, moe_hidden=40), **kw})


def test_model_loss_adds_the_weighted_balance_loss_and_generation_equals_the_forward():
    torch.manual_seed(0)
    model = Transformer(moe_config(moe_shared_experts=1, moe_aux_weight=0.5, moe_capacity=1.0)).eval()
    x = torch.randint(0, 64, (2, 24), generator=torch.Generator().manual_seed(0))
    stats = ExpertStats()
    logits = model(x, experts=stats)
    assert len(stats.aux) == 2 and stats.load().shape == (2, 4)
    assert torch.equal(model.loss(x, x), lm_loss(logits, x) + 0.5 * torch.stack(stats.aux).mean())
    out = model.generate(x[:, :5], 12)
    for t in range(5, 17):  # greedy with the KV cache = argmax of the whole prefix, no cache
        assert torch.equal(out[:, t], model(out[:, :t])[:, -1].argmax(-1))


def test_a_dense_model_is_unchanged_by_the_moe_options():
    """The MoE fields' defaults build a dense SwiGLU model: no router, no experts, no balance loss."""
    torch.manual_seed(0)
    dense = Transformer(moe_config(moe_experts=0, moe_hidden=None))
    names = [n for n, _ in dense.named_parameters()]
    assert "layers.0.mlp.w1.weight" in names and not any("gate" in n or "expert" in n for n in names)
    assert dense.moe_layers() == [] and dense.moe_aux_loss(ExpertStats()) == 0.0


@pytest.mark.parametrize("fields,message", [
    (dict(moe_top_k=5), r"moe_top_k=5 must be an integer in \[1, moe_experts=4\]"),
    (dict(moe_balance="loss"), r"moe_balance='loss' is not one of \('aux', 'bias'\)"),
    (dict(moe_bias_rate=0.1), r"moe_bias_rate=0.1 does not apply to moe_balance='aux'"),
    (dict(moe_balance="bias", moe_aux_weight=0.1), r"moe_aux_weight=0.1 does not apply to moe_balance='bias'"),
    (dict(moe_experts=0, moe_top_k=1, moe_hidden=None), r"moe_top_k=1 applies to mixture-of-experts models only"),
    (dict(moe_experts=-1), r"moe_experts=-1 must be an integer >= 0"),
])
def test_bad_moe_options_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        moe_config(**fields)


@pytest.mark.parametrize("assignment,message", [
    ("model.moe_capacity=-1", r"moe_capacity=-1.0 must be a finite number >= 0"),
    ("model.moe_hidden=0", r"moe_hidden=0 must be an integer >= 1 or None"),
    ("model.moe_aux_weight=nan", r"moe_aux_weight=nan must be a finite number >= 0"),
    ("model.moe_shared_experts=-1", r"moe_shared_experts=-1 must be an integer >= 0"),
    ("model.moe_top_k=0", r"moe_top_k=0 must be an integer >= 1"),
])
def test_moe_ranges_are_checked_before_any_work(assignment, message):
    cfg = apply_override(tiny(), "model.moe_experts=2")
    with pytest.raises(ValueError, match=message):
        apply_override(cfg, assignment)
    with pytest.raises(ValueError, match=r"capacity=-0.5 must be a finite number >= 0"):
        MoE(D, 4, 2, H, capacity=-0.5)


@pytest.mark.parametrize("balance", ["aux", "bias"])
def test_training_logs_the_expert_load_and_moves_the_bias(tmp_path, balance):
    cfg = tiny()
    for a in ("model.moe_experts=4", f"model.moe_balance={balance}", "model.moe_capacity=1.0"):
        cfg = apply_override(cfg, a)
    cfg = replace(cfg, run=replace(cfg.run, steps=4, log_every=1, grad_accum=2, progress=False,
                                   tensorboard=balance == "aux"))
    result = train(cfg, tmp_path)
    if balance == "aux":  # TensorBoard holds the same load, one scalar per layer and expert
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tensorboard"))
        events.Reload()
        last = json.loads((tmp_path / "metrics.jsonl").read_text().splitlines()[-2])  # step 4's train row
        assert [e.value for e in events.Scalars("train/expert_load/layer1/expert2")][-1] == pytest.approx(
            last["expert_load"][1][2], abs=1e-6)
        assert len(events.Scalars("train/expert_imbalance")) == 4
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if r["split"] == "train"]
    assert len(train_rows) == 4
    for r in train_rows:
        assert len(r["expert_load"]) == 2 and all(len(row) == 4 for row in r["expert_load"])
        assert all(sum(row) == pytest.approx(1.0, abs=1e-5) for row in r["expert_load"])
        assert 1.0 <= r["expert_imbalance"] <= 4.0 and 0.0 <= r["expert_dropped"] < 1.0
        assert 0 < r["moe_aux_loss"] <= 4.0 and math.isfinite(r["loss"])  # E sum f P <= E max P <= E
    bias = torch.stack([m.expert_bias for m in result.model.moe_layers()])
    if balance == "bias":  # four steps of +-rate or 0: the bias moved, by multiples of the rate
        steps = bias / cfg.model.moe_bias_rate
        assert (bias != 0).any() and torch.allclose(steps, steps.round(), atol=1e-3)
    else:
        assert torch.equal(bias, torch.zeros_like(bias))
