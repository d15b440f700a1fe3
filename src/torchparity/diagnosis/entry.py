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

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchparity.comparison.selection import PaddingSpec
from torchparity.comparison.structure import format_shape
from torchparity.diagnosis.align import Match
from torchparity.diagnosis.capture import (
    Capture,
    ModuleCall,
    Signature,
    Uncopyable,
    bound_arguments,
    signature,
)
from torchparity.diagnosis.capture_a import Reference
from torchparity.diagnosis.judging import judge, module_padding
from torchparity.diagnosis.local import on_recorded_state
from torchparity.diagnosis.masks import by_meaning
from torchparity.diagnosis.propagated import one_to_one
from torchparity.diagnosis.results import Entry, Row
from torchparity.diagnosis.run import Options, backend_context, placed, rebind
from torchparity.diagnosis.state import cache_layers
from torchparity.diagnosis.trace import ReplayUnavailable
from torchparity.subject.running import seeded
from torchparity.subject.trees import leaves


def find_entry(reference: Reference, matches: list[Match], rows: list[Row], model: nn.Module,
               opts: Options, changing: set[str] = frozenset()) -> None:
    """Set ``entry`` on the first divergence when it contains modules and a differing input of
    one of them explains it (``changing``: B's modules that keep state across calls)."""
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
        replayed = _replay_capturing(reference, match, container, opts, changing)
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
                      opts: Options, changing: set[str]) -> list[ModuleCall]:
    """B's container run on A's recorded inputs (and state), every module inside it
    captured."""
    a, b = match.a[0], match.b[0]
    args, kwargs = rebind(reference.signatures.get(a.name),
                          placed(reference.store.get_inputs(a.key), b), container)
    with on_recorded_state(reference, a, container, b.name, changing), \
            backend_context(opts.backend_b), seeded(), torch.no_grad(), \
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

    def difference(call: ModuleCall, match: Match) -> Difference | None:
        a = match.a[0]
        return argument_difference(reference.signatures.get(a.name),
                                   reference.store.get_inputs(a.key),
                                   signature(container.get_submodule(call.name)),
                                   (call.args, call.kwargs),
                                   module_padding(reference.padding, a.name),
                                   container.get_submodule(call.name))

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
class Difference:
    """Where two calls' arguments differ: the argument (``ctx.mask``; ``mask (B: attn_mask)``
    when B renamed it), how, and B's value there."""

    argument: str
    detail: str
    b_value: Any
    one_sided: bool = False  # only one side passes it: compared with what the other reads


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and \
        (_objects_alike(a, b) or _same_plain(a, b))


def argument_difference(a_sig: Signature | None, a_inputs: tuple[tuple, dict],
                        b_sig: Signature | None, b_inputs: tuple[tuple, dict],
                        padding: PaddingSpec = None, b_module: nn.Module | None = None
                        ) -> Difference | None:
    """The first argument in which B's call differs from A's, compared by meaning: arguments
    bind to their parameters by name, and a parameter B renamed pairs with A's by value (both
    None, the same tensor, caches of one kind) or, when one is left on each side, with the
    other. An argument one side does not pass is compared with what that side's module reads
    instead: the default of its parameter, or (in B, ``b_module``) the attribute or config
    value of that name it became (``self.sliding_window``); one the module does not name at
    all is no difference, its code cannot read it. Objects the arguments hold (caches) are
    compared through the state they hold (:mod:`.state`); masks by what they let the judged
    queries attend to (``padding`` says which are judged). Values both sides pass come before
    those one side passes."""
    a, b = bound_arguments(a_sig, *a_inputs), bound_arguments(b_sig, *b_inputs)
    one_sided = []
    for a_name, b_name in _paired(a, b):
        if a_name is not None and b_name is not None:
            found = _value_difference(a_name if a_name == b_name else f"{a_name} (B: {b_name})",
                                      a[a_name], b[b_name], padding)
            if found is not None:
                return found
        elif a_name is not None:
            one_sided.append(_passed_by_a(a_name, a[a_name], b_sig, b_module))
        else:
            one_sided.append(_passed_by_b(b_name, b[b_name], a_sig, b_sig))
    for label, a_value, b_value in filter(None, one_sided):
        found = _value_difference(label, a_value, b_value, padding)
        if found is not None:
            return dataclasses.replace(found, one_sided=True)
    return None


def _passed_by_a(name: str, value: Any, b_sig: Signature | None, b_module: nn.Module | None
                 ) -> tuple[str, Any, Any] | None:
    """An argument only A passes, as (label, A's value, what B reads instead), or None when
    B's code does not read it."""
    b_value, where = _read_instead(name, value, b_sig, b_module)
    if b_value is _UNREAD:
        return None
    return (name if where is None else f"{name} (B: {where})"), value, b_value


def _passed_by_b(name: str, value: Any, a_sig: Signature | None, b_sig: Signature | None
                 ) -> tuple[str, Any, Any] | None:
    """An argument only B passes, as (label, what A read instead, B's value), or None when B's
    code does not read it by name (``**kwargs``) or it is B's own default for a parameter A
    lacked."""
    named = _named(b_sig)
    if name not in named:
        return None
    a_value, _ = _read_instead(name, value, a_sig, None)
    if a_value is _UNREAD:
        if named[name] and _leaf_difference(named[name][0], value) is None:
            return None
        a_value = _MISSING
    return name, a_value, value


def _value_difference(label: str, a_value: Any, b_value: Any, padding: PaddingSpec
                      ) -> Difference | None:
    if _caches(a_value, b_value):
        return None  # their state is compared apart
    a_leaves, b_leaves = leaves(a_value, ""), leaves(b_value, "")
    for path in [*a_leaves, *(p for p in b_leaves if p not in a_leaves)]:
        x, y = a_leaves.get(path, _MISSING), b_leaves.get(path, _MISSING)
        detail = _leaf_difference(x, y, padding)
        if detail is not None:
            return Difference(f"{label}.{path}" if path else label, detail, y)
    return None


