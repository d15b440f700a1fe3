"""Tiny transformers Llamas built on an attention implementation of their own, ``capped``:
eager attention with its scores soft-capped (as Gemma 2 does on its eager path only), so the
library's eager and sdpa implementations really differ from the one the model was built with."""

from __future__ import annotations

import torch
import transformers
import transformers.masking_utils
from transformers.models.llama.modeling_llama import repeat_kv

from torchparity.subject import hf_families

CAP = 2.0


def capped_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                     **kwargs):
    """Attention whose scores are ``CAP * tanh(scores / CAP)`` before the mask."""
    key = repeat_kv(key, module.num_key_value_groups)
    value = repeat_kv(value, module.num_key_value_groups)
    scores = query @ key.transpose(2, 3) * scaling
    scores = CAP * torch.tanh(scores / CAP)
    if attention_mask is not None:
        mask = attention_mask[..., :key.shape[-2]]
        scores = (scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
                  if mask.dtype == torch.bool else scores + mask)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return (weights @ value).transpose(1, 2).contiguous(), weights


transformers.AttentionInterface.register("capped", capped_attention)
# Its masks are eager's: additive, never skipped (sdpa's may be left to is_causal).
transformers.masking_utils.AttentionMaskInterface.register(
    "capped", transformers.masking_utils.eager_mask)


def _unpadded(model):
    """The sweep's prompts without their padding: eager's additive mask overflows in float64
    on a left-padded row."""
    return {"input_ids": hf_families.prompts(model.config)["input_ids"][:1]}


def capped():
    """A Llama built on ``capped``: its goldens must be of that path."""
    model = hf_families.tiny_model("llama", "capped")
    return model, _unpadded(model)


def sdpa():
    """The same weights built on sdpa."""
    model = hf_families.tiny_model("llama", "sdpa")
    return model, _unpadded(model)
