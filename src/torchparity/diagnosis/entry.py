"""Stage 5b of a diagnosis: where a divergence enters the container it was found in.

Masks, positions and cache offsets are built once per forward by a parent (a stack of layers)
and handed to every layer: a bug there makes the *parent* the first module whose local error
breaks its budget, while each layer computes correctly on what it is given. To name the argument
that carried the change in, B's parent is replayed once more on A's recorded inputs with every
module inside captured. In the order they start, each one's inputs are compared with A's
recorded ones: the first whose inputs differ, while every output that finished before it
matched, takes the change in; it is followed down to the deepest module inside it that is
handed the same differing value (the layer gets the mask, its attention uses it).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchparity.comparison.selection import PaddingSpec
from torchparity.diagnosis.align import Match
from torchparity.diagnosis.capture import Capture, ModuleCall
from torchparity.diagnosis.judging import judge, module_padding
from torchparity.diagnosis.masks import by_meaning
from torchparity.diagnosis.propagated import one_to_one
from torchparity.diagnosis.reference import Reference
from torchparity.diagnosis.report import Entry, Row
from torchparity.diagnosis.run import Options, backend_context, placed
from torchparity.diagnosis.trace import ReplayUnavailable
from torchparity.subject.running import seeded
from torchparity.subject.trees import leaves


def find_entry(reference: Reference, matches: list[Match], rows: list[Row], model: nn.Module,
               opts: Options) -> None:
    """Set ``entry`` on the first divergence when it contains modules and a differing input of
    one of them explains it."""
    first = next((r for r in rows if r.local is not None and not r.local.ok), None)
    if first is None:
        return
    match = matches[rows.index(first)]
    if not one_to_one(match):
        return
    inside = _calls_inside(match.b[0], matches)
    if not inside:
        return
    container = model.get_submodule(match.b[0].name)
    try:
        replayed = _replay_capturing(reference, match, container, opts)
        first.entry = _first_differing_input(reference, replayed, inside, container)
    except ReplayUnavailable as exc:
        first.notes.append(f"where the divergence enters is unknown: {exc}")
    except Exception as exc:  # noqa: BLE001 - the search must not end the diagnosis
        first.notes.append("where the divergence enters is unknown: the replay failed "
                           f"({type(exc).__name__}: {exc})")


def _calls_inside(container: ModuleCall, matches: list[Match]
                  ) -> dict[tuple[str, int], tuple[ModuleCall, Match]]:
    """B's calls made during ``container``'s call, keyed by (name relative to the container,
    occurrence among them), with their one-to-one match."""
    prefix = f"{container.name}." if container.name else ""
    inside = sorted(
        ((m.b[0], m) for m in matches if one_to_one(m)
         and m.b[0].name.startswith(prefix) and m.b[0].name != container.name
         and container.start < m.b[0].start and m.b[0].order < container.order),
        key=lambda pair: pair[0].start)
    keyed, seen = {}, {}
    for call, match in inside:
        name = call.name[len(prefix):]
        seen[name] = seen.get(name, -1) + 1
        keyed[(name, seen[name])] = (call, match)
    return keyed


def _replay_capturing(reference: Reference, match: Match, container: nn.Module,
                      opts: Options) -> list[ModuleCall]:
    """B's container run on A's recorded inputs, every module inside it captured."""
    a, b = match.a[0], match.b[0]
    args, kwargs = placed(reference.store.get_inputs(a.key), b)
    with backend_context(opts.backend_b), seeded(), torch.no_grad(), \
            Capture(container, exclude="", what="tensors") as capture:
        container(*args, **kwargs)
    return capture.records


def _first_differing_input(reference: Reference, replayed: list[ModuleCall],
                           inside: dict[tuple[str, int], tuple[ModuleCall, Match]],
                           container: nn.Module) -> Entry | None:
    """In start order, the first call whose inputs differ from A's while every output finished
    before it matched; then the deepest call inside it that is handed the same differing value
    (the layer gets the mask, its attention uses it)."""
    calls = sorted(replayed, key=lambda c: c.start)
    paired, seen = [], {}
    for call in calls:
        seen[call.name] = seen.get(call.name, -1) + 1
        found = inside.get((call.name, seen[call.name]))
        if found is not None:
            paired.append((call, found[0], found[1]))

    def difference(call: ModuleCall, match: Match) -> _Difference | None:
        a_inputs = reference.store.get_inputs(match.a[0].key)
        names = parameter_names(container.get_submodule(call.name))
        return _input_difference(a_inputs, (call.args, call.kwargs), names,
                                 module_padding(reference.padding, match.a[0].name))

    for index, (call, b_call, match) in enumerate(paired):
        found = difference(call, match)
        if found is None:
            continue
        earlier = [(c, m) for c, _, m in paired[:index] if not _contains(c, call)]
        if any(not reference.judge(m.a, c.outputs, "out", "golden_out", "forward").ok
               for c, m in earlier):
            return None  # an output differed first: the change is not handed down
        entry = (b_call, found)
        for inner, inner_b, inner_match in paired[index + 1:]:
            if not _contains(call, inner):
                break
            handed = difference(inner, inner_match)
            if handed is not None and _same(handed.b_value, found.b_value) and \
                    inner_b.depth > entry[0].depth:
                entry = (inner_b, handed)
        return Entry(entry[0].name, entry[1].argument, entry[1].detail)
    return None


def _contains(outer: ModuleCall, inner: ModuleCall) -> bool:
    return outer.start < inner.start and inner.order < outer.order


@dataclass(frozen=True)
class _Difference:
    argument: str
    detail: str
    b_value: Any


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and \
        _same_plain(a, b)


def _input_difference(a_inputs: tuple[tuple, dict], b_inputs: tuple[tuple, dict],
                      names: list[str], padding: PaddingSpec = None) -> _Difference | None:
    """The first argument path where B's inputs differ from A's on the judged positions, and
    how (masks by what they let judged queries attend to)."""
    a_leaves = {**leaves(a_inputs[0], "args"), **leaves(a_inputs[1], "kwargs")}
    b_leaves = {**leaves(b_inputs[0], "args"), **leaves(b_inputs[1], "kwargs")}
    for path in [*a_leaves, *(p for p in b_leaves if p not in a_leaves)]:
        a, b = a_leaves.get(path, _MISSING), b_leaves.get(path, _MISSING)
        detail = _leaf_difference(a, b, padding)
        if detail is not None:
            return _Difference(_argument(path, names), detail, b)
    return None


_MISSING = object()


def _leaf_difference(a: Any, b: Any, padding: PaddingSpec = None) -> str | None:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or not _same_plain(a, b):
            return f"A has {_describe(a)}, B has {_describe(b)}"
        return None
    if not _same(a, b.to(a.device)):
        meaning = by_meaning(a, b, padding)
        if meaning is not None:
            return meaning.detail
    if a.shape != b.shape:
        return f"A has {_describe(a)}, B has {_describe(b)}"
    b = b.to(a.device)
    if not (a.is_floating_point() and b.is_floating_point()):
        differ = int((a != b).sum())
        return f"{differ} of {a.numel()} entries differ" if differ else None
    result = judge({"input": b}, {"input": a}, {}, "forward", padding)
    if result.ok:
        return None
    worst = result.tensors[0]
    return f"{worst.n_over} of {a.numel()} entries differ beyond the budget"


def _same_plain(a: Any, b: Any) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable ==: compare their types
        return type(a) is type(b)


def _describe(leaf: Any) -> str:
    if leaf is _MISSING:
        return "nothing"
    if isinstance(leaf, torch.Tensor):
        dtype = str(leaf.dtype).removeprefix("torch.")
        return f"Tensor{tuple(leaf.shape)} {dtype}"
    return repr(leaf) if leaf is None or isinstance(leaf, (bool, int, float, str)) else \
        type(leaf).__name__


def _argument(path: str, names: list[str]) -> str:
    """``args.1.mask`` -> ``ctx.mask`` (the forward's parameter name), ``kwargs.x`` -> ``x``."""
    head, _, rest = path.partition(".")
    index, _, tail = rest.partition(".")
    if head == "args" and index.isdigit() and int(index) < len(names):
        index = names[int(index)]
    return f"{index}.{tail}" if tail else index


def parameter_names(module: nn.Module) -> list[str]:
    """The positional parameter names of ``module.forward`` (``args.1`` is its second)."""
    try:
        parameters = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return []
    return [p.name for p in parameters
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
