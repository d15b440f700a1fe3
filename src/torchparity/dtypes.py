"""Dtype names as the commands and the Python API take them, and the torch dtype of each.

The short names (``fp32``, ``bf16``, ``fp16``, ``fp64``, ``tf32``) are canonical; torch's own
(``float32``, ``torch.bfloat16``, ``half``) and :class:`torch.dtype` objects are accepted too.
"""

from __future__ import annotations

import torch

#: The torch dtype of each short name. ``tf32`` stores float32; it names float32 tensors whose
#: CUDA matmuls run in TF32.
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "tf32": torch.float32,
          "bf16": torch.bfloat16, "fp16": torch.float16}

#: The dtypes a model can be cast to (``tf32`` is a matmul setting, not a storage dtype).
CASTABLE = ("fp64", "fp32", "bf16", "fp16")

#: torch's names of the dtypes beside the short ones.
ALIASES = {"float64": "fp64", "float32": "fp32", "bfloat16": "bf16", "float16": "fp16",
           "double": "fp64", "float": "fp32", "half": "fp16",
           "float8_e4m3fn": "fp8_e4m3", "float8_e5m2": "fp8_e5m2",
           # The "fnuz" variants share the significand; only their subnormal spacing differs.
           "float8_e4m3fnuz": "fp8_e4m3", "float8_e5m2fnuz": "fp8_e5m2"}


def dtype_name(value: str | torch.dtype) -> str:
    """The short name reports and golden files use (``fp32``); an unknown one lower-cased."""
    name = str(value).strip().lower().removeprefix("torch.")
    return ALIASES.get(name, name)


def torch_dtype(value: str | torch.dtype) -> torch.dtype:
    """The torch dtype of a name, short or torch's (``tf32`` is float32).

    Raises:
        ValueError: the name is unknown, naming the choices.
    """
    name = dtype_name(value)
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {value!r}; use one of: {', '.join(DTYPES)}")
    return DTYPES[name]
