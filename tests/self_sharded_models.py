"""Factories of models that shard themselves when they find themselves under torchrun
(``WORLD_SIZE`` > 1), as training scripts do, with no plan handed to torchparity: the small
decoder of tests/sharded_models.py sharded by DTensor tensor parallel, by FSDP2 and by both
inside the factory; and a decoder written Megatron-style, whose column- and row-parallel
linears hold plain per-rank slices of their weights and reduce by hand, correct and with
each classic bug of hand-written tensor parallel. In one process every factory builds the
whole model, unsharded: the model's own mathematics, which the goldens hold.
The ranks import this file by its path."""

from __future__ import annotations

import functools
import os
import signal

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import torchparity as tp
from sharded_models import (
    HEADS,
    LAYERS,
    MINE_FSDP,
    MINE_TP,
    VOCAB,
    WIDE,
    WIDTH,
    TinyLM,
    both,
    tokens,
)


def ranks() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def this_rank() -> int:
    return int(os.environ.get("RANK", "0"))


# --- DTensor tensor parallel and FSDP2, applied by the factory itself ------------------------


def _sharded_by(plan, dimensions: tuple[str, ...], **sizes: int) -> dict:
    """The small decoder, sharded by ``plan`` over a mesh of ``dimensions`` (the last one takes
    the ranks the others leave) when the factory runs under torchrun."""
    from torch.distributed.device_mesh import init_device_mesh

    model = TinyLM(**sizes)
    tp.init_weights(model, seed=0)
    if ranks() > 1:
        sizes = (1,) * (len(dimensions) - 1) + (ranks(),)
        plan(model, init_device_mesh("cpu", sizes, mesh_dim_names=dimensions))
    return {"model": model, "inputs": (tokens(),)}


def dtensor_tp() -> dict:
    return _sharded_by(MINE_TP, ("tp",))


def fsdp() -> dict:
    return _sharded_by(MINE_FSDP, ("dp",))


def _tp_norm_drifts(model: nn.Module, mesh) -> None:
    """DTensor tensor parallel, but rank 1's copy of the replicated attention norms (plain
    parameters the plan leaves whole on every rank) has drifted."""
    MINE_TP(model, mesh)
    if this_rank() == 1:
        with torch.no_grad():
            for layer in model.layers:
                layer.attn_norm.weight.mul_(1 + 2**-10)


def dtensor_tp_norm_drifts() -> dict:
    return _sharded_by(_tp_norm_drifts, ("tp",))


def fsdp_tp() -> dict:
    return _sharded_by(both(MINE_TP, MINE_FSDP), ("dp", "tp"))


# --- Megatron-style tensor parallel over plain tensors ---------------------------------------


class _CopyToRanks(torch.autograd.Function):
    """Identity forward; the gradient summed over the ranks (each rank's columns feed part of
    it): Megatron's ``f``."""

    @staticmethod
    def forward(ctx, x):
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _ReduceFromRanks(torch.autograd.Function):
    """The ranks' partial sums added up forward; the gradient passed through: Megatron's
    ``g``."""

    @staticmethod
    def forward(ctx, x, times):
        x = x.clone()
        for _ in range(times):
            dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _GatherFromRanks(torch.autograd.Function):
    """The ranks' columns joined along the last dimension (``order``: the rank whose columns
    come first, second, ...); the gradient's own columns back to each rank."""

    @staticmethod
    def forward(ctx, x, order):
        parts = [torch.empty_like(x) for _ in range(ranks())]
        dist.all_gather(parts, x.contiguous())
        ctx.width = x.shape[-1]
        ctx.position = order.index(this_rank())
        return torch.cat([parts[r] for r in order], dim=-1)

    @staticmethod
    def backward(ctx, grad):
        start = ctx.position * ctx.width
        return grad[..., start:start + ctx.width].contiguous(), None


