"""Tensors told apart by the memory they read, not by the Python object that holds them.

A module's output is the next one's input, a detached view another object on the same memory, and
an in-place change moves the version counter every view shares. :class:`SharedCopies` keeps one
copy per memory read unchanged: a copy shared is a tensor stored once.
"""

from __future__ import annotations

import torch


def memory_key(tensor: torch.Tensor) -> tuple | None:
    """What identifies the values ``tensor`` reads while its storage lives."""
    try:
        where = tensor.untyped_storage().data_ptr()
    # None: no storage of its own, or one whose data cannot be read (a functional collective's
    # result in a tensor-parallel layer)
    except (RuntimeError, NotImplementedError):
        return None
    return (tensor.device, where, tensor.storage_offset(), tuple(tensor.shape),
            tensor.stride(), tensor.dtype)


def version(tensor: torch.Tensor) -> int | None:
    """The version counter every in-place change moves; None for an inference tensor."""
    return None if tensor.is_inference() else tensor._version


class SharedCopies:
    """Detached copies, one per memory read unchanged since, each source held beside its copy."""

    def __init__(self) -> None:
        # the source is held so its memory is not reused by another tensor meanwhile
        self._kept: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """The copy of what ``tensor`` reads now, made once per memory and version."""
        key, changes = memory_key(tensor), version(tensor)
        # nothing tells whether it changed: always a new copy
        if key is None or changes is None:
            return tensor.detach().clone()
        key = (*key, changes)
        if key not in self._kept:
            self._kept[key] = (tensor, tensor.detach().clone())
        return self._kept[key][1]

    def clear(self) -> None:
        """Drop every copy and the sources held beside them."""
        self._kept.clear()
