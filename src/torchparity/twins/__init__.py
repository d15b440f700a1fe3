"""Twins: property tests of two implementations of one module, the old and a refactor.

:func:`assert_twins` checks one input; :func:`torchparity.twins.search.check_twins` (needs
hypothesis) draws examples and shrinks a failure to a reproducer. See docs/twins.md.
"""

from torchparity.twins.checking import TwinFailure, TwinOptions, assert_twins, check
from torchparity.twins.judging import TwinVerdict
from torchparity.twins.running import Steps

__all__ = ["Steps", "TwinFailure", "TwinOptions", "TwinVerdict", "assert_twins", "check"]
