"""Argument handling shared by the subcommands."""

from __future__ import annotations

import torch

from torchparity.dtypes import dtype_name
from torchparity.errors import UsageError

__all__ = ["dtype_name", "resolve_device"]


def resolve_device(name: str | None) -> str:
    """``name``, or ``cuda`` when available else ``cpu``; a one-line error for a device that is
    not a torch device or, for CUDA, not present."""
    device = name or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a torch device (try cpu or cuda)") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise UsageError(f"--device {device} asked for, but no CUDA device is available here; "
                         "use --device cpu")
    return device

