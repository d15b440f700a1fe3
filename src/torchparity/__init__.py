"""torchparity: a numerical-equivalence test suite and refactoring safety net for transformers.

The public API is imported lazily so that ``import torchparity`` stays cheap and each part
loads only what it needs.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "compare": "torchparity.compare",
    "assert_parity": "torchparity.compare",
    "Comparison": "torchparity.compare",
    "diagnose": "torchparity.diagnose",
    "diagnose_against": "torchparity.diagnose",
    "diagnose_decode": "torchparity.diagnose",
    "attribute": "torchparity.diagnose",
    "record": "torchparity.diagnose",
    "deterministic": "torchparity.train",
}
_SUBMODULES = {"backends", "tolerance", "golden", "strategies", "reference", "train", "bench"}

__all__ = sorted(_EXPORTS) + sorted(_SUBMODULES) + ["__version__"]


def __getattr__(name: str) -> Any:
    if name in _SUBMODULES:
        return importlib.import_module(f"torchparity.{name}")
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'torchparity' has no attribute {name!r}")


def __dir__() -> list[str]:
    return __all__


class _Package(types.ModuleType):
    """``tp.compare`` and ``tp.diagnose`` are functions living in modules of the same name.

    Importing such a submodule would rebind the package attribute to the module; this keeps the
    function (modules stay reachable through ``from torchparity.compare import ...``).
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
