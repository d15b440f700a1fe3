"""Weights and inputs that are the same on every machine, for any model.

Goldens record a checksum of the weights, so a factory must build the same weights wherever it
runs. torch's own initialisation does not: its CPU ``normal_`` rounds differently by
instruction set (without AVX against AVX2, x86 against ARM), so a model seeded with
``torch.manual_seed`` on one machine can be another model on the next. These draw from the
zoo's counter-based generator (:mod:`torchparity.reference.rng`: integer hashing and one
multiply-add in float64), whose values are bit-identical everywhere.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from torchparity.distributed.slices import part
from torchparity.reference import rng
from torchparity.subject.running import local_part

#: Spread of a norm's weight around 1 and of its bias around 0.
NORM_SPREAD = 0.05
#: Standard deviation of embedding tables and biases (transformers' ``initializer_range``).
SMALL_STD = 0.02


def init_weights(model: nn.Module, seed: int) -> nn.Module:
    """Fill a model's weights with values that are the same on every machine.

    The values depend only on ``seed`` and the tensor's name. They are uniform (a normal
    draw needs ``log`` and ``cos``, whose last bit differs between math libraries), with the
    scales a freshly initialised transformer has:

    - a norm's weight (any module whose class name has ``Norm``; also a running variance) is
      1, its bias (and running mean) 0, each moved by a spread of 0.05: not exactly 1 and 0,
      so that a refactor which drops or misplaces a norm's weight or bias changes the output;
    - a weight of two or more dimensions has standard deviation 1/sqrt(fan-in)
      (``in_features`` of a ``Linear``, the first dimension of transformers' ``Conv1D``, the
      product of all but the first elsewhere): activations keep their size through the layers
      and attention scores are of order 1, so the softmax is neither flat nor one-hot;
    - an embedding table, a bias and any other tensor have standard deviation 0.02 around 0.

    A model sharded over ranks (DTensor parameters) gets on each rank its part of the values
    one process draws: a parameter at a time is drawn whole. Tied parameters are filled once,
    under the first name ``state_dict`` gives them; integer and bool tensors, and buffers a
    module recomputes itself (non-persistent ones, such as rotary frequencies), are left as
    they are.

    Args:
        model: the model, filled in place: every floating parameter and persistent floating
            buffer.
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
    """A tensor of uniform values that is the same on every machine: a factory's floating inputs.

    ``torch.randn`` differs by instruction set, so goldens made from its inputs would not
    check on another machine.

    Args:
        shape: the tensor's shape.
        seed: which draw.
        std: the values' standard deviation (their mean is 0).
        dtype: the tensor's dtype; the values are drawn in float64 and rounded to it.
        stream: a name; different names give independent values for one seed.

    Returns:
        The tensor, on the CPU.
    """
    return rng.symmetric(seed, stream, shape, std).to(dtype)


def _scale(module: nn.Module, name: str, tensor: torch.Tensor) -> tuple[float, float]:
    """(std, mean) of one tensor's uniform values (see :func:`init_weights`)."""
    if "Norm" in type(module).__name__:
        return NORM_SPREAD, 1.0 if name in ("weight", "running_var") else 0.0
    if tensor.dim() < 2 or name == "bias" or isinstance(module, nn.Embedding):
        return SMALL_STD, 0.0
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
    """Which tensors hold values drawn from torch's normal generator on the CPU, while it is
    active: a tensor is marked when a normal draw writes it, or when an op computes it from
    a marked one; an overwrite with other values (``tp.init_weights``' ``copy_``) clears it.
    Tensors are known by their storage, so views and parameters share their base's mark."""

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
        marked = drawn or any(_storage(t) in self._drawn for t in read)
        for tensor in written:
            (self._drawn.add if marked else self._drawn.discard)(_storage(tensor))
        return out

    def drawn(self, tensors: dict[str, torch.Tensor]) -> list[str]:
        """The names among ``tensors`` whose values came from a CPU normal draw.

        Args:
            tensors: tensors by name (a model's state dict, its inputs flattened).

        Returns:
            Their names, in order: the values a golden made here would not reproduce elsewhere.
        """
        return [name for name, tensor in tensors.items() if _storage(tensor) in self._drawn]


def _storage(tensor: torch.Tensor) -> int:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # a tensor without storage (sparse, ...)
        return id(tensor)
