"""Depth-weight capture, probes and the comparison report."""

from .capture import capture_analysis
from .probes import width_disagreement

__all__ = ["capture_analysis", "width_disagreement"]
