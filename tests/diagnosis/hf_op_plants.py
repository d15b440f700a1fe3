"""One-line changes planted inside tiny ``transformers`` Llama code, each marked ``# planted``:
an attention function registered beside eager's (its scores scaled once more), and an MLP
whose activation changed."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from transformers.models.llama import modeling_llama

#: The name B's attention layers select (``config._attn_implementation``).
SCALED_SCORES = "torchparity_planted_scores"


def scaled_scores_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                            value: torch.Tensor, attention_mask: torch.Tensor | None,
                            scaling: float, dropout: float = 0.0, **kwargs: object
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's ``eager_attention_forward`` with its scores scaled by 1.01."""
    key_states = modeling_llama.repeat_kv(key, module.num_key_value_groups)
    value_states = modeling_llama.repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * (scaling * 1.01)  # planted
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


transformers.AttentionInterface.register(SCALED_SCORES, scaled_scores_attention)


class GeluMLP(modeling_llama.LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))  # planted
