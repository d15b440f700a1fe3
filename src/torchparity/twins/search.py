"""The property search: many twin checks on drawn examples, a failure shrunk to its smallest.

Examples that failed are kept in hypothesis' database (``.hypothesis/``), keyed by the two
implementations and ``database_key``, and tried first on the next run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.strategies import SearchStrategy
from torch import nn

from torchparity.threads import single_thread
from torchparity.twins.building import Buildable
from torchparity.twins.checking import TwinOptions, assert_twins
from torchparity.twins.strategies import TwinInputs, constructor_args

InputsStrategy = SearchStrategy[TwinInputs] | Callable[[dict], SearchStrategy[TwinInputs]]


def check_twins(old: Buildable, new: Buildable, *, inputs: InputsStrategy,
                options: TwinOptions | None = None, dtypes: Sequence[str] = ("fp32",),
                backends: Sequence[str | None] = (None,), max_examples: int = 100,
                database_key: str = "", **keywords: object) -> int:
    """Check ``new`` against ``old`` on drawn examples; how many passed, else the smallest failure.

    Each example draws constructor arguments from ``init``'s ranges, an example of ``inputs``, a
    dtype, a backend (None: as written) and a weight seed, and runs :func:`assert_twins` on it.

    Args:
        old, new: the two implementations (modules, classes or factories).
        inputs: a strategy of ``TwinInputs`` (or of plain inputs), or a function of the drawn
            constructor arguments returning one (``lambda a: attention_inputs(a["d_model"])``).
        options: a :class:`~torchparity.twins.TwinOptions` whose ``init`` holds ranges; keywords
            (``init=``, ``weight_map=``) replace its fields.
        dtypes: the dtypes drawn from.
        backends: the attention backends drawn from.
        max_examples: hypothesis' ``max_examples``, whatever the profile.
        database_key: tells this search's failures from another's of the same implementations.

    Raises:
        AssertionError: the smallest failing example's explanation and reproducer.
    """
    o = TwinOptions.of(options, keywords)
    passed = 0

    def one_example(data: st.DataObject) -> None:
        nonlocal passed
        arguments = data.draw(constructor_args(**(o.init or {})), label="init")
        strategy = inputs(arguments) if callable(inputs) else inputs
        example = data.draw(strategy, label="inputs")
        if not isinstance(example, TwinInputs):  # a strategy of plain inputs
            example = TwinInputs(example)
        dtype = data.draw(st.sampled_from(list(dtypes)), label="dtype")
        backend = data.draw(st.sampled_from(list(backends)), label="backend")
        seed = data.draw(st.integers(0, 2**16), label="weight seed")
        assert_twins(old, new, example.inputs, replace(
            o, dtype=dtype, backend=backend, init=arguments, seed=seed, padding=example.padding))
        passed += 1

    # Without this every caller's search would share one database key (this function's).
    key = f"{_name(old)} {_name(new)} {database_key}"
    one_example._hypothesis_internal_add_digest = key.encode()
    options: dict[str, object] = dict(deadline=None, max_examples=max_examples,
                                   suppress_health_check=[HealthCheck.too_slow,
                                                          HealthCheck.data_too_large])
    with single_thread():
        given(data=st.data())(settings(settings.default, **options)(one_example))()
    return passed


def _name(side: object) -> str:
    """A class's or factory's dotted name (a module instance's class's)."""
    kind = type(side) if isinstance(side, nn.Module) else side
    return f"{getattr(kind, '__module__', '')}.{getattr(kind, '__qualname__', repr(kind))}"
