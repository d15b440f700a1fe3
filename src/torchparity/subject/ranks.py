"""Whether this process is one rank of a distributed run."""

from __future__ import annotations

import os


def under_torchrun() -> bool:
    """Whether this process is one rank of ``torchrun`` (or another launcher setting its
    ``RANK`` and ``WORLD_SIZE``)."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ
