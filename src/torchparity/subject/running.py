"""Calling a model under test the same way everywhere: inputs, one seeded call, the default loss.
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
from collections.abc import Callable, Iterator, Mapping

import torch
from torch import nn

from torchparity.comparison.selection import PaddingSpec, left_out_of
from torchparity.errors import UsageError
from torchparity.reference import rng
from torchparity.subject.trees import PyTree, map_tensors

#: A tuple of positional arguments, a dict of keyword arguments, or one tensor.
Inputs = tuple[PyTree, ...] | dict[str, PyTree] | torch.Tensor
#: ``loss_fn(output, inputs) -> scalar tensor``; ``inputs`` are the model inputs as given
#: (upcast to float64 for a golden run), so ``torchparity.reference.sequence_loss`` fits.
LossFn = Callable[[PyTree, PyTree], torch.Tensor]

#: The seed of every run's CPU random stream.
SEED = 0
_LOSS_SEED = 0


def call_model(model: nn.Module, inputs: Inputs) -> PyTree:
    """Call ``model`` with a dict (``model(**inputs)``), a tuple (``model(*inputs)``) or one tensor.
    """
    if isinstance(inputs, Mapping):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    if isinstance(inputs, torch.Tensor):
        return model(inputs)
    raise UsageError(f"inputs must be a tuple of positional arguments or a dict of keyword "
                     f"arguments; got {type(inputs).__name__}")


@contextlib.contextmanager
def seeded() -> Iterator[None]:
    """Same CPU RNG stream for every run and replay; the caller's CPU RNG state is restored."""
    # CUDA generators are left alone: seeding them is costly, and active dropout is refused
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(SEED)
        yield


def check_models(**models: object) -> None:
    """Refuse a non-module, or one with active dropout, that two runs would not compute the same.
    """
    for label, model in models.items():
        if not isinstance(model, nn.Module):
            raise UsageError(f"{label} is not a torch.nn.Module (got {type(model).__name__})")
        active = [name for name, m in model.named_modules()
                  if isinstance(m, nn.modules.dropout._DropoutNd) and m.training and m.p > 0]
        if active:
            raise UsageError(f"{label} has active dropout ({active[0] or 'root'}); call "
                             "model.eval() so that both runs are deterministic")


def cast_inputs(tree: PyTree, device: str | torch.device, dtype: torch.dtype) -> PyTree:
    """``tree`` with floating tensors in ``dtype``, all on ``device``; tensors already so shared.
    """
    if isinstance(tree, torch.Tensor):
        return tree.to(device, dtype) if tree.is_floating_point() else tree.to(device)
    if isinstance(tree, Mapping):
        return {k: cast_inputs(v, device, dtype) for k, v in tree.items()}
    if isinstance(tree, tuple | list):
        return type(tree)(cast_inputs(v, device, dtype) for v in tree)
    return tree


def upcast(tree: PyTree, dtype: torch.dtype | None, device: torch.device | str | None = None
           ) -> PyTree:
    """Detached copies of ``tree``'s tensors, floating ones in ``dtype`` (None: unchanged)."""
    def cast(t: torch.Tensor) -> torch.Tensor:
        target = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return t.detach().to(device=device or t.device, dtype=target, copy=True)

    return map_tensors(tree, cast)


def in_dtype(models: list[nn.Module], inputs: Inputs, dtype: torch.dtype | None
             ) -> tuple[list[nn.Module], Inputs]:
    """Copies of ``models`` and ``inputs`` with floating tensors in ``dtype`` (None: the originals).
    """
    if dtype is None:
        return models, inputs
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise UsageError(f"dtype must be a floating torch dtype such as torch.float64; "
                         f"got {dtype!r}")
    # each tensor converted once (see converted): a float64 run needs only its float64 copy
    return [_copy_in(m, dtype) for m in models], upcast(inputs, dtype)


def _copy_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    device = next((t.device for t in [*model.parameters(), *model.buffers()]),
                  torch.device("cpu"))
    cast = converted(model, device, dtype)
    return copy.deepcopy(model) if cast is model else cast


