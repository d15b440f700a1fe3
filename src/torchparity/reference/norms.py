"""Normalisation layers."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchparity.reference.config import TransformerConfig


class LayerNorm(nn.Module):
    """Layer norm (Ba et al.) with an optional bias, as ``F.layer_norm`` computes it."""
    def __init__(self, dim: int, eps: float, bias: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., dim) normalised over its last dimension, scaled and shifted."""
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich); statistics in at least fp32, as in Llama."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` (..., dim) over its root mean square (computed in at least fp32), then scaled."""
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def build_norm(config: TransformerConfig) -> nn.Module:
    """The :class:`RMSNorm` or :class:`LayerNorm` ``config`` asks for."""
    if config.norm == "rmsnorm":
        return RMSNorm(config.d_model, config.norm_eps)
    return LayerNorm(config.d_model, config.norm_eps, bias=config.norm_bias)
