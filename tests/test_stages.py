"""A pass cut between two sublayers: the stream state split into tensors at the cut
(``split_state``), sent on as a pipeline stage sends it and joined again (``join_state``), gives
the uncut pass's logits, loss and every gradient."""

import pytest
import torch

from attnres.model import lm_loss
from attnres.streams import Decoder

from .conftest import DESIGNS, randomize_stream, tiny_model

M = 6  # tiny_model: 3 layers


def uncut(model, x, y):
    model.zero_grad()
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def cut_pass(model, x, cut, decode=False):
    """Logits of a pass run as two stages: sublayers ``0 .. cut - 1`` (``decode``: as a decode
    pass, on what ``stream.decoder`` gives), then the state as the tensors that cross the cut,
    detached (a stage boundary), then ``cut .. M - 1`` and the output. Returns the logits and
    the hop: the tensors sent and their received copies."""
    T = x.shape[1]
    cos, sin = model.rope_cos[:T], model.rope_sin[:T]
    stream, e = model.stream, model.tok_embeddings(x)
    first = stream.decoder(e) if decode else stream
    state = model.run_sublayers(first.init(e), 0, cut, cos, sin, stream=first)
    completed, rest = first.split_state(state)
    assert all(isinstance(t, torch.Tensor) for t in (*completed, *rest))
    sent = [*completed, *rest]
    received = [t.detach().requires_grad_(torch.is_grad_enabled()) for t in sent]
    state = stream.join_state(tuple(received[: len(completed)]), tuple(received[len(completed):]), cut)
    state = model.run_sublayers(state, cut, M, cos, sin)
    return model.lm_head(stream.output(state)), sent, received


@pytest.mark.parametrize("cut", [0, 1, 3, 4, M])  # the start, block edges (equal and uneven), mid-block, the output
@pytest.mark.parametrize("design", list(DESIGNS))
def test_a_pass_cut_between_sublayers_equals_the_uncut_pass(design, cut):
    model = tiny_model(design)
    randomize_stream(model)
    x = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    y = torch.roll(x, -1, 1)
    loss, grads = uncut(model, x, y)
    model.zero_grad()
    logits, sent, received = cut_pass(model, x, cut)
    cut_loss = lm_loss(logits, y)
    cut_loss.backward()  # the second stage, then the first from the gradients that came back
    back = [(s, r.grad) for s, r in zip(sent, received) if r.grad is not None and s.requires_grad]
    torch.autograd.backward([s for s, _ in back], [g for _, g in back])
    torch.testing.assert_close(cut_loss.detach(), loss, rtol=1e-6, atol=1e-6)
    assert {n for n, p in model.named_parameters() if p.grad is not None} == set(grads)
    for name, p in model.named_parameters():
        if p.grad is not None:
            torch.testing.assert_close(p.grad, grads[name], rtol=1e-5, atol=1e-6, msg=name)
    with torch.no_grad():  # the inference path prepares and scores the sources again on the far side
        torch.testing.assert_close(cut_pass(model, x, cut)[0], model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("design,completed,rest,cut,message", [
    ("prenorm", 1, 1, 2, r"prenorm stream: its state is one tensor, given 1 completed sources and 1 other tensors"),
    ("full", 2, 0, 3, r"full stream: the state before sublayer 3 is its 4 sources"),
    ("block", 1, 0, 4, r"the state before sublayer 4 holds e, 1 completed block\(s\) and a partial sum, given 0 block"),
    ("block", 2, 0, 9, r"join_state needs a sublayer index in \[0, 6\], given 9"),
])
def test_a_state_that_does_not_fit_the_cut_is_refused(design, completed, rest, cut, message):
    model = tiny_model(design)
    t = torch.zeros(1, 2, 32)
    with pytest.raises(ValueError, match=message):
        model.stream.join_state((t,) * completed, (t,) * rest, cut)


@pytest.mark.parametrize("design", ["block", "mhar-uneven", "full", "delta"])
def test_a_decode_pass_splits_as_any_other(design):
    """A decode pass of the AttnRes family (autograd off, one position per sequence) runs on the
    design's decoder; cut at every sublayer, it gives the same tensors across the cut as a pass
    of several positions (the same token twice) does at its first, and, continued by the
    stream's ordinary pass on the far side, the logits of the uncut pass."""
    model = tiny_model(design).eval()
    randomize_stream(model)
    x = torch.randint(0, 64, (2, 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert isinstance(model.stream.decoder(model.tok_embeddings(x)), Decoder)
        whole = model(x, decode=True)
        for cut in range(M + 1):
            logits, sent, _ = cut_pass(model, x, cut, decode=True)
            _, twice, _ = cut_pass(model, x.repeat(1, 2), cut)
            torch.testing.assert_close(logits, whole, atol=1e-5, rtol=1e-5)
            assert len(sent) == len(twice), (cut, len(sent), len(twice))
            for a, b in zip(sent, twice):
                torch.testing.assert_close(a, b[:, :1], atol=1e-5, rtol=1e-5)
