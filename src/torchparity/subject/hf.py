"""Hugging Face ``transformers`` models, recognised without importing transformers: their
attention implementation and their greedy ``generate``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from torchparity.errors import UsageError

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


def greedy_generate(model: nn.Module, inputs: Any, steps: int, use_cache: bool
                    ) -> dict[str, torch.Tensor]:
    """Greedy ``generate`` of ``steps`` tokens: the sequences and each step's logits."""
    if not isinstance(inputs, Mapping):
        raise UsageError("the default decode of a transformers model needs keyword inputs "
                         "(a dict with input_ids); return a decode step from the factory")
    kwargs = {k: v for k, v in inputs.items() if k in ("input_ids", "attention_mask")}
    result = model.generate(**kwargs, do_sample=False, num_beams=1, max_new_tokens=steps,
                            min_new_tokens=steps, use_cache=use_cache,
                            output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return {"tokens": result.sequences, "logits": torch.stack(result.logits, 1)}
