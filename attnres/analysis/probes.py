"""The MHAR "width disagreement" probe (docs/METHOD.md section 10).

Split a trained single-head pseudo-query into ``slices`` slices of the width; give each slice
its own depth softmax over the same (normalized) sources; measure the mean
``KL(slice || shared)``. Do the same for a random query of equal norm; the probe is the
difference. A large value says the width would rather route differently in different slices,
which is what multi-head routing allows.
"""

from __future__ import annotations

import torch

from ..model import Transformer
from ..ops import depth_attention_naive
from ..streams import DepthRoutingStream, Trace


def mean_slice_kl(query, gain, sources, slices, eps) -> float:
    """``mean over slices and tokens of KL(slice s || shared)``: the depth weights of ``query``
    ``[D]`` over ``sources`` (``N x [..., D]``, keys RMS-normalized with ``gain``) when each of
    ``slices`` slices of the width routes alone (multi-head), against one softmax for the whole
    width (single-head)."""
    shared = depth_attention_naive(query, sources, gain, heads=1, eps=eps, return_weights=True)[1]  # [N, ..., 1]
    sliced = depth_attention_naive(query, sources, gain, heads=slices, eps=eps, return_weights=True)[1]  # [N, ..., S]
    tiny = torch.finfo(sliced.dtype).tiny
    kl = (sliced * (sliced.clamp_min(tiny).log() - shared.clamp_min(tiny).log())).sum(0)  # [..., S]
    return float(kl.mean())


@torch.no_grad()
def width_disagreement(model: Transformer, tokens: torch.Tensor, slices: int = 4, seed: int = 0) -> dict | None:
    """``{"trained": KL, "random": KL, "probe": trained - random}`` averaged over routing sites,
    or None when the model is not single-head AttnRes with pseudo-queries (or ``slices`` does not
    divide the width)."""
    stream = model.stream
    if (not isinstance(stream, DepthRoutingStream) or stream.heads != 1 or stream.query != "static"
            or stream.pseudo_queries is None):  # learned mixing has no query to slice
        return None
    if model.config.dim % slices:
        return None
    trace = Trace(keep_sources=True)
    model(tokens, trace=trace)
    g = torch.Generator().manual_seed(seed)
    trained, random = [], []
    for site, sources in sorted(trace.sources.items()):
        if len(sources) < 2:  # a single source has nothing to disagree about
            continue
        query = stream.pseudo_queries[site].float()
        gain = stream.key_gains[site].float() if stream.key_gains is not None else None
        noise = torch.randn(query.shape, generator=g)
        noise = noise * query.norm() / noise.norm().clamp_min(1e-12)
        trained.append(mean_slice_kl(query, gain, sources, slices, stream.eps))
        random.append(mean_slice_kl(noise, gain, sources, slices, stream.eps))
    if not trained:
        return None
    t, r = sum(trained) / len(trained), sum(random) / len(random)
    return {"trained": t, "random": r, "probe": t - r, "slices": slices}
