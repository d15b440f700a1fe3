"""A tiny model with a change planted where only ``torch.compile`` goes: an RMSNorm whose
epsilon differs while dynamo traces it (a branch on ``torch.compiler.is_compiling()``), for the
tests of compiled cells and of ``diagnose --compile-b``. :func:`write` puts its factories in a
file: ``eager``, ``planted`` (block 1's norm), ``planted_compiled`` (the same, returned as
``torch.compile(model, dynamic=False)``) and ``one_block`` (the smallest, for Inductor)."""

from __future__ import annotations

from pathlib import Path

MODELS = '''
import torch
import torch.nn.functional as F
from torch import nn


class Norm(nn.Module):
    """RMSNorm; planted: its epsilon is 1e-2 while torch.compile traces it."""

    def __init__(self, planted=False):
        super().__init__()
        self.planted = planted
        self.weight = nn.Parameter(torch.ones(16))

    def forward(self, x):
        eps = 1e-2 if self.planted and torch.compiler.is_compiling() else 1e-6
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Block(nn.Module):
    def __init__(self, planted=False):
        super().__init__()
        self.norm = Norm(planted)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 16)

    def forward(self, x):
        q, k, v = (t.unflatten(-1, (2, 8)).transpose(1, 2)
                   for t in self.qkv(self.norm(x)).chunk(3, -1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.out(y.transpose(1, 2).flatten(-2))


class Tiny(nn.Module):
    def __init__(self, planted_block=None, blocks=2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(i == planted_block) for i in range(blocks))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make(planted_block=None, blocks=2):
    torch.manual_seed(0)
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(1))
    return Tiny(planted_block, blocks), (x,)


def eager():
    return make()


def one_block():
    return make(blocks=1)


def planted():
    return make(planted_block=1)


def planted_compiled():
    model, inputs = make(planted_block=1)
    return torch.compile(model, dynamic=False), inputs
'''


#: The zoo's llama-tiny with the same plant in decoder.layers.1.mlp_norm (epsilon 1e-3 while
#: compiling): ``eager`` and ``planted`` factories, for the slow tests under Inductor; and
#: ``one_layer``, the smallest reference decoder, decoded by its built-in step.
ZOO_MODELS = '''
import dataclasses

import torch
from torchparity.reference import build_model, sequence_loss, zoo
from torchparity.reference.norms import RMSNorm


class CompiledOnlyEps(RMSNorm):
    def forward(self, x):
        eps = 1e-3 if torch.compiler.is_compiling() else self.eps
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
        return self.weight * h.to(x.dtype)


def make(planted):
    case = zoo.get("llama-tiny")
    model = build_model(case.config, seed=0)
    if planted:
        norm = model.decoder.layers[1].mlp_norm
        model.decoder.layers[1].mlp_norm = CompiledOnlyEps(norm.weight.shape[0], norm.eps)
        model.decoder.layers[1].mlp_norm.load_state_dict(norm.state_dict())
    return model, zoo.case_batch(case), sequence_loss


def eager():
    return make(False)


def planted():
    return make(True)


def one_layer():
    case = zoo.get("llama-tiny")
    model = build_model(dataclasses.replace(case.config, n_layers=1), seed=0)
    return model, zoo.case_batch(case), sequence_loss
'''


def write(folder: Path, name: str = "tiny_compiled", source: str = MODELS) -> Path:
    """``folder/<name>.py`` with the factories of ``source``; returns its path."""
    path = folder / f"{name}.py"
    path.write_text(source)
    return path
