"""Argument handling shared by the subcommands."""

from __future__ import annotations

import torch

from torchparity.errors import UsageError


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


#: torch's names of the dtypes beside the short ones every ``--dtype`` uses.
DTYPE_ALIASES = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
                 "double": "fp64", "float": "fp32", "half": "fp16"}


def dtype_name(text: str) -> str:
    """The short name of a ``--dtype`` value: ``float32`` and ``torch.float32`` -> ``fp32``.

    Unknown names are returned unchanged, for the command to reject with its list of choices.
    """
    name = text.strip().lower().removeprefix("torch.")
    return DTYPE_ALIASES.get(name, name)
