"""The first call of the model in a user's training step, with its outputs' gradients."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from torchparity.errors import TorchParityError
from torchparity.subject.model import Subject
from torchparity.subject.trees import flatten_tensors, map_tensors
from torchparity.threads import single_thread
from torchparity.train.trainer import OWN_ATTENTION, Execution
from torchparity.train.user_model import UserRecipe, UserTrainer


def a_execution(execution: Execution) -> Execution:
    """A's execution: the model's own attention (or manual) in B's dtype."""
    # A's own rounding then sets B's budget
    backend = OWN_ATTENTION if execution.backend == OWN_ATTENTION else "manual"
    return Execution(backend, execution.dtype, execution.device)



@dataclass
class StepCall:
    """The first call of the model in a training step and the gradients of its outputs."""

    inputs: Any
    gradients: dict[str, torch.Tensor]
    calls: int

    def loss_fn(self) -> Callable[[Any, Any], torch.Tensor]:
        """The step's loss, linear in the output: its gradient is the step's."""
        gradients = self.gradients

        def loss(output: Any, inputs: Any) -> torch.Tensor:
            total = None
            for path, tensor in flatten_tensors(output, "output").items():
                if path in gradients:
                    compute = torch.promote_types(tensor.dtype, torch.float32)
                    term = (tensor.to(compute) * gradients[path].to(tensor.device, compute)).sum()
                    total = term if total is None else total + term
            return total
        return loss

    def describe(self) -> str:
        head = "its call of the model" if self.calls == 1 else \
            f"the first of its {self.calls} calls of the model"
        return f"{head}, with the gradient the step's loss gave the output"


def capture_call(trainer: UserTrainer, step: int) -> StepCall:
    """Run step ``step`` on ``trainer`` and keep its first call of the model."""
    first = _FirstCall()
    handle = trainer.model.register_forward_hook(first, with_kwargs=True)
    try:
        trainer.step(step)
    finally:
        handle.remove()
    if not first.gradients:
        raise TorchParityError(f"step {step} of {trainer.subject.entry} did not call the model "
                               "with gradients reaching its output: nothing to diagnose")
    return StepCall(first.inputs, first.gradients, first.calls)


class _FirstCall:
    """A forward hook keeping the model's first call's inputs and its outputs' gradients."""

    def __init__(self) -> None:
        self.calls, self.inputs = 0, None
        self.gradients: dict[str, torch.Tensor] = {}

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.calls += 1
        if self.calls > 1:
            return
        self.inputs = _inputs(module, _copied(args), _copied(kwargs))
        for path, tensor in flatten_tensors(output, "output").items():
            if tensor.requires_grad:
                tensor.register_hook(lambda g, path=path: self._keep(path, g))

    def _keep(self, path: str, grad: torch.Tensor) -> None:
        self.gradients[path] = grad.detach().clone()


def _copied(tree: Any) -> Any:
    # the call's inputs as they were: the step may change them in place after the call
    return map_tensors(tree, lambda tensor: tensor.detach().clone())


def _inputs(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    if not kwargs:
        return args
    if not args:
        return kwargs
    return dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)


def trained_before(subject: Subject, step: int, device: str) -> UserTrainer:
    """A trainer of ``subject`` in float64 that has taken steps 1..``step - 1``."""
    trainer = UserTrainer(subject, UserRecipe(subject.entry, step),
                          Execution(OWN_ATTENTION, "fp64", device))
    with cpu_thread(Execution(OWN_ATTENTION, "fp64", device)):
        for before in range(1, step):
            trainer.step(before)
    return trainer


def cpu_thread(execution: Execution) -> contextlib.AbstractContextManager:
    # one thread on the CPU, as the trajectories were trained
    on_cpu = torch.device(execution.device).type == "cpu"
    return single_thread() if on_cpu else contextlib.nullcontext()


