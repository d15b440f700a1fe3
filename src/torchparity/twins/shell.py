"""What ``torchparity twins`` runs: entries and a short input description turned into one
check or a search.

``--inputs`` is ``attention`` (keyword ``hidden_states`` and a mask of ``--mask``'s
convention, padded when it has one, position ids with ``--positions``), ``decoding`` (steps
of ``hidden_states``; ``--cache`` names each side's cache factory), or an entry
``file.py:name``: a function of the constructor arguments that returns the inputs (a tuple or
a dict: one check) or a strategy of :class:`~torchparity.twins.strategies.TwinInputs` (a
search).
"""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from hypothesis.strategies import SearchStrategy

from torchparity.errors import UsageError
from torchparity.subject.factory import resolve_entry
from torchparity.twins import strategies as tpt
from torchparity.twins.checking import TwinOptions, assert_twins
from torchparity.twins.search import check_twins

DESCRIBED = ("attention", "decoding")


def parse_init(items: Sequence[str]) -> dict[str, Any]:
    """``["n_heads=1,2,4", "d_model=16"]`` -> ``{"n_heads": [1, 2, 4], "d_model": 16}``: a
    Python literal each, several separated by commas drawn from."""
    init = {}
    for item in items:
        name, sep, text = item.partition("=")
        if not sep or not name.isidentifier():
            raise UsageError(f"--init {item!r}: write NAME=VALUE (n_heads=4, or n_heads=1,2,4 "
                             "to draw from)")
        try:
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError):
            raise UsageError(f"--init {item!r}: {text!r} is not a Python literal (quote "
                             "strings: name='x')") from None
        init[name] = list(value) if isinstance(value, tuple) else value
    return init


@dataclass(frozen=True)
class InputsSpec:
    """What ``--inputs`` and the options that shape it say.

    Attributes:
        source: ``attention``, ``decoding`` or an entry ``file.py:name``.
        mask: the mask convention of ``attention`` (a name of
            :data:`~torchparity.twins.strategies.MASKS`).
        positions: ``attention`` also passes position ids from an offset drawn in
            ``[lo, hi]``; None: no position ids.
    """

    source: str
    mask: str = "key-padding"
    positions: tuple[int, int] | None = None


def twin_options(init: Mapping[str, Any], weight_map: str | None, cache: Sequence[str],
                 seed: int) -> TwinOptions:
    """The options of the command's entries: the weight map and cache factories loaded.

    Args:
        init: the constructor arguments (:func:`parse_init`), lists drawn from.
        weight_map: ``file.py:name`` of the weight map, or None.
        cache: one cache factory's entry for both sides, or two (the old side's, the new
            side's), or none.
        seed: the weight seed of a single check.

    Returns:
        The :class:`~torchparity.twins.TwinOptions`.
    """
    caches = tuple(resolve_entry(c) for c in cache) or None
    return TwinOptions(init=init, seed=seed,
                       weight_map=resolve_entry(weight_map) if weight_map else None,
                       cache=caches[0] if caches and len(caches) == 1 else caches)


def run_twins(old: str, new: str, inputs: InputsSpec, options: TwinOptions, *,
              dtypes: Sequence[str], backends: Sequence[str | None], examples: int) -> str:
    """Run the check or the search.

    Args:
        old, new: the entries of the two implementations.
        inputs: what ``--inputs`` describes.
        options: the entries' options (:func:`twin_options`).
        dtypes: the dtypes drawn from (a single check: the first).
        backends: the backends drawn from (a single check: the first).
        examples: the examples of a search.

    Returns:
        The line to print when it passes (a failure raises
        :class:`~torchparity.twins.TwinFailure`).
    """
    old_side, new_side = resolve_entry(old), resolve_entry(new)
    init = options.init or {}
    drawn = any(isinstance(v, list) for v in init.values())
    if inputs.source in DESCRIBED:
        if "d_model" not in init:
            raise UsageError(f"--inputs {inputs.source} needs the width: --init d_model=N")
        strategy = (lambda a: tpt.attention_inputs(a["d_model"], mask=inputs.mask,
                                                   positions=inputs.positions)
                    ) if inputs.source == "attention" else (
                        lambda a: tpt.decoding_inputs(a["d_model"]))
    else:
        made = resolve_entry(inputs.source)
        strategy = made if drawn else made(init)
        if not drawn and not isinstance(strategy, SearchStrategy):
            assert_twins(old_side, new_side, strategy,
                         replace(options, dtype=dtypes[0], backend=backends[0]))
            return "twins: pass (1 check)"
    count = check_twins(old_side, new_side, inputs=strategy, options=options, dtypes=dtypes,
                        backends=backends, max_examples=examples)
    return f"twins: pass ({count} examples, {', '.join(dtypes)}, backends " \
           f"{', '.join(b or 'as written' for b in backends)})"
