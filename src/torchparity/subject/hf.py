"""Hugging Face ``transformers`` models, recognised without importing transformers: their
attention implementation and whether they generate."""

from __future__ import annotations

from torch import nn

#: The attention implementations a ``transformers`` model is switched between.
EAGER, SDPA = "eager", "sdpa"


def is_transformers(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` model (it can switch its attention)."""
    return hasattr(model, "set_attn_implementation") and hasattr(model, "config")


def generates(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` model that can ``generate``."""
    can = getattr(model, "can_generate", None)
    return is_transformers(model) and callable(can) and bool(can())


def set_attention(model: nn.Module, implementation: str) -> None:
    """Switch a ``transformers`` model to its ``eager`` or ``sdpa`` attention."""
    model.set_attn_implementation(implementation)
