"""attnres: Attention Residuals and every residual design they are compared with, on one
stream protocol, with a reference decoder LM."""

from .model import KVCache, ModelConfig, Transformer, param_groups
from .moe import ExpertStats, MoE
from .ops import depth_attention
from .streams import KINDS, Stream, Trace, build_stream

__version__ = "0.1.0"

__all__ = [
    "ExpertStats",
    "KINDS",
    "KVCache",
    "ModelConfig",
    "MoE",
    "Stream",
    "Trace",
    "Transformer",
    "build_stream",
    "depth_attention",
    "param_groups",
]