def _slice(tensor: torch.Tensor, dim: int, rank: int, dealt: bool = False) -> torch.Tensor:
    """Rank ``rank``'s slice along ``dim``: the ``rank``-th of equal chunks, or (``dealt``)
    every ``ranks()``-th entry from ``rank`` on, as cards are dealt."""
    if dealt:
        return tensor.detach().index_select(dim, torch.arange(rank, tensor.shape[dim], ranks()))
    return tensor.detach().chunk(ranks(), dim=dim)[rank].clone()


class ColumnLinear(nn.Linear):
    """A linear whose rank holds the output columns of the slice ``holds`` (default: its own
    rank's), its output either those columns or gathered whole."""

    def shard(self, holds: int | None = None, gather: bool = False,
              order: list[int] | None = None, dealt: bool = False) -> None:
        holds = this_rank() if holds is None else holds
        self.weight = nn.Parameter(_slice(self.weight, 0, holds, dealt))
        self.bias = nn.Parameter(_slice(self.bias, 0, holds, dealt))
        self.parallel, self.gather = True, gather
        self.order = order or list(range(ranks()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "parallel", False):
            return super().forward(x)
        y = F.linear(_CopyToRanks.apply(x), self.weight, self.bias)
        return _GatherFromRanks.apply(y, self.order) if self.gather else y


class RowLinear(nn.Linear):
    """A linear whose rank holds the input rows of its own rank's slice; the ranks' partial
    sums reduced ``reductions`` times (1: correct), the bias added once after."""

    def shard(self, reductions: int = 1, dealt: bool = False) -> None:
        self.weight = nn.Parameter(_slice(self.weight, 1, this_rank(), dealt))
        self.parallel, self.reductions = True, reductions

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not getattr(self, "parallel", False):
            return super().forward(x)
        return _ReduceFromRanks.apply(F.linear(x, self.weight), self.reductions) + self.bias


class ManualAttention(nn.Module):
    """Self-attention whose rank runs the heads its projections hold (their width says how
    many)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.head_dim = width // heads
        self.q, self.k, self.v = (ColumnLinear(width, width) for _ in range(3))
        self.o = RowLinear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, length, _ = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, length, -1, self.head_dim).transpose(1, 2)

        y = F.scaled_dot_product_attention(heads(self.q(x)), heads(self.k(x)), heads(self.v(x)),
                                           is_causal=True)
        return self.o(y.transpose(1, 2).reshape(batch, length, -1))


class ManualBlock(nn.Module):
    def __init__(self, width: int, heads: int, hidden: int) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(width), nn.RMSNorm(width)
        self.attn = ManualAttention(width, heads)
        self.up, self.down = ColumnLinear(width, hidden), RowLinear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x))
        return x + self.down(F.gelu(self.up(self.mlp_norm(x))))


class ManualLM(TinyLM):
    """The small decoder with hand-written tensor-parallel layers: whole in one process."""

    def __init__(self, vocab: int = VOCAB, width: int = WIDTH, heads: int = HEADS,
                 hidden: int = 2 * WIDTH, layers: int = LAYERS) -> None:
        super().__init__(vocab, width, heads, hidden, layers, block=ManualBlock)


def split_dims(model: ManualLM) -> dict[str, int]:
    """Each sharded parameter's name and the dimension its ranks split it along."""
    dims = {}
    for i in range(len(model.layers)):
        for column in ("attn.q", "attn.k", "attn.v", "up"):
            dims |= {f"layers.{i}.{column}.weight": 0, f"layers.{i}.{column}.bias": 0}
        dims |= {f"layers.{i}.attn.o.weight": 1, f"layers.{i}.down.weight": 1}
    return dims


def _manual(shard=None, dims=split_dims, **sizes: int) -> dict:
    """The Megatron-style decoder, each rank keeping its slices (``shard(model)``; default: the
    correct split) under torchrun, with ``dims(model)``: which dimension each sharded
    parameter is split along, as the factory declares it (None: torchparity finds it)."""
    model = ManualLM(**sizes)
    tp.init_weights(model, seed=0)
    found = {"model": model, "inputs": (tokens(),)}
    if ranks() > 1:
        if dims is not None:
            found["shards"] = dims(model)
        (shard or _correct)(model)
    return found


def _correct(model: ManualLM, reductions: int = 1, dealt: bool = False) -> None:
    """Heads and MLP units split among the ranks; the attention's output projection's partial
    sums reduced ``reductions`` times (1: correct), the MLP's units ``dealt`` in turn."""
    for layer in model.layers:
        for column in (layer.attn.q, layer.attn.k, layer.attn.v):
            column.shard()
        layer.up.shard(dealt=dealt)
        layer.attn.o.shard(reductions)
        layer.down.shard(dealt=dealt)


def manual_tp() -> dict:
    return _manual()


def manual_tp_inferred() -> dict:
    """The same, the split of each parameter left for torchparity to find."""
    return _manual(dims=None)


def manual_tp_mlp_dealt() -> dict:
    """Correct, but the MLP's hidden units are dealt to the ranks in turn (the MLP computes
    the same whatever their order), not declared: no rank's slice of it is a stretch of the
    one-process weight."""
    return _manual(functools.partial(_correct, dealt=True), dims=None)


def manual_tp_unreduced_rows() -> dict:
    """The attention's output projection never adds up the ranks' partial sums."""
    return _manual(functools.partial(_correct, reductions=0))


def manual_tp_reduced_twice() -> dict:
    """The attention's output projection adds up the ranks' partial sums twice."""
    return _manual(functools.partial(_correct, reductions=2))


def _columns_out_of_order(model: ManualLM) -> None:
    """The MLP's up projection gathered whole, the ranks' columns joined in reverse order (its
    down projection whole on every rank)."""
    for layer in model.layers:
        for column in (layer.attn.q, layer.attn.k, layer.attn.v):
            column.shard()
        layer.attn.o.shard()
        layer.up.shard(gather=True, order=list(reversed(range(ranks()))))


def manual_tp_columns_out_of_order() -> dict:
    return _manual(_columns_out_of_order, dims=lambda model: {
        name: dim for name, dim in split_dims(model).items() if ".down." not in name})


def _norm_drifts(model: ManualLM) -> None:
    _correct(model)
    if this_rank() == 1:
        with torch.no_grad():
            for layer in model.layers:
                layer.attn_norm.weight.mul_(1 + 2**-10)


def manual_tp_norm_drifts() -> dict:
    """Rank 1's copy of the replicated attention norms has drifted."""
    return _manual(_norm_drifts)


def _heads_swapped(model: ManualLM) -> None:
    """Each rank's keys and values are the next rank's heads: its queries attend with them."""
    _correct(model)
    with torch.no_grad():
        whole = ManualLM()
        tp.init_weights(whole, seed=0)
        for layer, source in zip(model.layers, whole.layers, strict=True):
            for name in ("k", "v"):
                held, full = getattr(layer.attn, name), getattr(source.attn, name)
                other = (this_rank() + 1) % ranks()
                held.weight.copy_(_slice(full.weight, 0, other))
                held.bias.copy_(_slice(full.bias, 0, other))


def manual_tp_heads_swapped() -> dict:
    """Its slices found by matching them to the one-process weights: each rank's keys and
    values are where the other rank's belong."""
    return _manual(_heads_swapped, dims=None)


def _dies_in_rank_one(model: ManualLM) -> None:
    """Correct, but rank 1 is killed in the middle of its first forward, between two
    collectives."""
    _correct(model)
    if this_rank() == 1:
        model.layers[-1].down.register_forward_pre_hook(
            lambda module, args: os.kill(os.getpid(), signal.SIGKILL))


def manual_tp_rank_one_dies() -> dict:
    return _manual(_dies_in_rank_one)


# --- the wide model of tests/sharded_models.py, sharded by its factory: BENCHMARKS.md -----------


def wide_dtensor_tp() -> dict:
    """151M parameters, built whole by every rank and sharded by the factory's tensor-parallel
    plan: ``sharded_models.py:wide_tp_whole`` with no plan handed in."""
    return _sharded_by(MINE_TP, ("tp",), **WIDE)


def wide_manual_tp() -> dict:
    """The same model and split written by hand, its slices declared."""
    return _manual(**WIDE)
