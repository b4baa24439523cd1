"""Math only: tensors in, tensors out. The one face the rest of the package imports.

- ``depth_attention``: one read over depth, on the backend ``pick`` chooses;
  ``depth_attention_naive`` is the reference it is tested against.
- ``DepthRouter`` / ``RoutingMemo``: how a stream routes (``ops.routing``).
- ``BACKENDS``, ``backend``, ``pick``: the registry of backends (``ops.registry``), each one's
  operations a ``BackendOps``.
- ``weighted_depth_sum``, ``static_depth_weights``: reads whose depth weights do not depend on
  the data (DenseFormer, Full's learned mixing; ``ops.depth_mix``).
- ``RMSNorm``, ``rms_norm``, ``rms_norm_project``, ``rms``, ``sinkhorn``: the other math of the streams.
"""

from .backends import BackendOps
from .backends.naive import depth_attention_naive
from .depth_attention import check_depth_inputs, depth_attention
from .depth_mix import static_depth_weights, weighted_depth_sum
from .registry import BACKENDS, NAMES, SCORES, Backend, Request, get, pick
from .rmsnorm import RMSNorm, RMSNormFunction, rms, rms_norm, rms_norm_project
from .routing import DepthRouter, RoutingMemo
from .sinkhorn import sinkhorn


def backend(name: str) -> BackendOps:
    """The operations of backend ``name`` (``ops.backends.BackendOps``)."""
    return get(name).ops


__all__ = [
    "BACKENDS",
    "NAMES",
    "SCORES",
    "Backend",
    "BackendOps",
    "DepthRouter",
    "RMSNorm",
    "RMSNormFunction",
    "Request",
    "RoutingMemo",
    "backend",
    "check_depth_inputs",
    "depth_attention",
    "depth_attention_naive",
    "pick",
    "rms",
    "rms_norm",
    "rms_norm_project",
    "sinkhorn",
    "static_depth_weights",
    "weighted_depth_sum",
]
