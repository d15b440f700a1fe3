"""torch's intra-op thread count, set for one block and put back after it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def torch_threads(count: int) -> Iterator[None]:
    """Run torch on ``count`` intra-op threads inside the block; the count is put back after."""
    previous = torch.get_num_threads()
    torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def single_thread() -> contextlib.AbstractContextManager[None]:
    """Run torch on one intra-op thread inside the block."""
    # small models: more threads only spin, and one makes float64 sums core-count free
    return torch_threads(1)
