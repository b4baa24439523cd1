"""Every residual design on one protocol: ``init / read / write / output``.

``build_stream(kind, dim=..., num_sublayers=..., **options)`` makes one. A kind's options are
the keyword-only parameters of its constructor (``Stream.options()``), all with defaults; the
table summarizes them.

===========  ===============================  =========================================================
kind         design                           options
===========  ===============================  =========================================================
prenorm      PreNorm residual (baseline)      eps
full         Full AttnRes (MHAR with heads)   heads, query, score, key_norm, backend, mixing, window
block        Block AttnRes (MHAR with heads)  + block_size | num_blocks (default 8) | block_sizes,
                                              two_phase
delta        Delta AttnRes (conversion)       same as block, own_norms (for wrapping a model)
hc           Hyper-Connections (dynamic)      streams (default 4)
mhc          manifold-constrained HC          streams (default 4), sinkhorn_iterations
gr           Gated Residual                   streams (default 4), rank (default dim // 8)
denseformer  DenseFormer (depth-weighted sum) eps
===========  ===============================  =========================================================

``stream.decoder(e)`` gives what runs a decode pass (asked for explicitly, with autograd off): a
``Decoder`` of ``decode.py`` for full, block and delta on a backend that decodes, otherwise the
stream itself.
"""

from __future__ import annotations

from .attnres import DepthRoutingStream, FullAttnResStream
from .block import BlockAttnResStream, BlockState
from .base import Option, Stream, Trace, resolve_block_size, resolve_block_sizes
from .decode import Decoder
from .delta import DeltaAttnResStream, DeltaState
from .denseformer import DenseFormerStream, DenseState
from .gated import GatedResidualStream, gated_branch_mix
from .hc import HyperConnectionStream
from .mhc import ManifoldHyperConnectionStream
from .prenorm import PreNormStream

STREAMS: dict[str, type[Stream]] = {
    cls.kind: cls
    for cls in (
        PreNormStream,
        FullAttnResStream,
        BlockAttnResStream,
        DeltaAttnResStream,
        HyperConnectionStream,
        ManifoldHyperConnectionStream,
        GatedResidualStream,
        DenseFormerStream,
    )
}
KINDS = tuple(STREAMS)


def _model_options() -> dict[str, Option]:
    """Every kind's options as fields of the reference LM's config: field name -> option (one
    field for an option that several kinds take, with one default and type)."""
    fields: dict[str, Option] = {}
    for cls in STREAMS.values():
        for name, option in cls.options().items():
            if name in cls.wrapper_options:
                continue
            field = cls.config_names.get(name, name)
            if fields.setdefault(field, option) != option:
                raise TypeError(f"option {name!r} of {cls.__name__} differs from another kind's: {option} vs {fields[field]}")
    return fields


#: the residual options of the reference LM's config (``ModelConfig``), derived from the streams
MODEL_OPTIONS = _model_options()


def build_stream(kind: str, *, dim: int, num_sublayers: int, eps: float = 1e-6, **options) -> Stream:
    """Build the stream of residual design ``kind`` (one of ``KINDS``) for ``num_sublayers``
    sublayers of width ``dim``. Options a kind does not accept raise ``ValueError``."""
    if kind not in STREAMS:
        raise ValueError(f"unknown residual kind {kind!r}; expected one of {KINDS}")
    cls = STREAMS[kind]
    accepted = cls.options()
    unknown = sorted(set(options) - set(accepted))
    if unknown:
        raise ValueError(
            f"option(s) {unknown} do not apply to kind {kind!r}; it accepts {list(accepted) or 'none'}"
        )
    return cls(dim, num_sublayers, eps, **options)


__all__ = [
    "KINDS",
    "MODEL_OPTIONS",
    "STREAMS",
    "BlockAttnResStream",
    "BlockState",
    "Decoder",
    "DeltaAttnResStream",
    "DeltaState",
    "DenseFormerStream",
    "DenseState",
    "DepthRoutingStream",
    "FullAttnResStream",
    "GatedResidualStream",
    "HyperConnectionStream",
    "ManifoldHyperConnectionStream",
    "Option",
    "PreNormStream",
    "Stream",
    "Trace",
    "build_stream",
    "gated_branch_mix",
    "resolve_block_size",
    "resolve_block_sizes",
]
