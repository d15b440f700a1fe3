"""A small decoder whose feed-forward blocks are eole's own tensor-parallel ``MLP``
(``eole.modules.transformer_mlp``): under torchrun each rank builds it with ``parallel_gpu``
ranks, holding its slices of the projections as eole's checkpoint loader cuts them (the
gate-up projection by rows, the down projection by columns), and eole's forward reduces the
ranks' partial sums itself. In one process it is built whole (``parallel_gpu`` 1). The ranks
import this file by its path; it needs eole installed."""

from __future__ import annotations

import os
import types

import torch
from eole.config.models import TransformerDecoderConfig
from eole.modules.transformer_mlp import MLP
from torch import nn

import torchparity as tp

VOCAB, WIDTH, FF, LAYERS = 64, 32, 64, 2


def _running(ranks: int) -> types.SimpleNamespace:
    """What eole's MLP reads of its running config."""
    return types.SimpleNamespace(parallel_gpu=ranks, dropout=[0.0], use_ckpting=[])


class EoleLM(nn.Module):
    def __init__(self, ranks: int = 1) -> None:
        super().__init__()
        config = TransformerDecoderConfig(hidden_size=WIDTH, heads=4, transformer_ff=FF,
                                          add_ffnbias=False, mlp_activation_fn="gelu")
        self.embed = nn.Embedding(VOCAB, WIDTH)
        self.norms = nn.ModuleList(nn.RMSNorm(WIDTH) for _ in range(LAYERS))
        self.mlps = nn.ModuleList(MLP(config, _running(ranks)) for _ in range(LAYERS))
        self.head = nn.Linear(WIDTH, VOCAB, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for norm, mlp in zip(self.norms, self.mlps, strict=True):
            x = x + mlp(norm(x))
        return self.head(x)


def eole_mlp_tp() -> dict:
    ranks, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    whole = EoleLM()
    tp.init_weights(whole, seed=0)
    model = whole
    if ranks > 1:  # each rank keeps its slices, as eole's loader cuts a checkpoint
        model = EoleLM(ranks)
        split = {"gate_up_proj.weight": 0, "down_proj.weight": 1}
        with torch.no_grad():
            for name, param in model.named_parameters():
                source = whole.get_parameter(name)
                dim = split.get(name.split(".", 2)[-1])
                param.copy_(source if dim is None else source.chunk(ranks, dim)[rank])
    tokens = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))
    return {"model": model, "inputs": (tokens,)}