def on_meta(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device: parameters without memory yet."""
    return any(param.is_meta for param in model.parameters())


def mark_unfilled(model: nn.Module) -> None:
    """Fill a model just given memory (``to_empty``) with NaN before the factory's ``init`` runs.
    """
    # so left_unfilled finds what init did not fill, not whatever the allocator left
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.is_floating_point():
                local_part(tensor).fill_(math.nan)


def left_unfilled(model: nn.Module) -> str | None:
    """``parameter NAME`` or ``buffer NAME``: the first still NaN from :func:`mark_unfilled`."""
    named = [("parameter", model.named_parameters()), ("buffer", model.named_buffers())]
    with torch.no_grad():
        for kind, tensors in named:
            for name, tensor in tensors:
                if tensor.is_floating_point() and bool(local_part(tensor).isnan().any()):
                    return f"{kind} {name}"
    return None


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor, without importing torch.distributed.tensor (seconds)."""
    module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before that import
    return module is not None and isinstance(tensor, module.DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (its memory), outside autograd; a plain tensor as it is."""
    if not is_dtensor(tensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def grad_hooks(parameter: torch.Tensor) -> list[Callable[[torch.Tensor], torch.Tensor | None]]:
    """The hooks registered on ``parameter``'s gradient (``register_hook``), in order."""
    # a sharding plan's reduction lives there, and a copy of the parameter or a gradient computed
    # beside autograd must pass through it too; PyTorch has no public way to list them
    return list((parameter._backward_hooks or {}).values())


def converted(model: nn.Module, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
    """``model`` with floating tensors in ``dtype`` on ``device``: itself if so, else a copy."""
    device = torch.device(device)
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.device == device and (t.dtype == dtype or not t.is_floating_point())
           for t in tensors):
        return model

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device, dtype if t.is_floating_point() else t.dtype, copy=True)

    # each tensor converted once, so no copy in the old dtype exists; one memo entry per parameter
    # keeps tied ones tied
    memo: dict[int, torch.Tensor] = {}
    for param in model.parameters():
        memo[id(param)] = nn.Parameter(convert(param), requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = convert(buffer)
    return copy.deepcopy(model, memo)


#: Fields of a model's output that hold its cache for the next call (transformers 4.x returns
#: ``past_key_values`` as tuples, 5.x a ``cache`` object): state rather than a result of this
#: call, kept in containers that differ between releases.
CACHE_FIELDS = frozenset({"past_key_values", "cache", "cache_params", "mems"})


def in_cache(path: str) -> bool:
    """Whether an output's ``path`` (``output.past_key_values.0.0``) lies in a :data:`CACHE_FIELDS`.
    """
    return bool(CACHE_FIELDS.intersection(path.split(".")[1:2]))


def default_loss_paths(flat: Mapping[str, torch.Tensor]) -> list[str]:
    """The outputs the default loss projects: the floating tensors no cache holds."""
    # what two revisions both return by meaning, so goldens of one library release check another
    return [path for path, tensor in flat.items()
            if tensor.is_floating_point() and not in_cache(path)]


def projection_loss(outputs: Mapping[str, torch.Tensor], padding: PaddingSpec = None
                    ) -> torch.Tensor:
    """A loss whose gradient reaches every element of every floating output ``padding`` keeps."""
    # fixed pseudo-random weights, a pure function of path and shape, scaled to O(1)
    total = sum(t.numel() for t in outputs.values())
    loss = None
    for path, tensor in outputs.items():
        compute = torch.promote_types(tensor.dtype, torch.float32)
        weights = rng.symmetric(_LOSS_SEED, f"loss.{path}", tensor.shape, 1.0 / math.sqrt(total))
        weights = weights.to(tensor.device, compute)
        left_out = left_out_of(padding, path, tensor)
        # selected away, not weighted by zero: a NaN there reaches no loss or gradient
        if left_out is not None:
            tensor, weights = left_out.judged(tensor), left_out.judged(weights)
        term = (tensor.to(compute) * weights).sum()
        loss = term if loss is None else loss + term
    if loss is None:
        raise UsageError("the output has no floating tensor to take gradients of")
    return loss
