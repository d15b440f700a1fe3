"""Random ``transformers`` models of real shapes, as users' factories: torchparity at size.

::

    torchparity golden update --model torchparity.bench.real_size:llama_1b
    torchparity check --model torchparity.bench.real_size:llama_1b --dtype fp32 --dtype bf16

``$TORCHPARITY_PLANT`` plants a change with the same weights (so the same goldens apply):
``norm-eps`` multiplies one layer's first norm epsilon by 10, ``rope-theta`` sets Llama's rotary
base to 10000 instead of 500000.
"""

from __future__ import annotations

import contextlib
import math
import os

import torch
from torch import nn

from torchparity.errors import UsageError

#: Environment variable naming a planted change (see the module docstring).
PLANT_ENV = "TORCHPARITY_PLANT"
PLANTS = ("norm-eps", "rope-theta")
_STD = 0.02
_SEED = 0


def gpt2_small() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A factory: GPT-2 small (124M) in eval mode, seeded random weights, 128 random tokens."""
    import transformers

    config = transformers.GPT2Config(n_embd=768, n_layer=12, n_head=12, n_positions=1024,
                                     vocab_size=50257)
    model = _random(transformers.GPT2LMHeadModel, config)
    if _plant() == "norm-eps":
        model.transformer.h[5].ln_1.eps *= 10
    elif _plant() == "rope-theta":
        raise UsageError("GPT-2 has no rotary positions: plant norm-eps instead")
    return model, _tokens(config.vocab_size, 128)


def llama_1b() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A factory: Llama 3.2 1B's shape in eval mode, seeded random weights, 64 random tokens."""
    return llama()


def llama(layers: int = 16, *, vocab: int = 128256, intermediate: int = 8192,
          tokens: int = 64) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Llama of 3.2 1B's width (2048, 32/8 heads of 64, its rotary scaling); few layers: fast."""
    import transformers

    theta = 10000.0 if _plant() == "rope-theta" else 500000.0
    config = transformers.LlamaConfig(
        hidden_size=2048, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, vocab_size=vocab,
        tie_word_embeddings=True, rms_norm_eps=1e-5, max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": theta, "factor": 32.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192},
        bos_token_id=min(128000, vocab - 2), eos_token_id=min(128001, vocab - 1))
    model = _random(transformers.LlamaForCausalLM, config)
    if _plant() == "norm-eps":
        model.model.layers[max(layers // 2 - 1, 0)].input_layernorm.variance_epsilon *= 10
    return model, _tokens(config.vocab_size, tokens)


def _plant() -> str | None:
    plant = os.environ.get(PLANT_ENV) or None
    if plant not in (None, *PLANTS):
        raise UsageError(f"${PLANT_ENV}={plant!r}: choose one of {', '.join(PLANTS)}")
    return plant


def _random(cls: type[nn.Module], config: object) -> nn.Module:
    """``cls(config)`` in eval mode with seeded weights: std 0.02 matrices, norms 1, biases 0."""
    # transformers' own initialisation takes half a minute for 1B parameters
    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older transformers: initialise twice, slowly
        no_init_weights = contextlib.nullcontext
    with no_init_weights():
        model = cls(config)
    model.tie_weights()
    generator = torch.Generator().manual_seed(_SEED)
    bound = _STD * math.sqrt(3.0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() > 1:
                param.uniform_(-bound, bound, generator=generator)
            else:
                param.fill_(0.0 if name.endswith("bias") else 1.0)
    return model.eval()


def _tokens(vocab: int, length: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, vocab, (1, length), generator=torch.Generator().manual_seed(_SEED))
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
