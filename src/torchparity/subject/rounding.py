"""Another draw of a computation's rounding: the same model with its weights moved by one
rounding of their dtype.

Rerunning a computation on weights moved by up to one unit of roundoff changes which way its
results round, while moving the exact result no more than rounding the weights to that dtype
already did: the difference between the two runs is the computation's own rounding, and a
systematic change (a bug) is the same in both and cancels (see ``reruns`` in
:func:`torchparity.compare`).
"""

from __future__ import annotations

import torch
from torch import nn

from torchparity import tolerance
from torchparity.reference import rng


def perturb_weights(model: nn.Module, *, seed: int = 1) -> nn.Module:
    """Move every floating parameter of ``model`` by up to one rounding of its dtype, in place.

    Each is multiplied by ``1 + d * u``, ``u`` the unit roundoff of its dtype and ``d``
    uniform in [-1, 1], a pure function of ``seed`` and the tensor's name (the same on every
    machine). The product is rounded to the tensor's dtype from float64, so about half the
    values move by one unit in the last place. Float64 tensors move by one float64 rounding.

    Args:
        model: the model, changed in place.
        seed: which draw of the rounding.

    Returns:
        ``model`` itself.
    """
    with torch.no_grad():
        for name, tensor in model.named_parameters():
            if not tensor.is_floating_point():
                continue
            u = tolerance.unit_roundoff(tensor.dtype)
            d = rng.uniform(seed, f"rounding.{name}", tensor.shape) * 2.0 - 1.0
            moved = tensor.to(torch.float64) * (1.0 + u * d.to(tensor.device))
            tensor.copy_(moved.to(tensor.dtype))
    return model
