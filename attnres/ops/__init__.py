"""Math only: tensors in, tensors out."""

from .depth_attention import check_depth_inputs, depth_attention
from .naive import depth_attention_naive
from .rmsnorm import RMSNorm, rms, rms_norm
from .sinkhorn import sinkhorn

__all__ = [
    "RMSNorm",
    "check_depth_inputs",
    "depth_attention",
    "depth_attention_naive",
    "rms",
    "rms_norm",
    "sinkhorn",
]
