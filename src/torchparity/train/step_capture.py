"""One training step seen module by module, to say where a distributed run parts from one process.

:func:`capture_step` runs a step of a :class:`~torchparity.train.trainer.Trainer` and keeps the
outputs of the modules whose outputs are whole on every rank (embeddings, norms, attention, MLP,
layers, LM head: under tensor parallelism the projections inside attention and MLP hold shards,
their modules' outputs do not) on the first micro-batch, and every parameter's whole gradient
before clipping. :func:`locate` judges a distributed capture against one process's, three-way,
with a float64 copy of the one-process model as golden, and names the first module that
diverged: in forward order by output, else by gradient.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import nn

from torchparity.comparison import compare
from torchparity.errors import TorchParityError
from torchparity.reference.attention import Attention
from torchparity.reference.layers import TransformerLayer
from torchparity.reference.mlp import MLP
from torchparity.reference.models import Embeddings
from torchparity.reference.norms import LayerNorm, RMSNorm
from torchparity.train.data import TrainBatch, token_losses
from torchparity.train.trainer import Trainer, loss_denominator

_WHOLE_OUTPUT = (Embeddings, LayerNorm, RMSNorm, Attention, MLP, TransformerLayer)


@dataclass
class StepCapture:
    """Module outputs (in the order the modules ran), parameter gradients and the weights
    the step started from."""

    outputs: dict[str, torch.Tensor]
    grads: dict[str, torch.Tensor]
    weights: dict[str, torch.Tensor]


@dataclass
class Location:
    """Where a distributed step first differs: a module, by its output or its gradient."""

    step: int
    module: str | None
    quantity: str | None  # "output" or "gradient"
    explanation: str

    def render(self) -> str:
        if self.module is None:
            return (f"step {self.step}: every module's output and gradient is within budget; "
                    "look at the optimizer, clipping or the loss bookkeeping")
        return f"step {self.step}: first divergence in {self.module} ({self.quantity}): " \
               f"{self.explanation}"


def capture_step(trainer: Trainer, step: int) -> StepCapture:
    """Run ``step`` (the steps before it already run) and capture it; every rank must call
    this together (whole DTensors are gathered)."""
    weights = {name: _whole(p) for name, p in trainer.model.named_parameters()}
    grads: dict[str, torch.Tensor] = {}
    update = trainer._update

    def capturing_update():
        grads.update({name: _whole(p.grad) for name, p in trainer.model.named_parameters()
                      if p.grad is not None})
        return update()

    trainer._update = capturing_update
    try:
        with recording(trainer.model) as outputs:
            trainer.step(step)
    finally:
        del trainer._update
    return StepCapture(outputs, grads, weights)


def capture_pass(model: nn.Module, batch: TrainBatch, normalization: str) -> StepCapture:
    """Forward and backward of ``model`` on ``batch`` with the trainer's loss, captured."""
    model.zero_grad(set_to_none=True)
    with recording(model) as outputs:
        logits = model(**batch.inputs)
    loss = token_losses(logits, batch.labels).sum() / loss_denominator(batch, normalization)
    loss.backward()
    grads = {name: p.grad.detach().clone() for name, p in model.named_parameters()
             if p.grad is not None}
    return StepCapture(outputs, grads, {})


@contextlib.contextmanager
def recording(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Record the first output of every whole-output module of ``model`` while in the block."""
    outputs: dict[str, torch.Tensor] = {}

    def hook(name: str):
        def record(module: nn.Module, inputs: object, output: object) -> None:
            if name not in outputs and isinstance(output, torch.Tensor):
                outputs[name] = _whole(output)
        return record

    handles = [module.register_forward_hook(hook(name))
               for name, module in model.named_modules()
               if isinstance(module, _WHOLE_OUTPUT) or name == "lm_head"]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def load_weights(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    """Copy ``weights`` (whole tensors by parameter name) into ``model``."""
    missing = [name for name, _ in model.named_parameters() if name not in weights]
    if missing:
        raise TorchParityError(f"the parallel model has no parameter {missing[0]}; locating a "
                               "divergence needs the one-process model's parameter names")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(weights[name])


def golden_of(trainer: Trainer, step: int) -> StepCapture:
    """The float64 capture of ``trainer``'s model as it enters ``step``, on the whole batch."""
    golden = copy.deepcopy(trainer.model).to(torch.float64)
    return capture_pass(golden, trainer.corpus.batch(step), trainer.config.normalization)


def locate(step: int, candidate: StepCapture, baseline: StepCapture, golden: StepCapture,
           rows: int) -> Location:
    """The first module whose output (on the candidate's first ``rows`` rows), else whose
    gradient, leaves the three-way budget."""
    for name, output in candidate.outputs.items():
        if name not in golden.outputs:
            continue
        result = compare(output, golden.outputs[name][:rows], baseline.outputs[name][:rows],
                         kind="forward")
        if not result.ok:
            return Location(step, name, "output", result.explain())
    # Judged together: the gradients of one block share their scale (see tolerance.KINDS).
    grads = compare(candidate.grads, golden.grads, baseline.grads, kind="grad")
    first = next((t for t in grads.tensors if t.verdict == "diverged"), None)
    if first is not None:
        name = first.path.rpartition("[")[2].strip('"]')
        return Location(step, name.rpartition(".")[0], "gradient",
                        f"{name}: error {first.error:.3g} is {first.headroom:.3g} times the "
                        f"budget")
    return Location(step, None, None, "")


def _whole(x: torch.Tensor) -> torch.Tensor:
    x = x.full_tensor() if hasattr(x, "full_tensor") else x
    return x.detach().to("cpu", copy=True)
