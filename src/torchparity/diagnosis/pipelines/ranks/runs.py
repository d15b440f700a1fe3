"""A user's model run sharded by its own plan on every rank, as a diagnosis across ranks sees
it: each call's output as this rank holds it (a DTensor its part, made whole one call at a
time by :func:`whole_call`), and each parameter's gradient shard, never gathered."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from torchparity.diagnosis.core.capture import call_key
from torchparity.distributed import group, sharding
from torchparity.subject import Subject, slices
from torchparity.subject.running import call_model, cast_inputs, is_dtensor, local_part
from torchparity.subject.slices import Slice, Slices
from torchparity.subject.trees import PyTree, flatten_tensors, map_tensors

#: One call's (or one module's parameters') tensors by path.
Tensors = dict[str, torch.Tensor]
#: The loss a backward starts from, of the whole output and the inputs; a string saying why
#: there is none.
Loss = Callable[[PyTree, PyTree], "torch.Tensor | str"]


@dataclass
class RankRun:
    """What one rank's run leaves, on the CPU (a DTensor output on its mesh's device)."""

    #: call key -> output path -> tensor as this rank holds it (:func:`_kept`)
    outputs: dict[str, Tensors] = field(default_factory=dict)
    #: call key -> (module, its type), in the order the calls finished
    calls: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: module -> when its first call started
    starts: dict[str, int] = field(default_factory=dict)
    #: module -> param.<name> -> this rank's gradient (its shard)
    grads: dict[str, Tensors] = field(default_factory=dict)
    #: module -> param.<name> -> this rank's shard of a whole gradient, cut as its own is
    shard_of: dict[str, dict[str, Callable[[torch.Tensor], torch.Tensor]]] = field(
        default_factory=dict)
    #: why there are no gradients, in a run with a loss
    no_grads: str | None = None

    def module_type(self, module: str) -> str:
        return next((kind for name, kind in self.calls.values() if name == module), "")


def sharded_run(subject: Subject, dtype: torch.dtype, inputs: PyTree, label: str,
                loss: Loss | None = None) -> RankRun:
    """``subject`` in ``dtype`` sharded by its plan, forward on ``inputs`` with every output kept,
    and backward from ``loss`` when given."""
    device = group.device_type()
    group.mark(f"the sharding of {label} (the factory's plan)")
    model, _ = sharding.placed(subject, device, dtype)
    group.mark(f"the forward{'' if loss is None else ' and backward'} of {label}")
    run = RankRun()
    inputs = cast_inputs(inputs, device, dtype)
    handles = _hooks(model, run)
    try:
        with torch.set_grad_enabled(loss is not None):
            output = map_tensors(call_model(model, inputs), sharding.whole)
            if loss is not None:
                value = loss(output, inputs)
                if isinstance(value, str):
                    run.no_grads = value
                else:
                    value.backward()
                    _keep_grads(model, run, subject.slices)
    finally:
        for handle in handles:
            handle.remove()
    return run


def _hooks(model: nn.Module, run: RankRun) -> list[RemovableHandle]:
    counts: dict[str, int] = {}

    def started(name: str):
        def hook(module, args) -> None:
            run.starts.setdefault(name, len(run.starts))
        return hook

    def finished(name: str):
        def hook(module, args, output) -> None:
            key = call_key(name, counts.get(name, 0))
            counts[name] = counts.get(name, 0) + 1
            run.outputs[key] = flatten_tensors(map_tensors(output, _kept))
            run.calls[key] = (name, type(module).__name__)
        return hook

    modules = list(model.named_modules())
    return ([module.register_forward_pre_hook(started(name)) for name, module in modules]
            + [module.register_forward_hook(finished(name)) for name, module in modules])


def _kept(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as this rank holds it, outside autograd: a DTensor a copy of its part on its
    mesh's device (later in-place changes cannot reach it), a plain tensor on the CPU."""
    return tensor.detach().clone() if is_dtensor(tensor) else tensor.detach().cpu()


def whole_call(outputs: Tensors) -> Tensors:
    """One call's ``outputs`` whole on the CPU (each DTensor gathered: a collective)."""
    return {path: sharding.whole(tensor).cpu() for path, tensor in outputs.items()}


def _keep_grads(model: nn.Module, run: RankRun, held: Slices | None) -> None:
    """Each module's parameter gradients as this rank holds them, and how to cut its shard from a
    whole one (a model sharded by hand: the slice ``held`` says)."""
    for name, module in model.named_modules():
        params = [(f"param.{n}", p, held and held.of(f"{name}.{n}".lstrip(".")))
                  for n, p in module.named_parameters(recurse=False) if p.grad is not None]
        if params:
            run.grads[name] = {path: local_part(p.grad).detach().cpu() for path, p, _ in params}
            run.shard_of[name] = {path: functools.partial(_cut, like=p.grad, where=where)
                                  for path, p, where in params}


def _cut(whole: torch.Tensor, like: torch.Tensor, where: Slice | None) -> torch.Tensor:
    return (slices.cut(whole, where) if where else slices.part(whole, like)).cpu()
