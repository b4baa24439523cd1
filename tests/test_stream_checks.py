"""The stream protocol's checks: every design (and its decoder) refuses an embedding, an output or
an index it cannot take, and reads, writes and outputs out of order, naming what it expected;
every pass in order is accepted (docs/RELIABILITY.md, "The stream API")."""

import re

import pytest
import torch

from attnres import build_stream
from attnres.streams import Decoder

from .stream_cases import D, M, RandomSublayers, randomized


KINDS = ["prenorm", "full", "block", "delta", "hc", "mhc", "gr", "denseformer"]
ORDERED = ["full", "block", "delta", "denseformer"]  # the designs whose state records how many sublayers it holds
DECODERS = ["full", "block", "delta"]  # the designs with a decoder


def started(kind, m=3, decode=False):
    """A stream of ``kind`` and its state before sublayer 0 over an embedding ``[2, 5, D]``;
    ``decode``: what ``stream.decoder`` gives in its place (a ``Decoder`` for full, block and
    delta; call with autograd off)."""
    stream = build_stream(kind, dim=D, num_sublayers=m, **({"block_size": 2} if kind in ("block", "delta") else {}))
    e = torch.randn(2, 5, D)
    runner = stream.decoder(e) if decode else stream
    assert isinstance(runner, Decoder) == (decode and kind in DECODERS)
    return runner, runner.init(e)


@pytest.mark.parametrize("kind", KINDS)
def test_init_refuses_an_embedding_of_the_wrong_width(kind):
    stream = build_stream(kind, dim=D, num_sublayers=3)
    with pytest.raises(ValueError, match=r"init takes the embedding \[\.\.\., 12\] \(dim=12\), given \(2, 5, 8\)"):
        stream.init(torch.randn(2, 5, 8))
    with pytest.raises(ValueError, match=r"given list"):
        stream.init([1.0] * D)
    with torch.no_grad(), pytest.raises(ValueError, match=r"decoder takes the embedding \[\.\.\., 12\] \(dim=12\), "
                                                          r"given \(2, 5, 8\)"):
        stream.decoder(torch.randn(2, 5, 8))


@pytest.mark.parametrize("kind", DECODERS)
def test_a_decoder_refuses_an_embedding_it_was_not_made_for(kind):
    with torch.no_grad():
        decoder, _ = started(kind, decode=True)
        for e in (torch.randn(2, 4, D), torch.randn(2, 5, D, dtype=torch.float64), [1.0] * D):
            given = "list" if isinstance(e, list) else re.escape(f"{tuple(e.shape)} {e.dtype}")
            with pytest.raises(ValueError, match=rf"{kind} decoder: init takes the embedding it was made for, "
                                                 rf"\(2, 5, 12\) torch.float32 on cpu, given {given}"):
                decoder.init(e)


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", [(2, 5, 8), (2, 4, D), (5, D), (2, 5, 1, D)])
def test_write_refuses_an_output_of_another_shape(kind, shape, decode):
    with torch.set_grad_enabled(not decode):
        stream, state = started(kind, decode=decode)
        stream.read(state, 0)
        with pytest.raises(ValueError, match=rf"write\(0\) takes the sublayer's output \(2, 5, 12\) on cpu \(the "
                                             rf"embedding's shape and device\), given {re.escape(str(shape))} on cpu"):
            stream.write(state, 0, torch.randn(shape))


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_write_refuses_an_output_on_another_device(kind, decode):
    with torch.set_grad_enabled(not decode):
        stream, state = started(kind, decode=decode)
        with pytest.raises(ValueError, match=r"on cpu \(the embedding's shape and device\), given \(2, 5, 12\) "
                                             r"on meta"):
            stream.write(state, 0, torch.empty(2, 5, D, device="meta"))


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("index", [-1, 3, 1.0, True, "0"])
def test_read_and_write_refuse_an_index_that_is_not_a_sublayer(kind, index, decode):
    with torch.set_grad_enabled(not decode):
        stream, state = started(kind, decode=decode)
        for call in (lambda: stream.read(state, index), lambda: stream.write(state, index, torch.randn(2, 5, D))):
            with pytest.raises(ValueError, match=rf"\({re.escape(repr(index))}\) needs a sublayer index, an integer "
                                                 r"in \[0, 2\]"):
                call()


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("kind", ORDERED)
def test_reads_writes_and_output_out_of_order_are_refused(kind, decode):
    """The decoder checks as the stream does, before it changes its buffers: a refused write
    leaves the state as it was."""
    with torch.set_grad_enabled(not decode):
        stream, state = started(kind, decode=decode)
        v = torch.randn(2, 5, D)
        with pytest.raises(RuntimeError, match=r"read\(1\) out of order: the state holds no write yet, so the next "
                                               r"sublayer is 0"):
            stream.read(state, 1)
        with pytest.raises(RuntimeError, match=r"output needs all 3 sublayers written, the state holds 0"):
            stream.output(state)
        state = stream.write(state, 0, v)
        read_1 = stream.read(state, 1)
        with pytest.raises(RuntimeError, match=r"write\(0\) out of order: the state holds the writes of sublayers "
                                               r"0\.\.0, so the next sublayer is 1"):
            stream.write(state, 0, v)  # the same sublayer twice
        with pytest.raises(RuntimeError, match=r"write\(2\) out of order"):
            stream.write(state, 2, v)  # one skipped
        assert torch.equal(stream.read(state, 1), read_1)
        state = stream.write(stream.write(state, 1, v), 2, v)
        assert stream.output(state).shape == (2, 5, D)


@pytest.mark.parametrize("decode", [False, True])
@pytest.mark.parametrize("kind", KINDS)
def test_the_checks_accept_every_pass_in_order(kind, decode):
    """The checks accept what the model does: token shapes of any rank, reads repeated before a
    write; a decode pass too (autograd off)."""
    stream = randomized(build_stream(kind, dim=D, num_sublayers=M))
    with torch.set_grad_enabled(not decode):
        for e in (torch.randn(D, dtype=torch.float64), torch.randn(3, 2, 4, D, dtype=torch.float64)):
            runner = stream.decoder(e) if decode else stream
            state = runner.init(e)
            for i in range(M):
                assert torch.equal(runner.read(state, i), runner.read(state, i))
                state = runner.write(state, i, RandomSublayers()(i, runner.read(state, i)))
            assert runner.output(state).shape == e.shape
