"""A zoo case's training step that parts, diagnosed module by module."""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator
from typing import Any

import torch

from torchparity import backends
from torchparity.diagnosis.pipelines.forward import diagnose
from torchparity.diagnosis.reports.diagnosis import DiagnosisReport
from torchparity.train.data import token_losses
from torchparity.train.trainer import (
    OWN_ATTENTION,
    Execution,
    TrainConfig,
    batch_at,
    deterministic,
    model_before,
)


def diagnose_step(config: TrainConfig, reference: Execution, candidate: Execution, step: int,
                  **diagnose_kwargs: Any) -> DiagnosisReport:
    """Diagnose step ``step`` of ``config``: both sides on the reference's weights."""
    # fed the step's global batch and training loss; a clean report points at the optimizer,
    # clipping or loss scaling instead
    if torch.device(candidate.device) != torch.device(reference.device):
        raise ValueError("diagnose_step compares executions on one device; got "
                         f"{reference.device} and {candidate.device}")
    model_a = model_before(config, reference, step)
    model_b = copy.deepcopy(model_a).to(candidate.device, candidate.mode.param_dtype)
    batch = batch_at(config, step)

    def loss_fn(output: torch.Tensor, inputs: Any) -> torch.Tensor:
        return token_losses(output, batch.labels.to(output.device)).sum() / batch.n_tokens

    return diagnose(model_a, model_b, batch.to(candidate.device).inputs, loss_fn=loss_fn,
                    backends=(runs_as(reference), runs_as(candidate)), **diagnose_kwargs)


def runs_as(execution: Execution) -> Callable[[], contextlib.AbstractContextManager]:
    """A context factory selecting the execution's backend, autocast and TF32 setting."""
    @contextlib.contextmanager
    def select() -> Iterator[None]:
        mode = execution.mode
        with contextlib.ExitStack() as stack:
            if execution.backend != OWN_ATTENTION:
                stack.enter_context(backends.use(execution.backend))
            stack.enter_context(deterministic(tf32=mode.tf32))
            if mode.autocast_dtype is not None:
                device_type = torch.device(execution.device).type
                stack.enter_context(torch.autocast(device_type, dtype=mode.autocast_dtype))
            yield
    select.__name__ = execution.label()  # how reports name the backend
    return select
