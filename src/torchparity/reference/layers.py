"""One transformer layer: attention, optional cross-attention and MLP with residuals."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from torchparity.reference.attention import Attention, AttentionContext
from torchparity.reference.config import TransformerConfig
from torchparity.reference.mlp import MLP
from torchparity.reference.norms import build_norm


class TransformerLayer(nn.Module):
    """Pre-norm ``x + f(norm(x))``, post-norm ``norm(x + f(x))``, or a parallel residual."""

    # parallel: x + attn(norm1(x)) + mlp(norm2(x)), one shared norm with shared_layernorm
    def __init__(self, config: TransformerConfig, layer_idx: int, *, cross: bool = False
                 ) -> None:
        super().__init__()
        self.pre_norm = config.norm_placement == "pre"
        self.parallel = config.parallel_residual
        self.attn_norm = build_norm(config)
        self.attn = Attention(config, layer_idx)
        if cross:
            self.cross_attn_norm = build_norm(config)
            self.cross_attn = Attention(config, layer_idx, cross=True)
        else:
            self.cross_attn_norm = self.cross_attn = None
        self.mlp_norm = None if config.shared_layernorm else build_norm(config)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def residual(self, x: torch.Tensor, norm: nn.Module,
                 sublayer: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``x + f(norm(x))`` in pre-norm, ``norm(x + f(x))`` in post-norm."""
        if self.pre_norm:
            return x + self.dropout(sublayer(norm(x)))
        return norm(x + self.dropout(sublayer(x)))

    def forward(self, x: torch.Tensor, ctx: AttentionContext,
                memory: torch.Tensor | None = None,
                memory_ctx: AttentionContext | None = None) -> torch.Tensor:
        """One layer on (batch, len, d_model): self-attention, cross-attention to memory, MLP."""
        if self.parallel:
            h = self.attn_norm(x)
            mlp_in = h if self.mlp_norm is None else self.mlp_norm(x)
            return x + self.dropout(self.attn(h, ctx)) + self.dropout(self.mlp(mlp_in))
        x = self.residual(x, self.attn_norm, lambda h: self.attn(h, ctx))
        if self.cross_attn is not None:
            x = self.residual(x, self.cross_attn_norm,
                              lambda h: self.cross_attn(h, memory_ctx, memory))
        return self.residual(x, self.mlp_norm, self.mlp)
