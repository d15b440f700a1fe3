"""A user-style decoder language model trained by its own recipe: its own data (arithmetic
progressions of varied length, padded), AdamW with a no-decay group for norms and biases,
gradient clipping and a linear warm-up into a cosine decay. The model and recipe live in
:mod:`torchparity.calibration.training_models` (seed 0 here), where the training study draws
them from many seeds; this file is the entry a user would write.

``lm`` is the factory (``torchparity train --model tests/train/user_lm.py:lm``). The variant
it builds is read from ``USER_LM_VARIANT``, so one golden name serves the original and every
change to it, as a refactor in place would:

- refactors that change rounding only: ``fused`` (one QKV projection holding the three
  weights), ``residual`` (the output projection's bias added after the residual sum),
  ``accumulated`` (two micro-batches, each loss divided by the step's target tokens);
- training-only bugs: ``per_micro_batch`` (each micro-batch's loss its own mean, averaged over
  the micro-batches, as transformers' Trainer did before 4.46), ``decay_norms`` (weight decay
  on norms and biases), ``gelu_backward`` (a custom autograd GELU: exact forward, the tanh
  approximation's derivative in backward), ``warmup_short`` (the warm-up one step short);
- changes of the optimizer: ``norms_in_decay`` (the norms' weights moved into the decay
  group), ``betas_changed`` (AdamW's betas (0.9, 0.99)), ``eps_changed`` (AdamW's eps 1e-6).
"""

from __future__ import annotations

import os

import torch
from torch import nn

from torchparity.calibration.training_models import UserDecoder, UserLM

REFACTORS = ("fused", "residual", "accumulated")
BUGS = ("per_micro_batch", "decay_norms", "gelu_backward", "warmup_short")
OPTIMIZER_CHANGES = ("norms_in_decay", "betas_changed", "eps_changed")


def variant() -> str:
    name = os.environ.get("USER_LM_VARIANT", "base")
    if name not in ("base", *REFACTORS, *BUGS, *OPTIMIZER_CHANGES):
        raise ValueError(f"unknown USER_LM_VARIANT {name!r}")
    return name


def build(name: str) -> UserDecoder:
    """The model of variant ``name``, with the weights of the original (a fused projection
    holds the original's three)."""
    return UserLM(variant=name).build()


def batches(step: int) -> dict[str, torch.Tensor]:
    """Step ``step``'s batch: progressions of lengths 4 to 12, the targets the next tokens."""
    return UserLM().batches(step)


def optimizer(model: nn.Module) -> torch.optim.Optimizer:
    return UserLM(variant=variant()).optimizer(model)


def scheduler(opt: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    return UserLM(variant=variant()).scheduler(opt)


def train_step(model: nn.Module, batch: dict[str, torch.Tensor],
               opt: torch.optim.Optimizer) -> torch.Tensor:
    """One optimizer step: the loss per target token, over one batch or two micro-batches."""
    return UserLM(variant=variant()).train_step(model, batch, opt)


def lm() -> dict:
    """The factory: the variant of ``USER_LM_VARIANT`` and its training recipe."""
    return {"model": build(variant()), "inputs": batches(1)["tokens"],
            "batches": batches, "optimizer": optimizer, "scheduler": scheduler,
            "train_step": train_step}
