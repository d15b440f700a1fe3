"""What ``torchparity twins`` runs: entries and an input description made a check or a search."""

from __future__ import annotations

import ast
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

from hypothesis.strategies import SearchStrategy

from torchparity.errors import UsageError
from torchparity.subject.factory import resolve_entry
from torchparity.twins import strategies as tpt
from torchparity.twins.checking import TwinOptions, assert_twins
from torchparity.twins.search import check_twins

DESCRIBED = ("attention", "decoding")


def parse_init(items: Sequence[str]) -> dict[str, object]:
    """``["n_heads=1,2,4", "d_model=16"]`` -> ``{"n_heads": [1, 2, 4], "d_model": 16}``."""
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

    ``source`` is ``attention`` (``hidden_states`` and a ``mask`` of a convention of
    :data:`~torchparity.twins.strategies.MASKS`, position ids from an offset in ``positions``
    unless None), ``decoding`` (steps of ``hidden_states``), or an entry ``file.py:name``
    returning the inputs (one check) or a strategy of ``TwinInputs`` (a search).
    """

    source: str
    mask: str = "key-padding"
    positions: tuple[int, int] | None = None


def twin_options(init: Mapping[str, object], weight_map: str | None, cache: Sequence[str],
                 seed: int) -> TwinOptions:
    """The ``TwinOptions`` of the command's entries, the weight map and cache factories loaded."""
    caches = tuple(resolve_entry(c) for c in cache) or None
    return TwinOptions(init=init, seed=seed,
                       weight_map=resolve_entry(weight_map) if weight_map else None,
                       cache=caches[0] if caches and len(caches) == 1 else caches)


def run_twins(old: str, new: str, inputs: InputsSpec, options: TwinOptions, *,
              dtypes: Sequence[str], backends: Sequence[str | None], examples: int) -> str:
    """Run the check or the search; the line to print when it passes (a failure raises)."""
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
