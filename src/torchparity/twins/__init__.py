"""Twins: property tests of two implementations of one module, the old and a refactor.

:func:`assert_twins` checks one input; :func:`check_twins` (in
:mod:`torchparity.twins.search`, it needs hypothesis) draws constructor arguments, inputs,
dtypes and backends from :mod:`torchparity.twins.strategies`, shrinks a failure to its
smallest example and prints a script that reproduces it. One module per step:
:mod:`~torchparity.twins.building` (both with the same weights),
:mod:`~torchparity.twins.running` (forward, steps and backward),
:mod:`~torchparity.twins.judging` (the verdict), :mod:`~torchparity.twins.checking` (one
check), :mod:`~torchparity.twins.reproducer` (the script), :mod:`~torchparity.twins.search`
and :mod:`~torchparity.twins.strategies` (the search), :mod:`~torchparity.twins.shell` (the
command). See docs/twins.md.
"""

from torchparity.twins.checking import TwinFailure, TwinOptions, assert_twins, check
from torchparity.twins.judging import TwinVerdict
from torchparity.twins.running import Steps

__all__ = ["Steps", "TwinFailure", "TwinOptions", "TwinVerdict", "assert_twins", "check"]
