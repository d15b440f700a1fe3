"""Tensors told apart by the memory they read, not by the Python object that holds them.

A module's output is the next module's input, a detached view of it is another object on the
same memory, and an in-place change moves the version counter every view of that memory
shares. :func:`memory_key` names the values a tensor reads; :class:`SharedCopies` keeps one
copy of each, made while it was unchanged (captures and trace files copy a run's tensors
before the run can change them, and a copy shared is a tensor stored once).
"""

from __future__ import annotations

import torch


def memory_key(tensor: torch.Tensor) -> tuple | None:
    """What identifies the values ``tensor`` reads while its storage lives.

    Args:
        tensor: any tensor.

    Returns:
        Its device, storage address, offset, shape, strides and dtype; None for a tensor
        without a storage of its own, a subclass that wraps others (some give a storage whose
        data cannot be read, as a functional collective's result a tensor-parallel layer
        returns).
    """
    try:
        where = tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):
        return None
    return (tensor.device, where, tensor.storage_offset(), tuple(tensor.shape),
            tensor.stride(), tensor.dtype)


def version(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter, which every in-place change moves.

    Args:
        tensor: any tensor.

    Returns:
        The counter, or None for an inference tensor, which has none.
    """
    return None if tensor.is_inference() else tensor._version


class SharedCopies:
    """Detached copies, one per memory read unchanged since. Each source is held beside its
    copy, so its memory is not reused by another tensor meanwhile."""

    def __init__(self) -> None:
        self._kept: dict[tuple, tuple[torch.Tensor, torch.Tensor]] = {}

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        """The copy of what ``tensor`` reads now, made once per memory and version.

        Args:
            tensor: a run's tensor, about to be kept.

        Returns:
            The copy made before when its memory is unchanged since, else a new one (always a new
            one for a tensor without a storage or a version counter: nothing tells whether it
            changed).
        """
        key, changes = memory_key(tensor), version(tensor)
        if key is None or changes is None:
            return tensor.detach().clone()
        key = (*key, changes)
        if key not in self._kept:
            self._kept[key] = (tensor, tensor.detach().clone())
        return self._kept[key][1]

    def clear(self) -> None:
        """Drop every copy and the sources held beside them."""
        self._kept.clear()
