"""transformers' attention of one release, eager against sdpa: twins nobody here wrote.

:class:`LlamaSelfAttention` wraps the installed release's ``LlamaAttention`` (and its rotary
embedding) so that it takes what the twins strategies draw: hidden states, an additive
(batch, 1, q, k) mask and position ids. The implementation is the config's
``attn_implementation``; the weights are the same tensors under the same names.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

transformers = pytest.importorskip("transformers")
from transformers.models.llama import modeling_llama  # noqa: E402


class LlamaSelfAttention(nn.Module):
    """One Llama attention layer of ``implementation``, GQA when ``n_kv_heads < n_heads``."""

    implementation = "eager"

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None) -> None:
        super().__init__()
        config = transformers.LlamaConfig(
            hidden_size=d_model, num_attention_heads=n_heads,
            num_key_value_heads=n_kv_heads or n_heads, intermediate_size=2 * d_model,
            max_position_embeddings=8192, attn_implementation=self.implementation)
        self.attn = modeling_llama.LlamaAttention(config, layer_idx=0)
        self.rotary = modeling_llama.LlamaRotaryEmbedding(config)

    def forward(self, hidden_states, attention_mask=None, position_ids=None):
        if position_ids is None:
            position_ids = torch.arange(hidden_states.shape[1])[None]
        embeddings = self.rotary(hidden_states, position_ids)
        return self.attn(hidden_states, embeddings, attention_mask)


class LlamaSdpaSelfAttention(LlamaSelfAttention):
    implementation = "sdpa"
