"""Position-wise feed-forward blocks, plain and gated (GLU variants, Shazeer 2020)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from torchparity.reference.config import TransformerConfig

ACTIVATION_FUNCTIONS = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}


class MLP(nn.Module):
    """``down(act(up(x)))``, or ``down(act(gate(x)) * up(x))`` for the gated activations."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.act = ACTIVATION_FUNCTIONS[config.activation.removeprefix("gated-")]
        bias = config.ffn_bias
        self.gate_proj = nn.Linear(config.d_model, config.d_ff, bias=bias) if config.gated else None
        self.up_proj = nn.Linear(config.d_model, config.d_ff, bias=bias)
        self.down_proj = nn.Linear(config.d_ff, config.d_model, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The feed-forward block of every position, (batch, len, d_model)."""
        if self.gate_proj is None:
            return self.down_proj(self.act(self.up_proj(x)))
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))
