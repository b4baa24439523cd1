"""Math only: tensors in, tensors out."""

from .depth_attention import (
    BACKENDS,
    check_depth_inputs,
    depth_attention,
    merge,
    merge_and_norm,
    multi_query_attention,
    resolve_backend,
)
from .fused import depth_attention_multi, inverse_rms
from .naive import depth_attention_naive
from .scored import mix_scored, source_scores
from .two_phase import merge_norm, merge_partial
from .rmsnorm import RMSNorm, rms, rms_norm
from .sinkhorn import sinkhorn

__all__ = [
    "BACKENDS",
    "RMSNorm",
    "depth_attention_multi",
    "merge",
    "merge_and_norm",
    "merge_norm",
    "merge_partial",
    "mix_scored",
    "multi_query_attention",
    "resolve_backend",
    "check_depth_inputs",
    "depth_attention",
    "depth_attention_naive",
    "inverse_rms",
    "rms",
    "rms_norm",
    "sinkhorn",
    "source_scores",
]
