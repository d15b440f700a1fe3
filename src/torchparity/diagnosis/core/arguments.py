"""Two calls' arguments compared by meaning: where they differ, and how (for where a
divergence enters, and a decoding's first divergent step)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchparity.comparison.selection import PaddingSpec
from torchparity.comparison.structure import format_shape
from torchparity.diagnosis.core.capture import (
    CallArgs,
    ModuleCall,
    Signature,
    Uncopyable,
    bound_arguments,
)
from torchparity.diagnosis.core.judging import judge
from torchparity.diagnosis.core.masks import by_meaning, mask_forms, readings
from torchparity.diagnosis.core.run import parameter_path
from torchparity.diagnosis.core.state import cache_layers
from torchparity.subject.trees import PyTree, flatten_tensors, leaves


@dataclass(frozen=True)
class Difference:
    """Where two calls' arguments differ (``mask (B: attn_mask)`` when renamed), how, and B's
    value."""

    argument: str
    detail: str
    b_value: object
    one_sided: bool = False  # only one side passes it: compared with what the other reads


@dataclass(frozen=True)
class Convention:
    """An argument handed in another convention: B's parameter, both sides, whether B passes
    None."""

    argument: str
    detail: str
    b_none: bool
    #: where both pass a mask of one shape in other forms: each pair of a reading of A's
    #: (``additive float``) and a form of B's dtype (``boolean attend``) it may be handed in
    forms: tuple[tuple[str, str], ...] = ()
    b_dtype: torch.dtype | None = None


def convention_change(a_sig: Signature | None, a_inputs: CallArgs,
                      b_sig: Signature | None, b: ModuleCall) -> Convention | None:
    """The first mask A's call hands in another convention than B's call ``b`` (a tensor against
    None, bool against float, other dimensions); None otherwise (other sizes are fitted)."""
    args, kwargs = a_inputs
    a_tensors = {parameter_path(a_sig, path): t for path, t in
                 {**flatten_tensors(args, "args"), **flatten_tensors(kwargs, "kwargs")}.items()}
    b_tensors = {parameter_path(b_sig, path): (b.input_shapes[path], dtype)
                 for path, (dtype, _) in b.input_placement.items()}
    for path, mask in a_tensors.items():
        if mask.dim() < 2 or not readings(mask):
            continue
        a_side = f"A passes {_described(mask.shape, mask.dtype)}"
        if path not in b_tensors:
            return Convention(path, f"{a_side}, B passes None", b_none=True)
        shape, dtype = b_tensors[path]
        if _kind(mask.dtype) != _kind(dtype) or len(shape) != mask.dim():
            forms = tuple((reading, form) for reading in readings(mask)
                          for form in mask_forms(dtype)) if tuple(shape) == mask.shape else ()
            return Convention(path, f"{a_side}, B passes {_described(shape, dtype)}",
                              b_none=False, forms=forms, b_dtype=dtype)
    # Of B's tensors only shapes and dtypes are known: a mask is told by its parameter's name.
    for path, (shape, dtype) in b_tensors.items():
        if path not in a_tensors and len(shape) >= 2 and "mask" in path.rpartition(".")[2]:
            return Convention(path, f"A passes None, B passes {_described(shape, dtype)}",
                              b_none=False)
    return None


def _kind(dtype: torch.dtype) -> str:
    return "bool" if dtype == torch.bool else "float" if dtype.is_floating_point else "integer"


def _described(shape: tuple, dtype: torch.dtype) -> str:
    return f"Tensor{tuple(shape)} {str(dtype).removeprefix('torch.')}"


def same_value(a: object, b: object) -> bool:
    """Whether two argument values are the same (tensors equal in shape, dtype and value)."""
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    return not isinstance(a, torch.Tensor) and not isinstance(b, torch.Tensor) and \
        (_objects_alike(a, b) or _same_plain(a, b))


def argument_difference(a_sig: Signature | None, a_inputs: CallArgs,
                        b_sig: Signature | None, b_inputs: CallArgs,
                        padding: PaddingSpec = None, b_module: nn.Module | None = None
                        ) -> Difference | None:
    """The first argument in which B's call differs from A's, by meaning.

    Arguments bind by parameter name; a parameter B renamed pairs with A's by value, or as the
    last one on each side. An argument one side does not pass is compared with what its module
    reads instead (its default, or ``b_module``'s attribute or config value of that name); one
    no module names is no difference. Caches compare by state, masks by what the ``padding``-
    judged queries attend; values both pass come first."""
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


def _passed_by_a(name: str, value: PyTree, b_sig: Signature | None, b_module: nn.Module | None
                 ) -> tuple[str, object, object] | None:
    """An argument only A passes, as (label, A's value, what B reads instead); None when B does not
    read it."""
    b_value, where = _read_instead(name, value, b_sig, b_module)
    if b_value is _UNREAD:
        return None
    return (name if where is None else f"{name} (B: {where})"), value, b_value


def _passed_by_b(name: str, value: PyTree, a_sig: Signature | None, b_sig: Signature | None
                 ) -> tuple[str, object, object] | None:
    """An argument only B passes, as (label, what A read instead, B's value); None when B does
    not read it by name or it is B's own default."""
    named = _named(b_sig)
    if name not in named:
        return None
    a_value, _ = _read_instead(name, value, a_sig, None)
    if a_value is _UNREAD:
        if named[name] and _leaf_difference(named[name][0], value) is None:
            return None
        a_value = _MISSING
    return name, a_value, value


def _value_difference(label: str, a_value: object, b_value: object, padding: PaddingSpec
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
    """A signature's parameters by name (no ``*args``/``**kwargs``): (default,), or () when not
    plain data."""
    return {name: tuple(rest) for name, kind, *rest in sig or []
            if kind not in ("VAR_POSITIONAL", "VAR_KEYWORD")}


def _read_instead(name: str, passed: object, sig: Signature | None, module: nn.Module | None
                  ) -> tuple[object, str | None]:
    """What a module reads for ``name`` its caller did not pass: the default, else its attribute or
    config value (and where), else ``_UNREAD``; a non-plain default reads as unknown."""
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


def _caches(a: object, b: object) -> bool:
    """Both values hold a key/value cache, one of them an object (a ``DynamicCache`` vs a tuple)."""
    return _cache_like(a) and _cache_like(b) and not (
        isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)))


def _cache_like(value: object) -> bool:
    if isinstance(value, Uncopyable):
        return "Cache" in value.type_name
    if isinstance(value, (tuple, list)):
        tensors = [v for v in value if isinstance(v, torch.Tensor)]
        if len(tensors) == len(value) == 2:  # one layer's (keys, values)
            return tensors[0].dim() >= 3 and tensors[0].shape == tensors[1].shape
        return bool(value) and all(_cache_like(v) for v in value)  # a tuple of layers
    return cache_layers(value) is not None


def _paired(a: dict[str, Any], b: dict[str, Any]) -> list[tuple[str | None, str | None]]:
    """A's and B's argument names paired: equal names, renamed ones by value or as caches, then a
    last one of one kind; unpartnered Nones are not passed."""
    pairs: list[tuple[str | None, str | None]] = [(name, name) for name in a if name in b]
    rest_a = [n for n in a if n not in b]
    rest_b = [n for n in b if n not in a]
    for alike in (same_value, _caches):
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


def _leaf_difference(a: object, b: object, padding: PaddingSpec = None) -> str | None:
    """How two values of one argument differ (None: they agree): integer tensors exactly, floating
    ones within the analytic budget, masks by meaning, others by equality; caches apart."""
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        if _objects_alike(a, b):
            return None
        if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor) or not _same_plain(a, b):
            return f"A has {_describe(a)}, B has {_describe(b)}"
        return None
    if not same_value(a, b.to(a.device)):
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


def _objects_alike(a: object, b: object) -> bool:
    """Two objects that are no plain values, tensors or containers, of one type."""
    plain = (type(None), bool, int, float, str, torch.Tensor)
    if a is _MISSING or b is _MISSING or isinstance(a, plain) or isinstance(b, plain):
        return False
    return _type_name(a) == _type_name(b)


def _type_name(leaf: object) -> str:
    return leaf.type_name if isinstance(leaf, Uncopyable) else type(leaf).__name__


def _same_plain(a: object, b: object) -> bool:
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - objects without a usable ==: compare their types
        return type(a) is type(b)


def _describe(leaf: object) -> str:
    if leaf is _MISSING:
        return "nothing"
    if isinstance(leaf, torch.Tensor):
        dtype = str(leaf.dtype).removeprefix("torch.")
        return f"Tensor{tuple(leaf.shape)} {dtype}"
    return repr(leaf) if leaf is None or isinstance(leaf, (bool, int, float, str)) else \
        type(leaf).__name__


def argument_path(path: str, sig: Signature | None) -> str:
    """``args.1.cache.self_kv`` -> ``ctx.cache.self_kv`` (by the parameter it binds to)."""
    head, _, rest = path.partition(".")
    index, _, tail = rest.partition(".")
    if head == "args" and index.isdigit():
        positional = [name for name, kind, *_ in sig or []
                      if kind in ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")]
        index = positional[int(index)] if int(index) < len(positional) else f"args.{index}"
    elif head != "kwargs":
        return path
    return f"{index}.{tail}" if tail else index
