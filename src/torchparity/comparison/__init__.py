"""The comparison engine: verdicts and metrics for a candidate against a golden and a baseline.

:func:`compare` walks the two pytrees together (``.structure``), finds the tensors judged
together (``.groups``), judges each tensor under :mod:`torchparity.tolerance` (``.tensor``)
and gives the verdict on the whole (``.verdict``). It knows nothing of models."""

from torchparity.comparison.structure import (
    CACHE_RULE,
    ShapeDifference,
    StructureDifference,
    StructureMismatch,
    shared_tensors,
)
from torchparity.comparison.tensor import RELATIVE_GUARD, TensorComparison, Verdict
from torchparity.comparison.verdict import NOT_COMPARED, Comparison, assert_parity, compare

__all__ = [
    "CACHE_RULE",
    "NOT_COMPARED",
    "RELATIVE_GUARD",
    "Comparison",
    "ShapeDifference",
    "StructureDifference",
    "StructureMismatch",
    "TensorComparison",
    "Verdict",
    "assert_parity",
    "compare",
    "shared_tensors",
]
