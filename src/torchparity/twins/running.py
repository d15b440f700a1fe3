"""One implementation run on the twins' inputs: its outputs and, where asked, gradients.

Floating inputs are cast to the run's dtype; ids, masks and positions pass as they are.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TypeAlias

import torch
from torch import nn

from torchparity import backends
from torchparity.comparison import shared_tensors
from torchparity.errors import UserCodeError
from torchparity.subject.trees import PyTree
from torchparity.subject.weights import random_tensor

Inputs: TypeAlias = "tuple | dict | Steps"
#: Keyword inputs whose names hold one of these are not differentiated: masks and biases
#: steer attention, no loss is a function of them.
NOT_DIFFERENTIATED = ("mask", "bias")


class Steps(list):
    """The inputs of a decoding twin's steps, in order: each a tuple or a dict."""

    def __repr__(self) -> str:
        return f"Steps({list.__repr__(self)})"


@dataclass
class Run:
    """What one run gave: outputs (Steps: a list) and gradients, None if not computed."""

    outputs: PyTree
    grads: dict[str, dict[str, torch.Tensor]] | None = None


def forward(module: nn.Module, inputs: Inputs, backend: str | None, *, grads: bool,
            cache: Callable[[], object] | None = None) -> tuple[Run, dict[str, torch.Tensor]]:
    """Run ``module`` on cast ``inputs`` under ``backend``; ``grads``: differentiated inputs too."""
    leaves: dict[str, torch.Tensor] = {}
    if grads and not isinstance(inputs, Steps):
        inputs = _requiring_grad(inputs, leaves)
    switch = backends.use(backend) if backend is not None else nullcontext()
    grad_mode = torch.enable_grad() if grads and not isinstance(inputs, Steps) \
        else torch.no_grad()
    try:
        with switch, grad_mode:
            if isinstance(inputs, Steps):
                state = cache() if cache is not None else None
                outputs = [_call(module, step, state) for step in inputs]
            else:
                outputs = _call(module, inputs, None)
    except Exception as exc:
        if isinstance(exc, backends.BackendUnavailable):
            raise
        raise UserCodeError(f"{type(module).__qualname__} raised {type(exc).__name__}: "
                            f"{exc}") from exc
    return Run(outputs), leaves


def _call(module: nn.Module, inputs: tuple | dict, state: PyTree) -> PyTree:
    extra = {} if state is None else {"cache": state}
    if isinstance(inputs, dict):
        return module(**inputs, **extra)
    return module(*inputs, **extra)


def _requiring_grad(inputs: tuple | dict, leaves: dict[str, torch.Tensor]) -> tuple | dict:
    def leaf(name: str, x: object) -> object:
        if (isinstance(x, torch.Tensor) and x.is_floating_point()
                and not any(word in name for word in NOT_DIFFERENTIATED)):
            leaves[name] = x.detach().requires_grad_()
            return leaves[name]
        return x

    if isinstance(inputs, dict):
        return {name: leaf(name, x) for name, x in inputs.items()}
    return tuple(leaf(f"arg{i}", x) for i, x in enumerate(inputs))


def backward(module: nn.Module, run: Run, leaves: dict[str, torch.Tensor], other: PyTree,
             padding: torch.Tensor | None, seed: int) -> None:
    """Fill ``run.grads`` by the inputs and parameters, of the outputs shared with ``other``."""
    # a fixed random projection, the same every run, zero at padding by torch.where, so a padded
    # row's NaN reaches no gradient
    loss = 0.0
    for path, out, _ in shared_tensors(run.outputs, other):
        if not (out.is_floating_point() and out.requires_grad):
            continue
        projection = random_tensor(tuple(out.shape), seed, stream=f"cotangent{path}",
                                   dtype=out.dtype).to(out.device)
        if padding is not None and tuple(out.shape[:padding.dim()]) == tuple(padding.shape):
            keep = ~padding.reshape(*padding.shape, *[1] * (out.dim() - padding.dim()))
            out = torch.where(keep.to(out.device), out, torch.zeros((), dtype=out.dtype,
                                                                    device=out.device))
        loss = loss + (out * projection).sum()
    params = dict(module.named_parameters())
    targets = {**{f"inputs.{n}": x for n, x in leaves.items()},
               **{f"params.{n}": p for n, p in params.items() if p.requires_grad}}
    if not isinstance(loss, torch.Tensor) or not targets:
        return
    found = torch.autograd.grad(loss, list(targets.values()), allow_unused=True)
    grads: dict[str, dict[str, torch.Tensor]] = {"inputs": {}, "params": {}}
    for name, grad in zip(targets, found, strict=True):
        group, _, key = name.partition(".")
        grads[group][key] = torch.zeros_like(targets[name]) if grad is None else grad
    run.grads = grads
