"""Experiments above the engine: comparisons of designs on the same data and seeds, sweeps of
them over a setting, the designs' parser, each design's step timed against the baseline's, a
comparison --from a folder's control and conversions, and the downstream evaluation of a
comparison (its modules imported by name)."""
