"""torchparity: a numerical-equivalence test suite and refactoring safety net for transformers.

The public API is imported lazily: ``import torchparity`` stays cheap.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "compare": "torchparity.comparison",
    "assert_parity": "torchparity.comparison",
    "Comparison": "torchparity.comparison",
    "StructureDifference": "torchparity.comparison",
    "shared_tensors": "torchparity.comparison",
    "diagnose": "torchparity.diagnosis.pipelines.forward",
    "diagnose_against": "torchparity.diagnosis.pipelines.forward",
    "diagnose_decode": "torchparity.diagnosis.pipelines.decoding",
    "diagnose_decode_against": "torchparity.diagnosis.pipelines.decoding",
    "record_decode": "torchparity.diagnosis.pipelines.decoding",
    "attribute": "torchparity.diagnosis.pipelines.attribution",
    "record": "torchparity.diagnosis.pipelines.forward",
    "deterministic": "torchparity.train.trainer",
    "check_model": "torchparity.golden.model_check",
    "model_cells": "torchparity.golden.model_check",
    "init_weights": "torchparity.subject.weights",
    "random_tensor": "torchparity.subject.weights",
    "assert_twins": "torchparity.twins",
}
_SUBMODULES = {"backends", "tolerance", "golden", "strategies", "reference", "train", "bench",
               "twins"}

__all__ = sorted(_EXPORTS) + sorted(_SUBMODULES) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"torchparity.{name}")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'torchparity' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__
