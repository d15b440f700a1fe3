"""A tiny random Llama and GPT-2 that are the same under every transformers release: built
from a config, their weights filled from a function of each parameter's name (not from torch's
random stream, which a release may draw from in another order), plain factories (no ``step``:
torchparity decodes them itself). ``.ci/cross-release`` makes their goldens under one release
and checks them under another."""

from __future__ import annotations

import torch
import transformers

from torchparity.reference import rng

VOCAB = 64


def _filled(model: torch.nn.Module) -> torch.nn.Module:
    """Every parameter from its name: norms near one, the rest spread as a trained model's (a
    scale of 0.3 makes the outputs depend on attention)."""
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            values = rng.symmetric(0, name, parameter.shape, 0.3).to(parameter.dtype)
            norm = parameter.dim() == 1 and ("norm" in name or ".ln_" in name)
            parameter.copy_(1 + values / 3 if norm and name.endswith("weight") else values)
    return model.eval()


def _prompt() -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0  # the second prompt is three tokens shorter, padded on the left
    return {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}


def llama():
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, vocab_size=VOCAB, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    return _filled(transformers.LlamaForCausalLM(config)), _prompt()


def gpt2():
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                     vocab_size=VOCAB, bos_token_id=1, eos_token_id=2)
    return _filled(transformers.GPT2LMHeadModel(config)), _prompt()
