"""What the report needs from a trained model, captured on validation tokens."""

from __future__ import annotations

import torch

from ..model import Transformer
from ..moe import ExpertStats, expert_load
from ..streams import Trace
from .probes import width_disagreement


@torch.no_grad()
def capture_analysis(model: Transformer, tokens: torch.Tensor) -> dict:
    """Depth weights (mean over tokens, ``[N_sources][heads]`` per site), the RMS of each read's
    hidden state (mean over tokens, per site; the last site is the output), the width probe, and
    for an MoE model the expert load (fraction of assignments per expert, ``[L][E]``; else None).

    ``tokens`` ``[B, T]``: validation inputs.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    trace, experts = Trace(), ExpertStats()
    model(tokens, trace=trace, experts=experts)
    M = model.config.num_sublayers
    out = {
        "num_sublayers": M,
        "depth_weights": {
            str(site): w.float().mean(dim=tuple(range(1, w.ndim - 1))).tolist()
            for site, w in sorted(trace.depth_weights.items())
        },
        "read_rms": [float(trace.read_rms[i].float().mean()) for i in range(M + 1) if i in trace.read_rms],
        "width_probe": width_disagreement(model, tokens),
        "expert_load": expert_load(experts.load()).tolist() if experts.counts else None,
    }
    model.train(was_training)
    return out
