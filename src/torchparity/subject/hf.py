"""Hugging Face ``transformers`` models, recognised without importing transformers: their
attention implementation and whether they generate.

Nothing here needs an API newer than transformers 4.46, the oldest release supported: a model
is recognised by its ``PreTrainedModel`` base, and its attention is switched by
``set_attn_implementation`` where the release has it (5.x), else as 4.x chose it, by the
config's ``_attn_implementation`` and, for the models that picked an attention class when they
were built (4.46's ``LlamaSdpaAttention``), by that class.
"""

from __future__ import annotations

import torch
from torch import nn

from torchparity.errors import BackendUnavailable

#: The attention implementations a ``transformers`` model is switched between.
EAGER, SDPA = "eager", "sdpa"


def is_transformers(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` model (a ``PreTrainedModel`` with a config).

    Args:
        model: any module; transformers is not imported to tell.

    Returns:
        True for a ``transformers`` model.
    """
    return hasattr(model, "config") and any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
        for cls in type(model).__mro__)


def generates(model: nn.Module) -> bool:
    """Whether ``model`` is a ``transformers`` model that can ``generate``.

    Args:
        model: any module.

    Returns:
        True when its built-in decoding step applies.
    """
    can = getattr(model, "can_generate", None)
    return is_transformers(model) and callable(can) and bool(can())


def attention_of(model: nn.Module) -> str | None:
    """The attention implementation a ``transformers`` model runs now (None for any other)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


def set_attention(model: nn.Module, implementation: str) -> None:
    """Switch a ``transformers`` model to the attention implementation named, in place.

    Args:
        model: a ``transformers`` model.
        implementation: :data:`EAGER`, :data:`SDPA` or another the release knows.

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
    """The modules of ``model``'s class built from its config with ``implementation``, on the
    meta device (no memory, no initialisation): what 4.x would have built."""
    with torch.device("meta"):
        twin = type(model)._from_config(model.config, attn_implementation=implementation)
    return dict(twin.named_modules())


def _become(module: nn.Module, like: nn.Module) -> None:
    """``module`` takes the class of ``like`` and the plain attributes that class's
    ``__init__`` set on it (GPT-2's sdpa attention keeps a flag of its own); its parameters,
    buffers and submodules stay."""
    module.__class__ = type(like)
    own = ("_parameters", "_buffers", "_modules")
    for key, value in vars(like).items():
        if key not in vars(module) and key not in own and not isinstance(value, torch.Tensor):
            vars(module)[key] = value
