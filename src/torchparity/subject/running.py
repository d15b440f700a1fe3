"""Calling a model under test the same way everywhere: its inputs (cast, moved, copied), one
seeded call, and the default loss whose gradient reaches every output element."""

from __future__ import annotations

import contextlib
import copy
import math
import sys
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

from torchparity.comparison.selection import PaddingSpec, left_out_of
from torchparity.errors import UsageError
from torchparity.reference import rng
from torchparity.subject.trees import PyTree, map_tensors

#: A tuple of positional arguments, a dict of keyword arguments, or one tensor.
Inputs = tuple[Any, ...] | dict[str, Any] | torch.Tensor
#: ``loss_fn(output, inputs) -> scalar tensor``; ``inputs`` are the model inputs as given
#: (upcast to float64 for a golden run), so ``torchparity.reference.sequence_loss`` fits.
LossFn = Callable[[PyTree, PyTree], torch.Tensor]

#: The seed of every run's CPU random stream.
SEED = 0
_LOSS_SEED = 0


def call_model(model: nn.Module, inputs: Inputs) -> PyTree:
    """Call ``model`` with ``inputs`` the way their form says, the same in every wing.

    Args:
        model: the model under test.
        inputs: a dict (``model(**inputs)``), a tuple (``model(*inputs)``) or one tensor.

    Returns:
        Whatever the model returns: a pytree of tensors.

    Raises:
        UsageError: ``inputs`` are none of the three forms.
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
    """Same CPU RNG stream for every run and replay; the caller's CPU RNG state is restored.

    CUDA generators are left alone: seeding them is costly, and active dropout is refused.

    Yields:
        Nothing; the block runs on the seeded stream.
    """
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(SEED)
        yield


def check_models(**models: object) -> None:
    """Refuse a model that two runs would not compute the same.

    Args:
        **models: the models by the name a message gives them (``model_a=...``).

    Raises:
        UsageError: one is not an ``nn.Module``, or has active dropout (the fix: ``.eval()``).
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
    """``tree`` with floating tensors in ``dtype`` and every tensor on ``device``.

    Tensors already there are shared, not copied: inputs of a cell cost no memory twice.

    Args:
        tree: the model's inputs.
        device: where every tensor goes.
        dtype: the dtype of the floating tensors; integer tensors (token ids) keep theirs.

    Returns:
        The inputs rebuilt (mappings as plain dicts, tuples and lists as their types).
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
    """Copies of ``tree``'s tensors, floating ones in ``dtype``: the originals stay untouched.

    Args:
        tree: a model's inputs or outputs.
        dtype: the dtype of the floating tensors (None: unchanged).
        device: where every tensor goes (None: unchanged).

    Returns:
        The tree with its containers' types kept and every tensor a detached copy.
    """
    def cast(t: torch.Tensor) -> torch.Tensor:
        target = dtype if dtype is not None and t.is_floating_point() else t.dtype
        return t.detach().to(device=device or t.device, dtype=target, copy=True)

    return map_tensors(tree, cast)


def in_dtype(models: list[nn.Module], inputs: Inputs, dtype: torch.dtype | None
             ) -> tuple[list[nn.Module], Inputs]:
    """Copies of ``models`` and ``inputs`` with their floating tensors in ``dtype``.

    Each tensor is converted once, with no second copy in the old dtype (see
    :func:`converted`): a float64 run of a big model needs only its float64 copy.

    Args:
        models: the models to convert.
        inputs: their inputs, cast alike.
        dtype: a floating dtype, or None for the originals.

    Returns:
        The converted models, in order, and the converted inputs.

    Raises:
        UsageError: ``dtype`` is not a floating ``torch.dtype``.
    """
    if dtype is None:
        return models, inputs
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise UsageError(f"dtype must be a floating torch dtype such as torch.float64; "
                         f"got {dtype!r}")
    return [_copy_in(m, dtype) for m in models], upcast(inputs, dtype)


def _copy_in(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    device = next((t.device for t in [*model.parameters(), *model.buffers()]),
                  torch.device("cpu"))
    cast = converted(model, device, dtype)
    return copy.deepcopy(model) if cast is model else cast


def on_meta(model: nn.Module) -> bool:
    """Whether ``model`` was built on the meta device: parameters without memory yet.

    Args:
        model: the factory's model.

    Returns:
        True when any parameter is on the meta device.
    """
    return any(param.is_meta for param in model.parameters())


def mark_unfilled(model: nn.Module) -> None:
    """Fill a model just given memory (``to_empty``) with NaN before the factory's ``init`` runs.

    :func:`left_unfilled` then finds what ``init`` did not fill, instead of a run reading
    whatever the allocator left there.

    Args:
        model: the model, its floating parameters and buffers filled in place.
    """
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            if tensor.is_floating_point():
                local_part(tensor).fill_(math.nan)


def left_unfilled(model: nn.Module) -> str | None:
    """The first floating tensor of ``model`` still holding a NaN of :func:`mark_unfilled`.

    Args:
        model: the model after the factory's ``init`` (this rank's part, for a DTensor).

    Returns:
        ``parameter NAME`` or ``buffer NAME`` for a message, or None when every one was filled.
    """
    named = [("parameter", model.named_parameters()), ("buffer", model.named_buffers())]
    with torch.no_grad():
        for kind, tensors in named:
            for name, tensor in tensors:
                if tensor.is_floating_point() and bool(local_part(tensor).isnan().any()):
                    return f"{kind} {name}"
    return None


def is_dtensor(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is a DTensor, without importing torch.distributed.tensor.

    That import takes seconds, and no DTensor exists before it.

    Args:
        tensor: any tensor.

    Returns:
        True for a DTensor.
    """
    module = sys.modules.get("torch.distributed.tensor")
    return module is not None and isinstance(tensor, module.DTensor)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (its memory), outside autograd; a plain tensor as it is.

    Args:
        tensor: a plain tensor or a DTensor.

    Returns:
        The tensor whose memory this process holds.
    """
    if not is_dtensor(tensor):
        return tensor
    with torch.no_grad():
        return tensor.to_local()


def grad_hooks(parameter: torch.Tensor) -> list[Callable[[torch.Tensor], torch.Tensor | None]]:
    """The hooks registered on ``parameter``'s gradient (``register_hook``), in order.

    A sharding plan's reduction lives there, and a copy of the parameter, or a gradient
    computed beside autograd, must pass through it too. PyTorch has no public way to list them.

    Args:
        parameter: a model's parameter.

    Returns:
        The hooks, each taking and returning a gradient.
    """
    return list((parameter._backward_hooks or {}).values())


def converted(model: nn.Module, device: str | torch.device, dtype: torch.dtype) -> nn.Module:
    """``model`` with floating parameters and buffers in ``dtype``, everything on ``device``.

    Each tensor is converted once, so no second copy in the old dtype exists; tied parameters
    stay tied (one memo entry per parameter).

    Args:
        model: the model to convert.
        device: where its tensors go.
        dtype: the dtype of its floating tensors.

    Returns:
        ``model`` itself when it is already so, else the converted copy.
    """
    device = torch.device(device)
    tensors = [*model.parameters(), *model.buffers()]
    if all(t.device == device and (t.dtype == dtype or not t.is_floating_point())
           for t in tensors):
        return model

    def convert(t: torch.Tensor) -> torch.Tensor:
        return t.detach().to(device, dtype if t.is_floating_point() else t.dtype, copy=True)

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
    """Whether an output's ``path`` lies in one of its :data:`CACHE_FIELDS`.

    Args:
        path: a path flattened under the output's root (``output.past_key_values.0.0``).

    Returns:
        True when the path's first field after the root holds a cache.
    """
    return bool(CACHE_FIELDS.intersection(path.split(".")[1:2]))


def default_loss_paths(flat: Mapping[str, torch.Tensor]) -> list[str]:
    """The outputs the default loss projects: the floating tensors no cache holds.

    What two revisions both return by meaning (logits, hidden states) is all it reads, so
    goldens made with one release of a library check the loss and gradients under another.

    Args:
        flat: an output flattened under its root (``output.logits``).

    Returns:
        The paths of ``flat`` the loss reads, in order.
    """
    return [path for path, tensor in flat.items()
            if tensor.is_floating_point() and not in_cache(path)]


def projection_loss(outputs: Mapping[str, torch.Tensor], padding: PaddingSpec = None
                    ) -> torch.Tensor:
    """A loss whose gradient reaches every element of every floating output.

    The dot product of the ``outputs`` with fixed pseudo-random weights (a pure function of
    each path and shape, the same on every machine), computed in at least float32 and scaled to
    O(1). Positions that ``padding`` leaves out are selected away, not weighted by zero: they get
    no gradient, and a NaN there reaches neither the loss nor any gradient.

    Args:
        outputs: the floating outputs by path.
        padding: a :class:`~torchparity.subject.padding.Padding` keyed by the outputs' paths, or
            None to judge every position.

    Returns:
        The scalar loss.

    Raises:
        UsageError: no output is floating, so there is nothing to take gradients of.
    """
    total = sum(t.numel() for t in outputs.values())
    loss = None
    for path, tensor in outputs.items():
        compute = torch.promote_types(tensor.dtype, torch.float32)
        weights = rng.symmetric(_LOSS_SEED, f"loss.{path}", tensor.shape, 1.0 / math.sqrt(total))
        weights = weights.to(tensor.device, compute)
        left_out = left_out_of(padding, path, tensor)
        if left_out is not None:
            tensor, weights = left_out.judged(tensor), left_out.judged(weights)
        term = (tensor.to(compute) * weights).sum()
        loss = term if loss is None else loss + term
    if loss is None:
        raise UsageError("the output has no floating tensor to take gradients of")
    return loss
