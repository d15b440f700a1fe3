"""The property search: many twin checks on drawn examples, a failure shrunk to its smallest.

:func:`check_twins` draws the module's constructor arguments, an example of its inputs, a
dtype and a backend, and runs :func:`~torchparity.twins.checking.assert_twins` on each. On a
failure hypothesis shrinks the example and raises the smallest one's ``AssertionError``: the
verdict's explanation and a standalone reproducer. Examples that failed are kept in
hypothesis' database (``.hypothesis/`` by default), under a key of the two implementations
and the caller's ``database_key``, and tried first on the next run.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from torch import nn

from torchparity.threads import single_thread
from torchparity.twins.building import Buildable, WeightMap
from torchparity.twins.checking import CacheFactory, assert_twins
from torchparity.twins.strategies import Range, TwinInputs, constructor_args

InputsStrategy = SearchStrategy[TwinInputs] | Callable[[dict], SearchStrategy[TwinInputs]]


def check_twins(old: Buildable, new: Buildable, *, inputs: InputsStrategy,
                init: Mapping[str, Range] | None = None, dtypes: Sequence[str] = ("fp32",),
                backends: Sequence[str | None] = (None,), weight_map: WeightMap | None = None,
                cache: CacheFactory | tuple[CacheFactory, CacheFactory] | None = None,
                grads: bool = True, max_examples: int = 100, device: str = "cpu",
                database_key: str = "") -> int:
    """Check ``new`` against ``old`` on drawn examples and return how many passed;
    ``AssertionError`` for the smallest failing one, with its explanation and reproducer.

    ``init`` gives the constructor arguments' ranges (see
    :func:`~torchparity.twins.strategies.constructor_args`); ``inputs`` is a strategy of
    :class:`~torchparity.twins.strategies.TwinInputs` (or of plain inputs), or a function of
    the drawn constructor arguments that returns one
    (``lambda a: attention_inputs(a["d_model"])``).
    Each example draws a dtype from ``dtypes``, a backend from ``backends`` (None: the modules
    as written) and a weight seed; everything runs on ``device``. ``max_examples`` is
    hypothesis' own default, whatever the profile (which sets the rest: seeds, the database);
    the other arguments are
    :func:`~torchparity.twins.assert_twins`'s.
    """
    passed = 0

    def one_example(data: st.DataObject) -> None:
        nonlocal passed
        arguments = data.draw(constructor_args(**(init or {})), label="init")
        strategy = inputs(arguments) if callable(inputs) else inputs
        example = data.draw(strategy, label="inputs")
        if not isinstance(example, TwinInputs):  # a strategy of plain inputs
            example = TwinInputs(example)
        dtype = data.draw(st.sampled_from(list(dtypes)), label="dtype")
        backend = data.draw(st.sampled_from(list(backends)), label="backend")
        seed = data.draw(st.integers(0, 2**16), label="weight seed")
        assert_twins(old, new, example.inputs, dtype=dtype, backend=backend, init=arguments,
                     seed=seed, weight_map=weight_map, grads=grads, padding=example.padding,
                     cache=cache, device=device)
        passed += 1

    # Without this every caller's search would share one database key (this function's).
    key = f"{_name(old)} {_name(new)} {database_key}"
    one_example._hypothesis_internal_add_digest = key.encode()
    options: dict[str, Any] = dict(deadline=None, max_examples=max_examples,
                                   suppress_health_check=[HealthCheck.too_slow,
                                                          HealthCheck.data_too_large])
    with single_thread():
        given(data=st.data())(settings(settings.default, **options)(one_example))()
    return passed


def _name(side: Any) -> str:
    """A class's or factory's dotted name (a module instance's class's)."""
    kind = type(side) if isinstance(side, nn.Module) else side
    return f"{getattr(kind, '__module__', '')}.{getattr(kind, '__qualname__', repr(kind))}"
