"""What the stream tests share: the width and depth they drive, random sublayers whose outputs
depend on their reads, a driver through the stream protocol, and parameters moved off their init."""

import torch


D, M = 12, 7


class RandomSublayers:
    """Deterministic nonlinear sublayers v_i = tanh(x_i @ W_i) so that outputs depend on reads."""

    def __init__(self, dim=D, m=M, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.weights = [torch.randn(dim, dim, generator=g, dtype=torch.float64) for _ in range(m)]

    def __call__(self, i, x):
        return torch.tanh(x @ self.weights[i]) * 2


def run(stream, e, sublayers, m=M, trace=None):
    """Drive a stream through the protocol; returns every read, the output, and the states."""
    reads, states = [], []
    state = stream.init(e)
    for i in range(m):
        states.append(state)
        x = stream.read(state, i, trace)
        reads.append(x)
        state = stream.write(state, i, sublayers(i, x))
    states.append(state)
    return reads, stream.output(state, trace), states


def randomized(stream, seed=3):
    stream = stream.double()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in stream.parameters():
            p.add_(0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return stream
