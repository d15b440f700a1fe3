"""Where a model computes in a narrower dtype than its own: its *islands*.

Llama casts each RMSNorm's input to float32, eager attention its softmax: run in float64, such a
model is only as precise as float32 there. :class:`Islands` records those modules so the golden
says where, and the budgets account for it (:func:`torchparity.comparison.compare`'s
``islands``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from torchparity.subject.trees import PyTree


class Islands(TorchDispatchMode):
    """Inside the ``with`` block, record the modules whose own code turned float64 values narrower.

    >>> with Islands(model) as islands:
    ...     model(**float64_inputs)
    >>> islands.found   # {"float32": ["model.layers.0.input_layernorm", ...]}

    The model is untouched, and the values computed too but for a float64 value too large for the
    narrower dtype, which saturates there (see :func:`_saturated`).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self._names = {id(m): name or type(m).__name__ for name, m in model.named_modules()}
        self._stack: list[str] = []
        self._handles: list[RemovableHandle] = []
        self._found: dict[str, dict[str, None]] = {}

    def __enter__(self) -> Islands:
        self._handles = [nn.modules.module.register_module_forward_pre_hook(self._enter),
                         nn.modules.module.register_module_forward_hook(self._leave,
                                                                        always_call=True)]
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        super().__exit__(*exc)

    @property
    def found(self) -> dict[str, list[str]]:
        """Each narrower dtype's name (``float32``) -> the modules computing in it, in run order."""
        return {dtype: list(modules) for dtype, modules in self._found.items()}

    def _enter(self, module: nn.Module, args: tuple[object, ...]) -> None:
        name = self._names.get(id(module))
        if name is not None:
            self._stack.append(name)

    def _leave(self, module: nn.Module, args: tuple[object, ...], output: object) -> None:
        if self._names.get(id(module)) is not None and self._stack:
            self._stack.pop()

    def __torch_dispatch__(self, func: torch._ops.OpOverload, types: object,
                           args: tuple[object, ...] = (), kwargs: dict[str, object] | None = None
                           ) -> object:
        if func is torch.ops.aten._to_copy.default:
            args = _saturated(args, (kwargs or {}).get("dtype"))
        out = func(*args, **(kwargs or {}))
        if self._stack:
            # Most operations give float64: what they read is looked at only when not.
            narrower = {str(t.dtype).removeprefix("torch.") for t in _tensors(out)
                        if t.is_floating_point() and t.dtype != torch.float64}
            if narrower and any(t.dtype == torch.float64 for t in _tensors((args, kwargs))):
                for dtype in sorted(narrower):
                    self._found.setdefault(dtype, {})[self._stack[-1]] = None
        return out


def _saturated(args: tuple[object, ...], dtype: torch.dtype | None) -> tuple[object, ...]:
    """A float64 value cast narrower saturates at the narrower dtype's largest finite value."""
    # masks hold float64's lowest value, which a float32 softmax would read as -inf (a row of them
    # NaN); in the model's own dtype they are finite
    source = args[0]
    if (dtype is None or not dtype.is_floating_point or source.dtype != torch.float64
            or torch.finfo(dtype).max >= torch.finfo(torch.float64).max):
        return args
    bound = torch.finfo(dtype).max
    return (source.clamp(-bound, bound).where(source.isfinite(), source), *args[1:])


def _tensors(tree: PyTree) -> list[torch.Tensor]:
    if isinstance(tree, torch.Tensor):  # an operation's usual output, without a tree walk
        return [tree]
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def narrowest(islands: dict[str, Iterable[str]] | None) -> str | None:
    """The least precise dtype among ``islands``: it bounds a float64 golden's accuracy."""
    dtypes = [getattr(torch, name) for name, modules in (islands or {}).items() if modules]
    return str(max(dtypes, key=lambda d: torch.finfo(d).eps)).removeprefix("torch.") \
        if dtypes else None


def summary(modules: Iterable[str]) -> list[str]:
    """Module names with each block's index written ``*``, once each: ``model.layers.*.norm``."""
    return list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", name) for name in modules))
