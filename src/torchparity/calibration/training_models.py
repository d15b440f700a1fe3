"""A user-style decoder LM trained by its own recipe, drawn from a seed: the model of the
training study and of ``tests/train/user_lm.py``.

The recipe is a user's: its own padded data (arithmetic progressions), AdamW with a
no-decay group, clipping, warm-up into cosine decay. :class:`UserLM` picks the seed, the
variant and a scaled bug's ``eps``: :data:`REFACTORS` change rounding only,
:data:`BUGS` the training at full strength, :data:`SCALED_BUGS` by ``eps``. ``lm`` builds
the one the variable :data:`ENVIRONMENT` names (``seed=3,variant=fused``), so a band's
member process rebuilds it from the entry."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812
from torch import nn

from torchparity.subject.weights import init_weights

VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 48, 32, 4, 2, 12, 8
PEAK_LR, WARMUP, TOTAL, CLIP, DECAY = 3e-3, 10, 200, 1.0, 0.1
PAD = -100

#: Changes of rounding only, the weights mapped where the layout changed: name -> what it is.
REFACTORS = {
    "fused": "one QKV projection holding the three weights",
    "residual": "the output projection's bias added after the residual sum",
    "accumulated": "two micro-batches, each loss divided by the step's target tokens",
    "heads_permuted": "the heads stored in reverse order (q, k, v rows, output columns)",
    "rms_norm": "torch's F.rms_norm in place of the written-out norm",
}
#: Training-only bugs at full strength: name -> what it is.
BUGS = {
    "per_micro_batch": "each micro-batch's loss its own mean, averaged (Trainer before 4.46)",
    "decay_norms": "weight decay on norms and biases",
    "gelu_backward": "a custom GELU: exact forward, the tanh approximation's derivative back",
    "warmup_short": "the warm-up one step short",
}
#: Training-only bugs of strength ``eps``: name -> what ``eps`` does.
SCALED_BUGS = {
    "decay_norms": f"weight decay eps * {DECAY} on norms and biases",
    "grad_scaled": "the gradient through every GELU times (1 + eps)",
    "lr_scaled": "the learning-rate schedule times (1 + eps)",
    "per_micro_batch": "eps of the loss normalised per micro-batch, 1 - eps per step's tokens",
}
#: Changes of the optimizer's groups or hyper-parameters: name -> what it is.
OPTIMIZER_CHANGES = {
    "norms_in_decay": "the norms' weights moved from the no-decay group into the decay group",
    "betas_changed": "AdamW's betas (0.9, 0.99) instead of (0.9, 0.95)",
    "eps_changed": "AdamW's eps 1e-6 instead of its default 1e-8",
}
VARIANTS = ("base", *REFACTORS, *BUGS, *(name for name in SCALED_BUGS if name not in BUGS),
            *OPTIMIZER_CHANGES)

ENVIRONMENT = "TORCHPARITY_TRAINING_LM"
ENTRY = "torchparity.calibration.training_models:lm"


@dataclass(frozen=True)
class UserLM:
    """The model and recipe of ``variant`` from ``seed``; ``eps``: a scaled bug's strength."""

    seed: int = 0
    variant: str = "base"
    eps: float = 1.0

    def __post_init__(self) -> None:
        if self.variant not in VARIANTS:
            raise ValueError(f"unknown variant {self.variant!r}; choose from "
                             f"{', '.join(VARIANTS)}")

    def spec(self) -> str:
        """What :data:`ENVIRONMENT` holds to select this one: ``seed=3,variant=fused,eps=1.0``."""
        return f"seed={self.seed},variant={self.variant},eps={self.eps!r}"

    @classmethod
    def parse(cls, spec: str) -> UserLM:
        """The inverse of :meth:`spec` (fields left out keep their defaults)."""
        fields = dict(part.split("=", 1) for part in spec.split(",") if part)
        return cls(seed=int(fields.get("seed", 0)), variant=fields.get("variant", "base"),
                   eps=float(fields.get("eps", 1.0)))

    def build(self) -> UserDecoder:
        """The model, with the weights of the seed's original mapped to its layout."""
        original = init_weights(UserDecoder(UserLM(self.seed)), seed=self.seed)
        model = UserDecoder(self)
        state = original.state_dict()
        for i in range(LAYERS):
            prefix = f"blocks.{i}.attn."
            if self.variant == "heads_permuted":
                _reverse_heads(state, prefix)
            if self.variant == "fused":
                parts = [state.pop(f"{prefix}{p}.weight") for p in "qkv"]
                state[f"{prefix}qkv.weight"] = torch.cat(parts)
        model.load_state_dict(state)
        return model

    def batches(self, step: int) -> dict[str, torch.Tensor]:
        """Step ``step``'s batch: progressions ``start, start + stride, ...`` mod VOCAB - 1
        (id 0 pads), of lengths 4 to SEQ, the targets the next tokens (padding: PAD)."""
        # seeds a million steps apart: torch's CPU generator keeps 32 bits of its seed
        g = torch.Generator().manual_seed(1000 + step + 1_000_003 * self.seed)
        tokens = torch.zeros(BATCH, SEQ, dtype=torch.long)
        labels = torch.full((BATCH, SEQ), PAD, dtype=torch.long)
        for row in range(BATCH):
            length = int(torch.randint(4, SEQ + 1, (1,), generator=g))
            start, stride = (int(v) for v in torch.randint(1, VOCAB, (2,), generator=g))
            seq = (start + stride * torch.arange(length + 1)) % (VOCAB - 1) + 1
            tokens[row, :length] = seq[:length]
            labels[row, :length] = seq[1:]
        return {"tokens": tokens, "labels": labels}

    def optimizer(self, model: nn.Module) -> torch.optim.Optimizer:
        """AdamW; matrices decay, norms and biases do not (unless the bug decays them)."""
        decay_rest = DECAY * self.eps if self.variant == "decay_norms" else 0.0
        norms_decay = self.variant == "norms_in_decay"
        decay, rest = [], []
        for name, p in model.named_parameters():
            decays = p.dim() >= 2 or (norms_decay and "norm" in name)
            (decay if decays else rest).append(p)
        betas = (0.9, 0.99) if self.variant == "betas_changed" else (0.9, 0.95)
        eps = 1e-6 if self.variant == "eps_changed" else 1e-8
        return torch.optim.AdamW([
            {"params": decay, "weight_decay": DECAY, "name": "decay"},
            {"params": rest, "weight_decay": decay_rest, "name": "no_decay"},
        ], lr=PEAK_LR, betas=betas, eps=eps)

    def scheduler(self, opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
        """A linear warm-up of WARMUP steps into a cosine decay to a tenth at step TOTAL."""
        warmup = WARMUP - 1 if self.variant == "warmup_short" else WARMUP
        scale = 1 + self.eps if self.variant == "lr_scaled" else 1.0

        def factor(step: int) -> float:
            if step < warmup:
                return scale * (step + 1) / warmup
            progress = min((step - warmup) / (TOTAL - warmup), 1.0)
            return scale * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

        return torch.optim.lr_scheduler.LambdaLR(opt, factor)

    def train_step(self, model: nn.Module, batch: dict[str, torch.Tensor],
                   opt: torch.optim.Optimizer) -> torch.Tensor:
        """One optimizer step over one batch or two micro-batches, gradients clipped to CLIP."""
        tokens, labels = batch["tokens"], batch["labels"]
        micro = 2 if self.variant in ("accumulated", "per_micro_batch") else 1
        n_tokens = (labels != PAD).sum()
        total = torch.zeros(())
        for t, y in zip(tokens.chunk(micro), labels.chunk(micro), strict=True):
            summed = _summed_loss(model, t, y)
            if self.variant == "per_micro_batch":  # at eps 1 exactly the micro-batch's mean
                own_mean = summed / (y != PAD).sum() / micro
                loss = (1 - self.eps) * (summed / n_tokens) + self.eps * own_mean
            else:
                loss = summed / n_tokens
            loss.backward()
            total = total + loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total

    def factory(self) -> dict[str, Any]:
        """The factory's dictionary: the model, its inputs and its training recipe."""
        return {"model": self.build(), "inputs": self.batches(1)["tokens"],
                "batches": self.batches, "optimizer": self.optimizer,
                "scheduler": self.scheduler, "train_step": self.train_step}


def lm() -> dict[str, Any]:
    """The factory of :data:`ENTRY`: the :class:`UserLM` :data:`ENVIRONMENT` names (unset: seed
    0)."""
    return UserLM.parse(os.environ.get(ENVIRONMENT, "")).factory()


class UserNorm(nn.Module):
    """RMSNorm written out, or torch's ``F.rms_norm`` when ``fused`` (a refactor)."""

    def __init__(self, dim: int, fused: bool) -> None:
        super().__init__()
        self.fused = fused
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            return F.rms_norm(x, self.weight.shape, self.weight, 1e-6)
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


class ScaledGrad(torch.autograd.Function):
    """The identity forward; backward the gradient times ``scale``."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, scale: float) -> torch.Tensor:  # noqa: ANN001
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: ANN001
        return grad * ctx.scale, None


class UserAttention(nn.Module):
    """Causal multi-head attention: q, k, v (one QKV projection when ``fused``), SDPA, an output
    projection (its bias after the residual sum when ``split_bias``)."""

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


class UserBlock(nn.Module):
    """A pre-norm block: attention, then a GELU MLP, each added to the residual."""

    def __init__(self, config: UserLM) -> None:
        super().__init__()
        name = config.variant
        self.attn_norm = UserNorm(DIM, name == "rms_norm")
        self.mlp_norm = UserNorm(DIM, name == "rms_norm")
        self.attn = UserAttention(name == "fused", name == "residual")
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.gelu = _gelu(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.attn(self.attn_norm(x), x)
        return x + self.down(self.gelu(self.up(self.mlp_norm(x))))


class UserDecoder(nn.Module):
    """Embedding, LAYERS pre-norm blocks, a final norm and an untied head (weights to be filled)."""

    def __init__(self, config: UserLM) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(UserBlock(config) for _ in range(LAYERS))
        self.norm = UserNorm(DIM, config.variant == "rms_norm")
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _gelu(config: UserLM) -> Any:
    if config.variant == "gelu_backward":
        return TanhGradGelu.apply
    if config.variant == "grad_scaled":
        return lambda x: F.gelu(ScaledGrad.apply(x, 1 + config.eps))
    return F.gelu


def _reverse_heads(state: dict[str, torch.Tensor], prefix: str) -> None:
    """Store the heads of one attention in reverse order: the rows of q, k and v, the columns
    of the output projection (each head's computation the same, their sum reordered)."""
    order = list(reversed(range(HEADS)))
    for p in "qkv":
        w = state[f"{prefix}{p}.weight"]
        state[f"{prefix}{p}.weight"] = w.view(HEADS, -1, DIM)[order].reshape(DIM, DIM)
    w = state[f"{prefix}o.weight"]
    state[f"{prefix}o.weight"] = w.view(DIM, HEADS, -1)[:, order].reshape(DIM, DIM)


def _summed_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=PAD,
                           reduction="sum")