#: What a module reads for an argument its caller does not pass, when nothing can be said.
_UNREAD = object()


def _named(sig: Signature | None) -> dict[str, tuple]:
    """A signature's parameters by name (``**kwargs`` and ``*args`` left out): (default,) or
    () when the default is not plain data."""
    return {name: tuple(rest) for name, kind, *rest in sig or []
            if kind not in ("VAR_POSITIONAL", "VAR_KEYWORD")}


def _read_instead(name: str, passed: Any, sig: Signature | None, module: nn.Module | None
                  ) -> tuple[Any, str | None]:
    """What the other side's module reads for ``name``, which its caller did not pass: its
    parameter's default, else its attribute or config value of that name (with where it
    is), else ``_UNREAD``. A default that is not plain data reads as the value passed when
    that is None, as unknown otherwise."""
    named = _named(sig)
    if name in named:
        if named[name]:
            return named[name][0], None
        return (None, None) if passed is None else (_UNREAD, None)
    for where, owner in (("self", module), ("self.config", getattr(module, "config", None))):
        value = getattr(owner, name, _UNREAD) if owner is not None else _UNREAD
        if value is not _UNREAD and (value is None or isinstance(value, (bool, int, float, str,
                                                                          torch.Tensor))):
            return value, f"{where}.{name}"
    return _UNREAD, None


def _caches(a: Any, b: Any) -> bool:
    """Both values hold a key/value cache, and one of them is an object (a ``DynamicCache``
    against the ``(keys, values)`` tuple another release passes)."""
    return _cache_like(a) and _cache_like(b) and not (
        isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)))


def _cache_like(value: Any) -> bool:
    if isinstance(value, Uncopyable):
        return "Cache" in value.type_name
    if isinstance(value, (tuple, list)):
        tensors = [v for v in value if isinstance(v, torch.Tensor)]
        if len(tensors) == len(value) == 2:  # one layer's (keys, values)
            return tensors[0].dim() >= 3 and tensors[0].shape == tensors[1].shape
        return bool(value) and all(_cache_like(v) for v in value)  # a tuple of layers
    return cache_layers(value) is not None


def _paired(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str | None, str | None]]:
    """A's and B's argument names paired: equal names, then renamed ones by equal value or as
    caches, then a last one on each side of one kind (tensors, or values of one type); None
    values without a partner are not passed at all."""
    pairs: list[tuple[str | None, str | None]] = [(name, name) for name in a if name in b]
    rest_a = [n for n in a if n not in b]
    rest_b = [n for n in b if n not in a]
    for alike in (_same, _caches):
        for name in list(rest_a):
            partner = next((m for m in rest_b if alike(a[name], b[m])), None)
            if partner is not None:
                pairs.append((name, partner))
                rest_a.remove(name)
                rest_b.remove(partner)
    rest_a = [n for n in rest_a if a[n] is not None]
    rest_b = [n for n in rest_b if b[n] is not None]
    if len(rest_a) == len(rest_b) == 1 and type(a[rest_a[0]]) is type(b[rest_b[0]]):
        return [*pairs, (rest_a[0], rest_b[0])]
    return [*pairs, *((n, None) for n in rest_a), *((None, n) for n in rest_b)]


_MISSING = object()


def _leaf_difference(a: Any, b: Any, padding: PaddingSpec = None) -> str | None:
    """How two values of one argument differ (None when they agree): integer and bool tensors
    exactly, floating ones within the analytic budget on the judged positions, masks by meaning
    (:mod:`.masks`), other values by equality; objects of one type (caches, placeholders of
    them) agree here, their state is compared apart."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        if _objects_alike(a, b):
            return None
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or not _same_plain(a, b):
            return f"A has {_describe(a)}, B has {_describe(b)}"
        return None
    if not _same(a, b.to(a.device)):
        meaning = by_meaning(a, b, padding)
        if meaning is not None:
            return meaning.detail
    if a.shape != b.shape:
        return (f"shape differs: {format_shape(tuple(a.shape))} vs "
                f"{format_shape(tuple(b.shape))} (A vs B)")
    b = b.to(a.device)
    if not (a.is_floating_point() and b.is_floating_point()):
        differ = int((a != b).sum())
        return f"{differ} of {a.numel()} entries differ" if differ else None
    result = judge({"input": b}, {"input": a}, {}, "forward", padding)
    if result.ok:
        return None
    worst = result.tensors[0]
    return f"{worst.n_over} of {a.numel()} entries differ beyond the budget"


def _objects_alike(a: Any, b: Any) -> bool:
    """Two objects that are no plain values, tensors or containers, of one type."""
    plain = (type(None), bool, int, float, str, torch.Tensor)
    if a is _MISSING or b is _MISSING or isinstance(a, plain) or isinstance(b, plain):
        return False
    return _type_name(a) == _type_name(b)


def _type_name(leaf: Any) -> str:
    return leaf.type_name if isinstance(leaf, Uncopyable) else type(leaf).__name__


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


def argument_path(path: str, sig: Signature | None) -> str:
    """``args.1.cache.self_kv`` -> ``ctx.cache.self_kv`` (the parameter the argument binds to),
    ``kwargs.x.y`` -> ``x.y``."""
    head, _, rest = path.partition(".")
    index, _, tail = rest.partition(".")
    if head == "args" and index.isdigit():
        positional = [name for name, kind, *_ in sig or []
                      if kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
        index = positional[int(index)] if int(index) < len(positional) else f"args.{index}"
    elif head != "kwargs":
        return path
    return f"{index}.{tail}" if tail else index
