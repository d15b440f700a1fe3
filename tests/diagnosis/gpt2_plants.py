"""Entries of a tiny random GPT-2 with eager attention (``transformers``' own code, installed):
A as built, and B whose layer 1 attention no longer scales its scores."""

from __future__ import annotations

import copy

import torch
from torch import nn

import tiny_transformers


def gpt2_a() -> tuple[nn.Module, dict]:
    """The model and a batch whose second row is padded on the left."""
    torch.manual_seed(0)
    model = tiny_transformers.gpt2(attn_implementation="eager").eval()
    ids = torch.randint(1, 64, (2, 8), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    return model, {"input_ids": ids, "attention_mask": mask, "use_cache": False}


def gpt2_b_unscaled() -> tuple[nn.Module, dict]:
    model, batch = gpt2_a()
    model = copy.deepcopy(model)
    attention = model.transformer.h[1].attn
    attention.scale_attn_weights, attention.scaling = False, 1.0  # older releases, 5.x
    return model, batch
