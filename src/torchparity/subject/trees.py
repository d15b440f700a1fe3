"""Pytrees of tensors as models take and return them, by dotted path (``output.logits``)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import torch

PyTree: TypeAlias = Any
"""A model's inputs or outputs: tensors nested in mappings, tuples, lists, namedtuples and
dataclasses, with any other leaf (None, numbers, a cache object) allowed. ``Any`` to a type
checker, since a leaf can be anything; the name says which arguments are walked as trees."""


def flatten_tensors(tree: PyTree, prefix: str = "output") -> dict[str, torch.Tensor]:
    """Tensors of a pytree by dotted path (``output.0``, ``output.logits``), as reports say."""
    # mappings (ModelOutput included), tuples, lists and dataclasses in order; other leaves skipped
    return {path: leaf for path, leaf in walk(tree, prefix) if isinstance(leaf, torch.Tensor)}


def map_tensors(tree: PyTree, fn: Callable[[torch.Tensor], object]) -> PyTree:
    """Rebuild ``tree`` with ``fn`` applied to every tensor; containers keep their types."""
    return _mapped(tree, lambda path, tensor: fn(tensor), None)


def map_tensors_with_paths(tree: PyTree, fn: Callable[[str, torch.Tensor], object],
                           prefix: str = "output") -> PyTree:
    """Like :func:`map_tensors`, calling ``fn(path, tensor)`` with :func:`flatten_tensors`' path."""
    return _mapped(tree, fn, prefix)


def map_objects(tree: PyTree, fn: Callable[[object], object | None]) -> PyTree:
    """``tree`` with object leaves (a cache) replaced where ``fn`` answers; itself if nowhere."""
    if all(isinstance(leaf, (torch.Tensor, *_SCALARS)) or fn(leaf) is None
           for _, leaf in walk(tree, "")):
        return tree
    return _mapped(tree, lambda path, tensor: tensor, None, fn)


def _mapped(tree: PyTree, fn: Callable[[str | None, torch.Tensor], object], path: str | None,
            objects: Callable[[object], object | None] | None = None) -> PyTree:
    # ``path`` None: no paths are wanted (map_tensors), and none is built.
    if isinstance(tree, torch.Tensor):
        return fn(path, tree)
    if isinstance(tree, _SCALARS):  # the common leaves, without the ABC checks
        return tree
    if isinstance(tree, Mapping):
        mapped = {k: _mapped(v, fn, _child(path, k), objects) for k, v in tree.items()}
        return _rebuild_mapping(tree, mapped)
    if isinstance(tree, tuple) and hasattr(tree, "_fields"):  # namedtuple
        return type(tree)(*[_mapped(v, fn, _child(path, i), objects) for i, v in enumerate(tree)])
    if isinstance(tree, (tuple, list)):
        return type(tree)([_mapped(v, fn, _child(path, i), objects) for i, v in enumerate(tree)])
    if rebuilt_from_fields(tree):
        changes = {name: _mapped(getattr(tree, name), fn, _child(path, name), objects)
                   for name in field_names(tree, init=True)}
        return dataclasses.replace(tree, **changes)
    if objects is not None and (replaced := objects(tree)) is not None:
        return _mapped(replaced, fn, path, objects)
    return tree


def _child(path: str | None, key: object) -> str | None:
    return None if path is None else f"{path}.{key}" if path else str(key)


def leaves(tree: PyTree, prefix: str) -> dict[str, object]:
    """Every leaf of a pytree (tensors, None, numbers, other objects) by its path."""
    return dict(walk(tree, prefix))


def walk(tree: PyTree, path: str) -> list[tuple[str, object]]:
    """``(path, leaf)`` of every leaf of ``tree``, in walking order."""
    found: list[tuple[str, object]] = []
    _collect(tree, path, found)
    return found


def _collect(tree: PyTree, path: str, found: list[tuple[str, object]]) -> None:
    # A plain recursion into a list, not nested generators: every module call of a captured
    # run walks its inputs and outputs, and a generator per level costs more than the walk.
    if isinstance(tree, (torch.Tensor, *_SCALARS)):  # the common leaves, without the ABC checks
        found.append((path, tree))
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            _collect(value, f"{path}.{key}" if path else str(key), found)
    elif isinstance(tree, (tuple, list)):
        for index, value in enumerate(tree):
            _collect(value, f"{path}.{index}" if path else str(index), found)
    elif dataclasses.is_dataclass(tree) and not isinstance(tree, type):
        for name in field_names(tree):
            _collect(getattr(tree, name), f"{path}.{name}" if path else name, found)
    else:
        found.append((path, tree))


_SCALARS = (type(None), bool, int, float, str)


def _rebuild_mapping(original: Mapping, mapped: dict) -> Mapping:
    try:
        return type(original)(**mapped) if _is_model_output(original) else type(original)(mapped)
    except TypeError:  # a Mapping type without a dict constructor
        return mapped


def _is_model_output(obj: object) -> bool:
    return any(cls.__name__ == "ModelOutput" for cls in type(obj).__mro__)


def rebuilt_from_fields(obj: object) -> bool:
    """Whether ``obj`` is a dataclass instance that its constructor's fields rebuild."""
    # one with no such field is an object: transformers 4.38's caches subclass a field-less
    # dataclass, keeping tensors a rebuild would drop
    return dataclasses.is_dataclass(obj) and not isinstance(obj, type) and \
        bool(field_names(obj, init=True))


def field_names(obj: object, *, init: bool = False) -> tuple[str, ...]:
    """A dataclass instance's field names (``init``: its constructor's), cached per class."""
    return _field_names(type(obj), init)  # every module call of every decoding step walks trees


@functools.cache
def _field_names(cls: type, init: bool) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.init or not init)
