"""Dtype names as the commands and the Python API take them.

The short names (``fp32``, ``bf16``, ``fp16``, ``fp64``, ``tf32``) are canonical; torch's own
(``float32``, ``torch.bfloat16``, ``half``, ...) and :class:`torch.dtype` objects are accepted
beside them.
"""

from __future__ import annotations

import torch

#: torch's names of the dtypes beside the short ones.
ALIASES = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
           "double": "fp64", "float": "fp32", "half": "fp16"}


def dtype_name(value: str | torch.dtype) -> str:
    """The short name: ``float32``, ``torch.float32`` and ``torch.float32`` itself -> ``fp32``.

    Unknown names are returned unchanged (lower-cased), for the caller to reject with its list
    of choices.
    """
    name = str(value).strip().lower().removeprefix("torch.")
    return ALIASES.get(name, name)
