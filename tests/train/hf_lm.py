"""A tiny ``transformers`` Llama trained by the default recipe of a causal LM
(:mod:`torchparity.train.causal_lm`: seeded random token batches, the model's own loss on its
labels, AdamW with biases and norm weights in a no-decay group, a linear warm-up).

``lm`` is the factory (``torchparity train --model tests/train/hf_lm.py:lm``); it returns the
model and its inputs only, so the recipe is the default one. ``HF_LM_VARIANT`` picks a change,
one golden name serving all:

- ``base``: the original;
- ``rope_theta``: RoPE's base frequency 100000 instead of 10000 (the attention's positions
  rotate otherwise: a change of the forward pass);
- ``norms_decay``: the factory's own optimizer, the default's but for the norms' weights
  moved into the decay group (and the default schedule);
- ``frozen``: the final norm's weight frozen, as a router's running bias is (afmoe), and the
  factory's own AdamW over every parameter, the frozen one included.
"""

from __future__ import annotations

import os

import torch

import torchparity as tp
from torchparity.train import causal_lm

VARIANTS = ("base", "rope_theta", "norms_decay", "frozen")


def variant() -> str:
    name = os.environ.get("HF_LM_VARIANT", "base")
    if name not in VARIANTS:
        raise ValueError(f"unknown HF_LM_VARIANT {name!r}; choose from {', '.join(VARIANTS)}")
    return name


def build(name: str) -> torch.nn.Module:
    """The tiny Llama of variant ``name``, its weights seeded."""
    import transformers

    theta = 100_000.0 if name == "rope_theta" else 10_000.0
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_parameters={"rope_type": "default", "rope_theta": theta})
    model = transformers.LlamaForCausalLM(config)
    return tp.init_weights(model, seed=0).eval()


def norms_decay(model: torch.nn.Module) -> torch.optim.Optimizer:
    """The default optimizer, every parameter in its decay group."""
    opt = causal_lm.optimizer(model)
    decay, no_decay = opt.param_groups
    decay["params"] = decay["params"] + no_decay["params"]
    no_decay["params"] = []
    return opt


def lm() -> dict:
    """The factory: the model of ``HF_LM_VARIANT`` and one batch of the default recipe."""
    name = variant()
    model = build(name)
    batch = causal_lm.token_batches(1, model.config.vocab_size)
    factory = {"model": model, "inputs": {"input_ids": batch["input_ids"],
                                          "attention_mask": batch["attention_mask"]}}
    if name == "norms_decay":
        factory.update(optimizer=norms_decay, scheduler=causal_lm.scheduler)
    if name == "frozen":
        model.model.norm.weight.requires_grad_(False)
        factory.update(optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
    return factory
