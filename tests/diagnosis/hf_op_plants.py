"""Changes planted inside tiny ``transformers`` Llama code, each line marked ``# planted``:
attention functions registered beside eager's (its scores scaled once more; its scores
soft-capped, as Gemma 2's eager attention does and its sdpa attention of older releases did
not), and an MLP whose activation changed; and entries of a tiny random Llama with eager and
with sdpa attention (``llama_eager``, ``llama_sdpa``), the same weights, a left-padded batch,
and with its scores soft-capped or not (``llama_softcapped``, ``llama_uncapped``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
import transformers.masking_utils
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

#: The name of the attention that soft-caps its scores, and the cap.
SOFTCAPPED_SCORES = "torchparity_planted_softcap"
SOFTCAP = 2.0


def softcapped_scores_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                                value: torch.Tensor, attention_mask: torch.Tensor | None,
                                scaling: float, dropout: float = 0.0, **kwargs: object
                                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's ``eager_attention_forward`` with its scores soft-capped (Gemma 2's
    ``attn_logit_softcapping``): three ops plain eager attention has no counterpart of."""
    key_states = modeling_llama.repeat_kv(key, module.num_key_value_groups)
    value_states = modeling_llama.repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    attn_weights = attn_weights / SOFTCAP  # planted
    attn_weights = torch.tanh(attn_weights)  # planted
    attn_weights = attn_weights * SOFTCAP  # planted
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_output = torch.matmul(attn_weights, value_states)
    return attn_output.transpose(1, 2).contiguous(), attn_weights


transformers.AttentionInterface.register(SOFTCAPPED_SCORES, softcapped_scores_attention)
# it takes eager's additive mask, as Gemma 2's eager attention does
transformers.masking_utils.AttentionMaskInterface.register(
    SOFTCAPPED_SCORES, transformers.masking_utils.eager_mask)


class GeluMLP(modeling_llama.LlamaMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x)) * self.up_proj(x))  # planted


def llama_eager(attention: str = "eager", **config: object) -> tuple[nn.Module, dict]:
    """A tiny random Llama (grouped-query attention, 2 layers) with ``attention`` (and more of
    the config's fields), on a batch whose second row is padded on the left."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, vocab_size=64,
        attn_implementation=attention, **config)).eval()
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return model, {"input_ids": ids, "attention_mask": mask, "use_cache": False}


def llama_sdpa() -> tuple[nn.Module, dict]:
    return llama_eager("sdpa")


def llama_softcapped() -> tuple[nn.Module, dict]:
    """The tiny Llama at weights whose scores the cap bends, its scores soft-capped."""
    return llama_eager(SOFTCAPPED_SCORES, initializer_range=0.2)


def llama_uncapped() -> tuple[nn.Module, dict]:
    """The same Llama, the same weights, on plain eager attention."""
    return llama_eager("eager", initializer_range=0.2)
