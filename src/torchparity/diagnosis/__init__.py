"""Divergence diagnosis: capture A, make its float64 golden, align B with A, judge, replay, report.

The public entry points (``tp.diagnose``, ``tp.record``, ...) live in :mod:`.api`.
"""
