"""The comparison engine: verdicts and metrics for a candidate against a golden and a baseline.

:func:`compare` walks the candidate's and the golden's pytrees together (tensors and Python
numbers inside dicts, lists, tuples, namedtuples, dataclasses, Hugging Face ``ModelOutput``
objects or any container registered with ``torch.utils._pytree``), compares every tensor both
hold under the tolerance model of :mod:`torchparity.tolerance`, and reports where a tensor both
hold differs in shape, where the two differ in structure and which leaves it did not compare.
It knows nothing of models: any callable's outputs can be compared.

One module per idea: :mod:`~torchparity.comparison.structure` walks and aligns the two pytrees,
:mod:`~torchparity.comparison.groups` finds the tensors judged together,
:mod:`~torchparity.comparison.tensor` judges one tensor and
:mod:`~torchparity.comparison.verdict` gives the verdict on the whole and its explanation.
"""

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
