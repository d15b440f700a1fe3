"""Both implementations built with the same weights.

A module built here is filled: the old one by ``init_weights(seed)``, the new one from the old
one's by ``weight_map``: ``{new name: old name}`` (a list of old names concatenated along
dimension 0: a fused projection), or a function of the old ``state_dict``. Modules given as they
are keep their weights.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from typing import TypeAlias

import torch
from torch import nn

from torchparity.errors import UsageError, UserCodeError
from torchparity.subject.weights import init_weights

Buildable: TypeAlias = nn.Module | Callable[..., nn.Module]
WeightMap: TypeAlias = Mapping[str, str | Sequence[str]] | Callable[[dict], dict]
Tensors: TypeAlias = dict[str, torch.Tensor]


def build(old: Buildable, new: Buildable, *, init: Mapping[str, object] | None = None,
          seed: int = 0, weight_map: WeightMap | None = None) -> tuple[nn.Module, nn.Module]:
    """The old and the new module, in float32 unless given otherwise, with the same weights."""
    old_module = _make(old, init, "old")
    if not isinstance(old, nn.Module):
        init_weights(old_module.float(), seed)
    new_module = _make(new, init, "new")
    if not isinstance(new, nn.Module) or weight_map is not None:
        load(new_module, convert(old_module.state_dict(), weight_map))
    return old_module, new_module


def _make(side: Buildable, init: Mapping[str, object] | None, label: str) -> nn.Module:
    if isinstance(side, nn.Module):
        return side
    if not callable(side):
        raise UsageError(f"the {label} implementation must be a module, a class or a factory; "
                         f"got {type(side).__name__}")
    try:
        module = side(**(init or {}))
    except Exception as exc:
        raise UserCodeError(f"building the {label} implementation "
                            f"{getattr(side, '__qualname__', side)}(**{dict(init or {})}) raised "
                            f"{type(exc).__name__}: {exc}") from exc
    if not isinstance(module, nn.Module):
        raise UsageError(f"the {label} factory {getattr(side, '__qualname__', side)} returned "
                         f"{type(module).__name__}, not a torch.nn.Module")
    return module


def convert(state: Tensors, weight_map: WeightMap | None) -> Tensors:
    """The new module's state from the old one's."""
    if weight_map is None:
        return dict(state)
    if callable(weight_map):
        return dict(weight_map(dict(state)))
    converted = {name: value for name, value in state.items()
                 if name not in _sources(weight_map)}
    for new_name, source in weight_map.items():
        names = [source] if isinstance(source, str) else list(source)
        missing = [name for name in names if name not in state]
        if missing:
            raise UsageError(f"weight_map[{new_name!r}] names {', '.join(missing)}, which the "
                             f"old module does not have; it has {', '.join(state)}")
        converted[new_name] = torch.cat([state[name] for name in names]) if len(names) > 1 \
            else state[names[0]]
    return converted


def _sources(weight_map: Mapping[str, str | Sequence[str]]) -> set[str]:
    return {name for source in weight_map.values()
            for name in ([source] if isinstance(source, str) else source)}


def load(module: nn.Module, state: Tensors) -> None:
    """Load ``state`` into ``module``; a one-line error naming what does not fit."""
    own = module.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    misshapen = sorted(name for name in set(own) & set(state)
                       if own[name].shape != state[name].shape)
    if missing or unexpected or misshapen:
        problems = [f"{what}: {', '.join(names)}" for what, names in (
            ("missing", missing), ("unexpected", unexpected), ("other shape", misshapen))
            if names]
        raise UsageError("the old module's weights do not fit the new one ("
                         + "; ".join(problems) + "): give weight_map={new name: old name}")
    module.load_state_dict(state)


def old_layout(grads: Tensors, weight_map: WeightMap | None, old_state: Tensors) -> Tensors:
    """The new module's parameter gradients under the old one's names, split where map joined."""
    # a map function: only tensors it passes through unchanged (the same objects), whose layout it
    # cannot have changed
    if callable(weight_map):
        converted = weight_map(dict(old_state))
        return {name: g for name, g in grads.items()
                if name in old_state and converted.get(name) is old_state[name]}
    out = {name: g for name, g in grads.items()
           if weight_map is None or name not in weight_map}
    for new_name, source in (weight_map or {}).items():
        if new_name not in grads:
            continue
        names = [source] if isinstance(source, str) else list(source)
        sizes = [old_state[name].shape[0] for name in names]
        out.update(zip(names, grads[new_name].split(sizes), strict=True))
    return out


def copy_in(module: nn.Module, dtype: torch.dtype, device: str | torch.device) -> nn.Module:
    """A copy of ``module`` on ``device`` with its floating tensors in ``dtype``."""
    return copy.deepcopy(module).to(device=device, dtype=dtype)
