"""Where a model computes in a narrower dtype than its own: its *islands*.

Some models compute parts of their forward pass in float32 whatever their dtype, by design:
``transformers``' Llama casts the input of every RMSNorm to float32 and computes its rotary
table in float32, eager attention upcasts the softmax to float32 only. Run in float64, such a
model is float64 everywhere but there, and its float64 golden is as precise as float32 at
those points: a rerun on weights moved by one float64 rounding can move a float32 rounding
there, and errs like a float32 computation.

:class:`Islands` watches a float64 run and records every module in which an operation turned
float64 values into a narrower floating dtype (a cast such as ``.to(torch.float32)``), so that
the golden can say where the model does not compute in float64 and the budgets can account
for it (:func:`torchparity.comparison.compare`'s ``islands``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.hooks import RemovableHandle

from torchparity.subject.trees import PyTree


class Islands(TorchDispatchMode):
    """Inside the ``with`` block, record the modules of ``model`` whose forward turned float64
    values into a narrower floating dtype.

    >>> with Islands(model) as islands:
    ...     model(**float64_inputs)
    >>> islands.found   # {"float32": ["model.layers.0.input_layernorm", ...]}

    Guarantees: :attr:`found` maps each narrower dtype's name (``float32``, ``bfloat16``) to
    the modules, in the order they ran, whose own code (not a child's) made such a value; the
    model is untouched, and the values computed too but for a float64 value too large for the
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

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
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


def _saturated(args: tuple[Any, ...], dtype: torch.dtype | None) -> tuple[Any, ...]:
    """A float64 value cast narrower saturates at the narrower dtype's largest finite value.

    A model's masks hold its own dtype's lowest value; run in float64 they hold float64's,
    which a float32 softmax (eager attention's) would read as -inf, a row of them as NaN. In
    the model's own dtype they are finite: so they stay here.
    """
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
    """The least precise dtype among ``islands``: the one that bounds a float64 golden's accuracy.

    Args:
        islands: :attr:`Islands.found`, or None.

    Returns:
        Its name (``bfloat16``), or None without any island.
    """
    dtypes = [getattr(torch, name) for name, modules in (islands or {}).items() if modules]
    return str(max(dtypes, key=lambda d: torch.finfo(d).eps)).removeprefix("torch.") \
        if dtypes else None


def summary(modules: Iterable[str]) -> list[str]:
    """Module names with each repeated block's index written ``*``, once each, for a short report.

    Args:
        modules: module names, such as :attr:`Islands.found` gives.

    Returns:
        ``model.layers.*.input_layernorm`` once for the sixteen layers' input norms, in first
        appearance order.
    """
    return list(dict.fromkeys(re.sub(r"\.\d+(?=\.|$)", ".*", name) for name in modules))
