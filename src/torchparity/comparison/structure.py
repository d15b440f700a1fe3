"""Walking two pytrees together: the tensors they share, their structure and shape
differences, and the leaves that cannot be compared (caches, opaque objects)."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils import _pytree as pytree

from torchparity import tolerance
from torchparity.sketching import Sketch

ROOT = "outputs"

#: Why a transformers cache is not compared (see :func:`~torchparity.comparison.compare`).
CACHE_RULE = (
    "a cache is decoding state laid out by its implementation; its contents are compared"
    " through the outputs of the steps that read it"
)


class StructureMismatch(ValueError):
    """The baseline lacks a tensor of the candidate's shape and dtype where candidate and golden
    share one, so no budget can be earned; the message names the path and both sides."""


@dataclass(frozen=True)
class StructureDifference:
    """A path where the structures differ, and what each side has (``"Tensor(2, 3) float32"``)."""

    path: str
    candidate: str
    golden: str

    def __str__(self) -> str:
        return f"{self.path}: candidate {self.candidate}, golden {self.golden}"


@dataclass(frozen=True)
class ShapeDifference:
    """A path where both hold a tensor in different shapes: a divergence of its own, such as
    attention over one more key, ``(1, 2, 1, 12)`` against ``(1, 2, 1, 11)``."""

    path: str
    candidate: tuple[int, ...]
    golden: tuple[int, ...]

    def __str__(self) -> str:
        return (f"{self.path}: shape differs: {format_shape(self.candidate)} vs "
                f"{format_shape(self.golden)} (candidate vs golden)")


def format_shape(shape: tuple[int, ...]) -> str:
    """``(1, 2, 1, 12)``; a 1-d shape without the trailing comma: ``(12)``."""
    return f"({', '.join(map(str, shape))})"


def shared_tensors(a: Any, b: Any) -> list[tuple[str, torch.Tensor, torch.Tensor]]:
    """``(path, a's tensor, b's tensor)`` wherever both pytrees hold a tensor of one shape and kind
    of dtype, in the order :func:`~torchparity.comparison.compare` judges them.

    Containers: mappings (``ModelOutput``), lists and tuples, namedtuples, dataclasses and
    ``torch.utils._pytree`` registrations; Python numbers are left out. The tensors are returned
    as given (still attached to their graphs)."""
    found = TreeAlignment()
    align_trees(a, b, ROOT, found)
    return [(path, x, y) for path, x, y in found.pairs if path not in found.numbers]


@dataclass
class TreeAlignment:
    """What walking candidate and golden together found: shared tensors (and which were Python
    numbers), structure and shape differences, skipped leaves."""

    pairs: list[tuple[str, torch.Tensor, torch.Tensor]] = field(default_factory=list)
    numbers: set[str] = field(default_factory=set)
    structure: list[StructureDifference] = field(default_factory=list)
    shapes: list[ShapeDifference] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


_MISSING = object()  # the side of a key or position that only the other side has

# Leaves compared by equality: a difference is one of structure, not of rounding. (Ints reach
# this only beyond int64 or as enums; other numbers become tensors.)
#: A tensor as compared: itself, or its sketch.
Leaf = torch.Tensor | Sketch
#: The tensors judged: (path, candidate, golden, baseline or None).
Leaves = list[tuple[str, Leaf, Leaf, "Leaf | None"]]

_PLAIN_VALUES = (str, bytes, int, complex, enum.Enum, torch.dtype, torch.device)

_OPAQUE_RULE = (
    "not a tensor, number or container; register its class with torch.utils._pytree"
    " to compare its contents"
)


def align_trees(candidate: Any, golden: Any, path: str, found: TreeAlignment) -> None:
    """Walk candidate and golden together from ``path``, recording into ``found``."""
    c, g = _leaf_tensor(candidate), _leaf_tensor(golden)
    c_children, g_children = _children(candidate), _children(golden)
    if c is not None and g is not None and _same_layout(c, g):
        found.pairs.append((path, c, g))
        if _is_python_number(candidate):
            found.numbers.add(path)
    elif _other_shape(candidate, golden):
        found.shapes.append(ShapeDifference(path, tuple(candidate.shape), tuple(golden.shape)))
    elif (
        c_children is not None
        and g_children is not None
        and _container_type(candidate) == _container_type(golden)
    ):
        for key in {**g_children, **c_children}:  # the golden's order, the candidate's extras
            align_trees(c_children.get(key, _MISSING), g_children.get(key, _MISSING), path + key,
                        found)
    elif (legacy := _key_value_pairs(candidate, golden)) is not None:
        align_trees(*legacy, path, found)
    elif is_cache(candidate) and is_cache(golden):
        found.skipped.append((path, CACHE_RULE))
    elif _is_opaque(candidate) and type(candidate) is type(golden):
        found.skipped.append((path, f"{type(candidate).__name__}: {_OPAQUE_RULE}"))
    elif not _same_value(candidate, golden):
        found.structure.append(StructureDifference(path, _what(candidate), _what(golden)))


def _key_value_pairs(candidate: Any, golden: Any) -> tuple[Any, Any] | None:
    """Both sides as ``((keys, values), ...)`` per layer where they hold a cache in two forms (a
    ``DynamicCache`` against an older release's tuple); None where either holds none, for two
    caches of one class (:data:`CACHE_RULE`), or two laid out otherwise (a static cache)."""
    if not (is_cache(candidate) or is_cache(golden)) or type(candidate) is type(golden):
        return None
    sides = (_as_pairs(candidate), _as_pairs(golden))
    if sides[0] is None or sides[1] is None:
        return None
    shapes = [[tuple(t.shape) for pair in side for t in pair] for side in sides]
    if is_cache(candidate) and is_cache(golden) and shapes[0] != shapes[1]:
        return None
    return sides


def cache_pairs(x: object) -> tuple | None:
    """A ``transformers`` cache as ``((keys, values), ...)`` per layer; None otherwise or empty."""
    if not is_cache(x):
        return None
    layers = cache_layers(x)
    if not layers:
        return None
    count = 1 + max(int(name.split(".")[0]) for name in layers)
    return tuple((layers.get(f"{i}.keys"), layers.get(f"{i}.values")) for i in range(count))


def _as_pairs(x: object) -> tuple | None:
    """A cache's tensors as ``((keys, values), ...)``, a tuple of that form as itself."""
    if is_cache(x):
        return cache_pairs(x)
    if isinstance(x, tuple) and x and all(
            isinstance(pair, tuple) and len(pair) >= 2 and
            all(isinstance(t, torch.Tensor) for t in pair[:2]) for pair in x):
        return tuple(pair[:2] for pair in x)
    return None


def _leaf_tensor(x: object) -> Leaf | None:
    """A tensor, array or number as a tensor (floats as float64), a sketch as itself, a complex
    tensor as its real and imaginary parts; None for anything else."""
    if isinstance(x, torch.Tensor) and x.is_complex():
        return torch.view_as_real(x.resolve_conj())
    if isinstance(x, torch.Tensor | Sketch):
        return x
    if isinstance(x, np.ndarray | np.number | np.bool_):
        return torch.from_numpy(np.asarray(x))
    if isinstance(x, bool):
        return torch.tensor(x)
    if isinstance(x, float):
        return torch.tensor(x, dtype=torch.float64)
    if _is_python_number(x) and -(2**63) <= x < 2**63:  # larger ints stay plain values
        return torch.tensor(x, dtype=torch.int64)
    return None


def _is_python_number(x: object) -> bool:
    return isinstance(x, int | float) and not isinstance(x, enum.Enum)


def _same_layout(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and _dtype_family(a.dtype) == _dtype_family(b.dtype)


def _other_shape(a: object, b: object) -> bool:
    """Two tensors (or arrays) of one kind of dtype whose shapes differ."""
    arrays = torch.Tensor | np.ndarray
    return isinstance(a, arrays) and isinstance(b, arrays) and a.shape != b.shape and \
        _dtype_family(_leaf_tensor(a).dtype) == _dtype_family(_leaf_tensor(b).dtype)


def _same_value(a: object, b: object) -> bool:
    """None and plain values (strings, dtypes, enums, ...) are compared by equality."""
    return (a is None or isinstance(a, _PLAIN_VALUES)) and type(a) is type(b) and a == b


def is_cache(x: object) -> bool:
    """A ``transformers`` cache, recognised by its base class without importing transformers."""
    return any(
        cls.__name__ == "Cache" and cls.__module__.startswith("transformers")
        for cls in type(x).__mro__
    )


def cache_layers(value: object) -> dict[str, torch.Tensor] | None:
    """A ``transformers`` cache's tensors as ``<layer>.keys`` and ``<layer>.values``, whether laid
    out as ``layers[i].keys`` (5.x) or ``key_cache[i]`` (4.x); None for anything else."""
    found: dict[str, torch.Tensor] = {}
    layers = getattr(value, "layers", None)
    key_cache, value_cache = (getattr(value, "key_cache", None),
                              getattr(value, "value_cache", None))
    if isinstance(layers, (list, tuple)) and layers and \
            any(isinstance(getattr(layer, "keys", None), torch.Tensor) for layer in layers):
        pairs = [(getattr(layer, "keys", None), getattr(layer, "values", None))
                 for layer in layers]
    elif isinstance(key_cache, list) and isinstance(value_cache, list):
        pairs = list(zip(key_cache, value_cache, strict=False))
    else:
        return None
    for index, (keys, values) in enumerate(pairs):
        for part, tensor in (("keys", keys), ("values", values)):
            if isinstance(tensor, torch.Tensor) and tensor.numel():  # 4.x: [] for a new layer
                found[f"{index}.{part}"] = tensor
    return found


def _is_opaque(x: object) -> bool:
    """An object compare cannot look into: no tensor, number, plain value or container."""
    return (
        x is not None
        and x is not _MISSING
        and not isinstance(x, _PLAIN_VALUES)
        and _leaf_tensor(x) is None
        and _children(x) is None
    )


def _children(x: Any) -> dict[str, Any] | None:
    """Map path suffix (``["key"]``, ``[0]``, ``.field``) to child; None for a leaf."""
    if isinstance(x, torch.Tensor | Sketch) or is_cache(x):
        return None
    if isinstance(x, Mapping):  # dicts, OrderedDicts and ModelOutput (an OrderedDict subclass)
        return {_key_syntax(k): v for k, v in x.items()}
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # namedtuple
        return {f".{name}": getattr(x, name) for name in x._fields}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f".{f.name}": getattr(x, f.name) for f in dataclasses.fields(x)}
    if isinstance(x, list | tuple):
        return {f"[{i}]": v for i, v in enumerate(x)}
    node = pytree.SUPPORTED_NODES.get(type(x))
    if node is None:
        return None
    if node.flatten_with_keys_fn is None:
        values, _ = node.flatten_fn(x)
        return {f"[{i}]": v for i, v in enumerate(values)}
    entries, _ = node.flatten_with_keys_fn(x)
    return {_entry_syntax(entry): v for entry, v in entries}


def _key_syntax(key: object) -> str:
    # json.dumps quotes like the examples in messages and docs: outputs["logits"].
    return f"[{json.dumps(key)}]" if isinstance(key, str) else f"[{key!r}]"


def _entry_syntax(entry: object) -> str:
    return _key_syntax(entry.key) if isinstance(entry, pytree.MappingKey) else str(entry)


def _container_type(x: object) -> str:
    # Mappings of any class align by keys (a ModelOutput with a dict of goldens), lists and
    # tuples by position; other containers only with their own class.
    if isinstance(x, Mapping):
        return "mapping"
    if isinstance(x, list | tuple) and not hasattr(x, "_fields"):
        return "sequence"
    return type(x).__name__


def _what(x: object) -> str:
    """What one side has at a path: "Tensor(2, 3) float32", "tuple of 2", "missing", ..."""
    if x is _MISSING:
        return "missing"
    if x is None:
        return "None"
    if isinstance(x, _PLAIN_VALUES) or _is_python_number(x):
        text = repr(x)
        if len(text) > _MAX_VALUE_CHARS:
            text = text[: _MAX_VALUE_CHARS - 3] + "..."
        return f"{type(x).__name__} {text}"
    tensor = _leaf_tensor(x)
    if tensor is not None:
        name = "Tensor" if isinstance(x, torch.Tensor | Sketch) else type(x).__name__
        sketched = " (sketched)" if isinstance(x, Sketch) else ""
        dtype = torch_dtype_name(tensor.dtype)
        return f"{name}({', '.join(map(str, tensor.shape))}) {dtype}{sketched}"
    children = _children(x)
    if children is not None:
        return f"{type(x).__name__} of {len(children)}"
    return type(x).__name__


_MAX_VALUE_CHARS = 40


def tensor_leaves(tree: Any, path: str, leaves: dict[str, torch.Tensor]) -> dict[str, Any]:
    """Every tensor and number of ``tree`` by path (the baseline's, looked up per shared path)."""
    tensor = _leaf_tensor(tree)
    if tensor is not None:
        leaves[path] = tensor
        return leaves
    for key, child in (_children(tree) or {}).items():
        tensor_leaves(child, path + key, leaves)
    return leaves


def baseline_at(
    path: str, candidate: torch.Tensor, baselines: dict[str, torch.Tensor]
) -> torch.Tensor:
    baseline = baselines.get(path)
    if baseline is None:
        raise StructureMismatch(
            f"{path}: missing in the baseline; it must hold every tensor that candidate and"
            " golden share"
        )
    if candidate.shape != baseline.shape:
        raise _mismatch(path, "shape", tuple(candidate.shape), tuple(baseline.shape), "baseline")
    if candidate.dtype != baseline.dtype:
        raise StructureMismatch(
            f"{path}: dtype {candidate.dtype} vs {baseline.dtype} (candidate vs baseline); "
            "the baseline must be computed in the candidate's dtype"
        )
    return baseline


def numbers_dtype(leaves: Leaves, numbers: set[str]) -> torch.dtype:
    """The compute dtype of Python floats: the candidate's most precise floating dtype, else
    float64."""
    dtypes = [
        c.dtype for path, c, _, _ in leaves if path not in numbers and c.dtype.is_floating_point
    ]
    return min(dtypes, key=tolerance.unit_roundoff, default=torch.float64)


def _dtype_family(dtype: torch.dtype) -> str:
    if dtype == torch.bool:
        return "bool"
    if dtype.is_complex:
        return "complex"
    return "float" if dtype.is_floating_point else "integer"


def _mismatch(path: str, what: str, candidate: object, other: object, side: str
              ) -> StructureMismatch:
    return StructureMismatch(f"{path}: {what} {candidate} vs {other} (candidate vs {side})")

def torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
