"""Factories of the user-style language model (``user_lm.py``) with one training hook wrong
each: what ``torchparity train --model`` must refuse in one line, writing no golden."""

from __future__ import annotations

import torch
from user_lm import batches, build, optimizer, train_step


def _factory(**changes: object) -> dict:
    return {"model": build("base"), "inputs": batches(1)["tokens"], "batches": batches,
            "optimizer": optimizer, "train_step": train_step, **changes}


def batches_not_callable() -> dict:
    return _factory(batches=[batches(1)])


def optimizer_not_callable() -> dict:
    return _factory(optimizer="adamw")


def no_loss() -> dict:
    def step_without_loss(model, batch, opt):  # noqa: ANN001, ANN202
        train_step(model, batch, opt)

    return _factory(train_step=step_without_loss)


def nan_at_step_3() -> dict:
    calls = []

    def step_with_nan(model, batch, opt):  # noqa: ANN001, ANN202
        calls.append(batch)
        loss = train_step(model, batch, opt)
        return loss * torch.nan if len(calls) == 3 else loss

    return _factory(train_step=step_with_nan)
