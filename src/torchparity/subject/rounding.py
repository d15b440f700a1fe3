"""Another draw of a computation's rounding: the same model, its weights moved by one rounding.

The difference between the two runs is the computation's own rounding; a bug is the same in both
and cancels (``reruns`` in :func:`torchparity.compare`).
"""

from __future__ import annotations

import torch
from torch import nn

from torchparity import tolerance
from torchparity.reference import rng


def perturb_weights(model: nn.Module, *, seed: int = 1) -> nn.Module:
    """Move every floating parameter of ``model`` by up to one rounding of its dtype, in place.

    Each is multiplied by ``1 + d * u`` (``u`` its dtype's unit roundoff, ``d`` uniform in [-1,
    1] from ``seed`` and its name, the same on every machine) and rounded back from float64.
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
