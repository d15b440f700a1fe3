"""Python's cycle collector kept off the objects that were alive before a long run.

``import torch`` leaves about 165,000 objects behind (functions, types, descriptors), and every
full collection walks all of them again: 0.15 s on a 2-core machine, while a diagnosis or a
check makes enough objects of its own (captured calls, judgements, report rows) to start such a
collection every second or two, as often as the plain steps it explains take. ``gc.freeze()``
moves the objects alive now to a generation the collector skips; what the run makes is still
collected as before. A process of torchparity's own (a worker of ``torchparity check``) freezes
once at its start; a call of the library freezes for its own duration and leaves the collector
as it found it.
"""

from __future__ import annotations

import contextlib
import functools
import gc
from collections.abc import Callable, Iterator
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

#: Blocks of :func:`older_objects_frozen` open now, and a process frozen for good: only the
#: outermost asks whether the caller froze objects itself (``gc.get_freeze_count()`` walks
#: every frozen object: 20 ms after torch's).
_depth = 0


@contextlib.contextmanager
def older_objects_frozen() -> Iterator[None]:
    """Inside the block, the collector does not walk the objects alive when it began.

    A caller that froze objects itself (or disabled the collector) is left to its own
    setting, and nested blocks freeze once.

    Yields:
        Nothing.
    """
    global _depth
    if _depth:
        yield
        return
    ours = gc.isenabled() and not gc.get_freeze_count()
    _depth += 1
    if ours:
        gc.freeze()
    try:
        yield
    finally:
        if ours:
            gc.unfreeze()  # back in the oldest generation, collected as they were
        _depth -= 1


def with_older_objects_frozen(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` run under :func:`older_objects_frozen`: a decorator for long library calls.

    Args:
        function: the function wrapped.

    Returns:
        The wrapper, with ``function``'s signature.
    """
    @functools.wraps(function)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        with older_objects_frozen():
            return function(*args, **kwargs)
    return wrapper


def freeze_for_good() -> None:
    """Freeze the objects alive now for the rest of the process: a worker of torchparity's own,
    whose imports are never garbage."""
    global _depth
    gc.freeze()
    _depth += 1
