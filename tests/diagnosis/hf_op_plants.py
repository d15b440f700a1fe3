"""One-line changes planted inside tiny ``transformers`` Llama code, each marked ``# planted``:
an attention function registered beside eager's (its scores scaled once more), and an MLP
whose activation changed; and entries of a tiny random Llama with eager and with sdpa
attention (``llama_eager``, ``llama_sdpa``), the same weights, a left-padded batch."""

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


def llama_eager(attention: str = "eager") -> tuple[nn.Module, dict]:
    """A tiny random Llama (grouped-query attention, 2 layers) with ``attention``, on a batch
    whose second row is padded on the left."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, vocab_size=64,
        attn_implementation=attention)).eval()
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return model, {"input_ids": ids, "attention_mask": mask, "use_cache": False}


def llama_sdpa() -> tuple[nn.Module, dict]:
    return llama_eager("sdpa")
