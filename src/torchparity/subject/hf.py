"""Hugging Face ``transformers`` models, recognised without importing transformers.

Nothing here needs an API newer than 4.46: attention is switched by ``set_attn_implementation``
(5.x), else as 4.x chose it, by the config and the attention class built
(``LlamaSdpaAttention``).
"""

from __future__ import annotations

import torch
from torch import nn

from torchparity.errors import BackendUnavailable

#: The attention implementations a ``transformers`` model is switched between.
EAGER, SDPA = "eager", "sdpa"


def is_transformers(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` ``PreTrainedModel`` with a config."""
    return hasattr(model, "config") and any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
        for cls in type(model).__mro__)


def generates(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` model that can ``generate``."""
    can = getattr(model, "can_generate", None)
    return is_transformers(model) and callable(can) and bool(can())


def attention_of(model: nn.Module) -> str | None:
    """The attention implementation a ``transformers`` model runs now (None for any other)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def set_attention(model: nn.Module, implementation: str) -> None:
    """Switch a ``transformers`` model to the attention ``implementation`` named, in place.

    Raises:
        BackendUnavailable: the model has no such implementation (its cells are n/a).
    """
    if attention_of(model) == implementation:
        return
    switch = getattr(model, "set_attn_implementation", None)
    if callable(switch):
        try:
            switch(implementation)
        except (ValueError, ImportError) as exc:  # the family refuses it
            text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BackendUnavailable(f"{type(model).__name__} has no {implementation} "
                                     f"attention implementation ({text})") from None
        return
    built = _built_with(model, implementation)
    for name, module in model.named_modules():
        config = getattr(module, "config", None)
        if hasattr(config, "_attn_implementation"):
            config._attn_implementation = implementation
        like = built.get(name)
        if like is not None and type(like) is not type(module):
            _become(module, like)


def _built_with(model: nn.Module, implementation: str) -> dict[str, nn.Module]:
    """The modules 4.x would have built for ``implementation``, built on the meta device."""
    with torch.device("meta"):
        twin = type(model)._from_config(model.config, attn_implementation=implementation)
    return dict(twin.named_modules())


def _become(module: nn.Module, like: nn.Module) -> None:
    """``module`` takes the class of ``like`` and the plain attributes its ``__init__`` set."""
    module.__class__ = type(like)
    # GPT-2's sdpa attention keeps a flag of its own; parameters, buffers and submodules stay
    own = ("_parameters", "_buffers", "_modules")
    for key, value in vars(like).items():
        if key not in vars(module) and key not in own and not isinstance(value, torch.Tensor):
            vars(module)[key] = value
