"""A user-style decoder language model trained by its own recipe: its own data (arithmetic
progressions of varied length, padded), AdamW with a no-decay group for norms and biases,
gradient clipping and a linear warm-up into a cosine decay.

``lm`` is the factory (``torchparity train --model tests/train/user_lm.py:lm``). The variant
it builds is read from ``USER_LM_VARIANT``, so one golden name serves the original and every
change to it, as a refactor in place would:

- refactors that change rounding only: ``fused`` (one QKV projection holding the three
  weights), ``residual`` (the output projection's bias added after the residual sum),
  ``accumulated`` (two micro-batches, each loss divided by the step's target tokens);
- training-only bugs: ``per_micro_batch`` (each micro-batch's loss its own mean, averaged over
  the micro-batches, as transformers' Trainer did before 4.46), ``decay_norms`` (weight decay
  on norms and biases), ``gelu_backward`` (a custom autograd GELU: exact forward, the tanh
  approximation's derivative in backward), ``warmup_short`` (the warm-up one step short).
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

import torchparity as tp

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 48, 32, 4, 2, 12, 8
PEAK_LR, WARMUP, TOTAL, CLIP, DECAY = 3e-3, 10, 200, 1.0, 0.1
PAD = -100

REFACTORS = ("fused", "residual", "accumulated")
BUGS = ("per_micro_batch", "decay_norms", "gelu_backward", "warmup_short")


def variant() -> str:
    name = os.environ.get("USER_LM_VARIANT", "base")
    if name not in ("base", *REFACTORS, *BUGS):
        raise ValueError(f"unknown USER_LM_VARIANT {name!r}")
    return name


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class TanhGradGelu(torch.autograd.Function):
    """Exact GELU forward; backward the derivative of the tanh approximation (slightly off)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(x)
        return F.gelu(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        (x,) = ctx.saved_tensors
        c = math.sqrt(2 / math.pi)
        inner = c * (x + 0.044715 * x**3)
        t = torch.tanh(inner)
        return grad * (0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + 3 * 0.044715 * x * x))


class Attention(nn.Module):
    def __init__(self, fused: bool, split_bias: bool) -> None:
        super().__init__()
        self.fused, self.split_bias = fused, split_bias
        if fused:
            self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        else:
            self.q, self.k, self.v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        self.o = nn.Linear(DIM, DIM)

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        parts = self.qkv(x).chunk(3, dim=-1) if self.fused else (self.q(x), self.k(x), self.v(x))
        b, t, _ = x.shape
        return tuple(p.view(b, t, HEADS, DIM // HEADS).transpose(1, 2) for p in parts)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        q, k, v = self.heads(x)
        h = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        h = h.transpose(1, 2).reshape(x.shape)
        if self.split_bias:  # the residual sum first, the bias after it
            return (residual + F.linear(h, self.o.weight)) + self.o.bias
        return residual + self.o(h)


class Block(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(DIM), RMSNorm(DIM)
        self.attn = Attention(name == "fused", name == "residual")
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.gelu = TanhGradGelu.apply if name == "gelu_backward" else F.gelu

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.attn_norm(x), x)
        return x + self.down(self.gelu(self.up(self.mlp_norm(x))))


class DecoderLM(nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(name) for _ in range(LAYERS))
        self.norm = RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(name: str) -> DecoderLM:
    """The model of variant ``name``, with the weights of the original (a fused projection
    holds the original's three)."""
    original = tp.init_weights(DecoderLM("base"), seed=0)
    model = DecoderLM(name)
    state = original.state_dict()
    if name == "fused":
        for i in range(LAYERS):
            parts = [state.pop(f"blocks.{i}.attn.{p}.weight") for p in "qkv"]
            state[f"blocks.{i}.attn.qkv.weight"] = torch.cat(parts)
    model.load_state_dict(state)
    return model


def batches(step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s batch: progressions ``start, start + stride, ...`` mod VOCAB - 1 (id 0
    pads), of lengths 4 to SEQ, the targets the next tokens (padding: PAD)."""
    g = torch.Generator().manual_seed(1000 + step)
    tokens = torch.zeros(BATCH, SEQ, dtype=torch.long)
    labels = torch.full((BATCH, SEQ), PAD, dtype=torch.long)
    for row in range(BATCH):
        length = int(torch.randint(4, SEQ + 1, (1,), generator=g))
        start, stride = (int(v) for v in torch.randint(1, VOCAB, (2,), generator=g))
        seq = (start + stride * torch.arange(length + 1)) % (VOCAB - 1) + 1
        tokens[row, :length] = seq[:length]
        labels[row, :length] = seq[1:]
    return {"tokens": tokens, "labels": labels}


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    decay_norms = variant() == "decay_norms"
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    rest = [p for n, p in model.named_parameters() if p.dim() < 2]
    return torch.optim.AdamW([
        {"params": decay, "weight_decay": DECAY, "name": "decay"},
        {"params": rest, "weight_decay": DECAY if decay_norms else 0.0, "name": "no_decay"},
    ], lr=PEAK_LR, betas=(0.9, 0.95))


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    warmup = WARMUP - 1 if variant() == "warmup_short" else WARMUP

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min((step - warmup) / (TOTAL - warmup), 1.0)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)


def _token_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=PAD,
                           reduction="sum")


def train_step(model: nn.Module, batch: dict[str, torch.Tensor],
               opt: torch.optim.Optimizer) -> torch.Tensor:
    """One optimizer step: the loss per target token, over one batch or two micro-batches."""
    tokens, labels = batch["tokens"], batch["labels"]
    name = variant()
    micro = 2 if name in ("accumulated", "per_micro_batch") else 1
    n_tokens = (labels != PAD).sum()
    total = torch.zeros(())
    for t, y in zip(tokens.chunk(micro), labels.chunk(micro), strict=True):
        if name == "per_micro_batch":
            loss = _token_loss(model, t, y) / (y != PAD).sum() / micro
        else:
            loss = _token_loss(model, t, y) / n_tokens
        loss.backward()
        total = total + loss.detach()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    opt.zero_grad(set_to_none=True)
    return total


def lm() -> dict:
    """The factory: the variant of ``USER_LM_VARIANT`` and its training recipe."""
    return {"model": build(variant()), "inputs": batches(1)["tokens"],
            "batches": batches, "optimizer": optimizer, "scheduler": scheduler,
            "train_step": train_step}
