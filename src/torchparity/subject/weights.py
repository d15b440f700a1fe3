"""Weights and inputs that are the same on every machine, for any model.

Goldens record a checksum of the weights, but torch's CPU ``normal_`` rounds differently by
instruction set; these draw from the zoo's counter-based generator
(:mod:`torchparity.reference.rng`), bit-identical everywhere.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchparity.reference import rng
from torchparity.subject.running import local_part
from torchparity.subject.slices import part

#: Spread of a norm's weight around 1 and of its bias around 0.
NORM_SPREAD = 0.05
#: Standard deviation of embedding tables and biases (transformers' ``initializer_range``).
SMALL_STD = 0.02


def init_weights(model: nn.Module, seed: int) -> nn.Module:
    """Fill a model's weights with values that are the same on every machine.

    The values are uniform (a normal draw needs ``log`` and ``cos``, whose last bit differs
    between math libraries), depend only on ``seed`` and the tensor's name, and have a fresh
    transformer's scales: a norm's weight 1 and bias 0, each moved by 0.05 (so a dropped or
    misplaced one changes the output); weights of 2+ dimensions std 1/sqrt(fan-in); anything else
    std 0.02.

    Tied parameters are filled once; a DTensor gets its part of the whole draw on each rank;
    integer tensors and non-persistent buffers (rotary frequencies) are left as they are.

    Args:
        model: the model, filled in place.
        seed: which draw of the weights.

    Returns:
        ``model`` itself.
    """
    seen: set[int] = set()
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if not tensor.is_floating_point() or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            module_name, _, tensor_name = name.rpartition(".")
            module = model.get_submodule(module_name)
            std, mean = _scale(module, tensor_name, tensor)
            values = rng.symmetric(seed, name, tensor.shape, std) + mean
            local_part(tensor).copy_(part(values, tensor))  # a sharded one: this rank's part
    return model


def random_tensor(shape: tuple[int, ...], seed: int, *, std: float = 1.0,
                  dtype: torch.dtype = torch.float32, stream: str = "inputs") -> torch.Tensor:
    """A tensor of uniform values the same on every machine (``torch.randn`` is not), on the CPU.

    Args:
        shape: the tensor's shape.
        seed: which draw.
        std: the values' standard deviation (their mean is 0).
        dtype: the tensor's dtype; the values are drawn in float64 and rounded to it.
        stream: a name; different names give independent values for one seed.
    """
    return rng.symmetric(seed, stream, shape, std).to(dtype)


def _scale(module: nn.Module, name: str, tensor: torch.Tensor) -> tuple[float, float]:
    """(std, mean) of one tensor's uniform values (see :func:`init_weights`)."""
    if "Norm" in type(module).__name__:
        return NORM_SPREAD, 1.0 if name in ("weight", "running_var") else 0.0
    if tensor.dim() < 2 or name == "bias" or isinstance(module, nn.Embedding):
        return SMALL_STD, 0.0
    # activations keep their size through the layers; attention scores of order 1
    return 1.0 / math.sqrt(_fan_in(module, tensor)), 0.0


def _fan_in(module: nn.Module, tensor: torch.Tensor) -> int:
    if isinstance(module, nn.Linear):
        return module.in_features
    if type(module).__name__ == "Conv1D":  # transformers' GPT-2 layers store (in, out)
        return tensor.shape[0]
    return math.prod(tensor.shape[1:])


#: torch's CPU draws whose last bits depend on the instruction set (a vectorised normal).
_NORMAL_DRAWS = {"normal", "normal_", "randn", "randn_like"}
#: In-place ops that overwrite their tensor without reading it.
_OVERWRITES = {"copy_", "fill_", "zero_", "uniform_", "random_", "bernoulli_", "exponential_",
               "geometric_", "cauchy_", "log_normal_"}


class NormalDraws(TorchDispatchMode):
    """Marks the tensors holding values of torch's CPU normal draws while it is active."""

    def __init__(self) -> None:
        super().__init__()
        self._drawn: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        inputs = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        drawn = name in _NORMAL_DRAWS and all(
            t.device.type == "cpu" for t in tree_leaves(out) if isinstance(t, torch.Tensor))
        if name.endswith("_") and args and isinstance(args[0], torch.Tensor):
            written = [args[0]]
            read = inputs[1:] if drawn or name in _OVERWRITES else inputs
        else:
            written = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            read = inputs
        # computed from a marked tensor marks it; an overwrite (tp.init_weights' copy_) clears it;
        # known by storage, so views share it
        marked = drawn or any(_storage(t) in self._drawn for t in read)
        for tensor in written:
            (self._drawn.add if marked else self._drawn.discard)(_storage(tensor))
        return out

    def drawn(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """The names among ``tensors`` whose values a golden made here would not reproduce."""
        return [name for name, tensor in tensors.items() if _storage(tensor) in self._drawn]


def _storage(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, ...)
        return id(tensor)
