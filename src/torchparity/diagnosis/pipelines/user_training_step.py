"""A user's training step that leaves its noise band, drilled down: the stage where it parts
(forward, backward or the optimizer update of named parameter groups), and for the forward or
backward pass the module (and op) where it enters.

The stage is read off the quantities judged at the first divergent step k: weights that enter
step k within the band, a loss out of it, say the forward pass; a loss within and a gradient
norm out, the backward pass; both within and an update norm out, the optimizer update, per
parameter group. No reference code is needed.

The module needs a reference A on the weights the float64 run has as step k starts (trained
k-1 steps by the recipe). A and B take the step's first call of the model, as the factory's
``train_step`` (or the default step) makes it, and the step's own loss as a linear loss: the
dot product of the output with the gradient the step's loss gave it in float64. Its gradient
is the step's, so every module's gradient is too, whatever the loss and its normalisation.

- Without a base, A is this very code in float64's weights under the reference execution,
  B under the judged one (:func:`torchparity.diagnose`): what the execution changes, not the
  code; the report says so.
- With ``--base REV`` the base's code is A: :func:`main` runs in the base's worktree, in a
  process of its own, and writes A's weights and the trace :func:`~.forward.record` makes of
  its step (:func:`record_step`); B loads A's weights (renamed or fused ones paired as the
  goldens pair them, :mod:`torchparity.golden.renamed`) and is judged against the trace
  (:func:`~.forward.diagnose_against`), its ops recorded at the base when a module parts.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import inspect
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from torchparity.comparison.tensor import json_safe
from torchparity.diagnosis.core.trace import inputs_digest
from torchparity.diagnosis.pipelines.forward import diagnose, diagnose_against, record
from torchparity.diagnosis.pipelines.training_step import runs_as
from torchparity.diagnosis.reports.diagnosis import DiagnosisReport
from torchparity.errors import TorchParityError
from torchparity.golden.renamed import renaming, state_layout
from torchparity.subject.model import Subject
from torchparity.subject.trees import flatten_tensors
from torchparity.threads import single_thread
from torchparity.train.trainer import OWN_ATTENTION, Execution
from torchparity.train.trajectory import Point, TrajectoryComparison
from torchparity.train.user_model import UserRecipe, UserTrainer

#: What a code change needs to be found module by module.
ADD_BASE = "the module is found against the base's code: add --base REV"
_WEIGHTS, _LAYOUT, _TRACE = "weights.safetensors", "layout.json", "trace"
#: The stage each judged quantity (or its per-group form) measures, in the order they run.
_STAGES = {"loss": "forward", "grad_norm": "backward", "update_norm": "optimizer"}


@dataclass
class StepStage:
    """Where step ``step`` parts, from its judged quantities: ``stage`` is ``forward``,
    ``backward`` or ``optimizer``; ``groups`` the parameter groups whose gradient norm
    (backward) or update norm (optimizer) left the band, with the share of it they used."""

    step: int
    stage: str
    quantity: str
    headroom: float
    groups: dict[str, float] = field(default_factory=dict)

    def sentence(self) -> str:
        """``step 1 parts in the optimizer update of parameter group no_decay (2.9e+04x its
        band)``."""
        where = {"forward": "the forward pass (the loss)",
                 "backward": "the backward pass (the gradients)",
                 "optimizer": "the optimizer update"}[self.stage]
        if self.groups:
            named = ", ".join(f"{name} ({_times(share)} its band)"
                              for name, share in self.groups.items())
            where += f" of parameter group{'s' if len(self.groups) > 1 else ''} {named}"
        else:
            where += f" ({self.quantity}, {_times(self.headroom)} its band)"
        return f"step {self.step} parts in {where}"

    def to_dict(self) -> dict[str, Any]:
        return json_safe({"step": self.step, "stage": self.stage, "quantity": self.quantity,
                          "headroom": self.headroom, "groups": self.groups})


def step_stage(comparison: TrajectoryComparison) -> StepStage | None:
    """The stage of the first divergent step of ``comparison``.

    Args:
        comparison: a run judged against its golden trajectory and noise band.

    Returns:
        The :class:`StepStage` of its first divergent step; None when every step is within.
    """
    first = comparison.first_divergence
    if first is None:
        return None
    out = [p for p in comparison.points if p.step == first.step and not p.ok]
    family = min((_family(p) for p in out), key=list(_STAGES).index)  # the earliest stage
    out = [p for p in out if _family(p) == family]
    worst = max(out, key=lambda p: p.headroom)
    groups = {p.quantity[len(family) + 1:-1]: p.headroom for p in out if p.quantity != family}
    return StepStage(first.step, _STAGES[family], worst.quantity, worst.headroom, groups)


@dataclass
class StepDiagnosis:
    """The stage of a step that parts and, for the forward or backward pass, the module
    diagnosis (``report``) or why there is none (``reason``); ``note`` what A was."""

    stage: StepStage
    report: DiagnosisReport | None = None
    reason: str | None = None
    note: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**self.stage.to_dict(), "note": self.note, "reason": self.reason,
                "modules": None if self.report is None else self.report.to_dict()}


def diagnose_user_step(subject: Subject, execution: Execution, stage: StepStage, *,
                       base: Path | None = None,
                       more_ops: Callable[[list[str]], Path] | None = None) -> StepDiagnosis:
    """Drill ``stage`` (of ``subject`` trained under ``execution``) down to the module.

    Args:
        subject: B, the model whose run parted.
        execution: how B's run was trained (backend, dtype, device).
        stage: the stage :func:`step_stage` found.
        base: a folder :func:`record_step` wrote at the base (A's weights and its step's
            trace); None: A is ``subject`` itself under the reference execution.
        more_ops: with ``base``, ``more_ops(modules)`` is a folder :func:`record_step` wrote
            at the base with A's ops of those modules.

    Returns:
        The :class:`StepDiagnosis`: the module report, or the reason it has none.
    """
    if stage.stage == "optimizer":
        return StepDiagnosis(stage, reason=f"the loss and gradients of step {stage.step} are "
                             "within the band: no module to look for; the optimizer's update "
                             "parts (its hyperparameters, weight decay, the learning rate)")
    reference = _a_execution(execution)
    if base is None:
        return _against_itself(subject, execution, reference, stage)
    return _against_base(subject, execution, stage, base, more_ops)


def _a_execution(execution: Execution) -> Execution:
    """A's execution: the model's own attention (or manual where a backend replaces it) in
    B's dtype, so that A's own rounding sets B's budget."""
    backend = OWN_ATTENTION if execution.backend == OWN_ATTENTION else "manual"
    return Execution(backend, execution.dtype, execution.device)


def _against_itself(subject: Subject, execution: Execution, reference: Execution,
                    stage: StepStage) -> StepDiagnosis:
    if reference == execution:
        return StepDiagnosis(stage, reason=(
            f"no module table: without --base, A would be this code in this very execution "
            f"({execution.label()}), nothing to tell apart; {ADD_BASE}"))
    trainer = _trained_before(subject, stage.step, execution.device)
    weights = copy.deepcopy(trainer.model)
    with _cpu_thread(execution):
        call = capture_call(trainer, stage.step)
    param = execution.mode.param_dtype
    model_a = weights.to(param)
    report = diagnose(model_a, copy.deepcopy(model_a), _cast(call.inputs, param),
                      loss_fn=call.loss_fn(), backends=(runs_as(reference), runs_as(execution)),
                      progress=False)
    note = (f"A is this code under {reference.label()}, B under {execution.label()}, on the "
            f"weights of the float64 run at step {stage.step} ({call.describe()}): the table "
            f"shows what the execution changes; a change of code shows only as the stage, "
            f"{ADD_BASE}")
    return StepDiagnosis(stage, report, note=note)


def _against_base(subject: Subject, execution: Execution, stage: StepStage, base: Path,
                  more_ops: Callable[[list[str]], Path] | None) -> StepDiagnosis:
    trainer = UserTrainer(subject, UserRecipe(subject.entry, stage.step),
                          Execution(OWN_ATTENTION, "fp64", execution.device))
    reason = load_base_weights(trainer.model, base)
    if reason is not None:
        return StepDiagnosis(stage, reason=reason)
    weights = copy.deepcopy(trainer.model)
    with _cpu_thread(execution):
        call = capture_call(trainer, stage.step)
    recorded = json.loads((base / _LAYOUT).read_text())["inputs"]
    # The trace holds A in the parameter dtype: B runs so too, without autocast or TF32.
    plain = Execution(execution.backend, _plain_dtype(execution), execution.device)
    note = (f"A is the base's code, B this code, on the base's float64 weights at step "
            f"{stage.step} ({call.describe()}), B under {plain.label()}")
    if plain != execution:
        note += (f" (the base records its step without autocast or TF32: a change that "
                 f"shows only in {execution.dtype}'s rounding is not found here)")
    if inputs_digest(call.inputs) != recorded:
        return StepDiagnosis(stage, note=note, reason=(
            "no module table: this code's step calls the model with other inputs than the "
            "base's (another batch or split into other micro-batches): the step itself "
            "changed, not a module"))
    with_ops = None if more_ops is None else (lambda modules: more_ops(modules) / _TRACE)
    report = diagnose_against(base / _TRACE, weights, call.inputs, loss_fn=call.loss_fn(),
                              backend=runs_as(plain), progress=False, more_ops=with_ops)
    return StepDiagnosis(stage, report, note=note)


# -- the step's call of the model ------------------------------------------------------------

@dataclass
class StepCall:
    """The first call of the model in a training step: its ``inputs`` and the gradient the
    step's loss gave each floating output (by path); ``calls`` how many the step made."""

    inputs: Any
    gradients: dict[str, torch.Tensor]
    calls: int

    def loss_fn(self) -> Callable[[Any, Any], torch.Tensor]:
        """The step's loss, linear in the output: its gradient is the step's."""
        gradients = self.gradients

        def loss(output: Any, inputs: Any) -> torch.Tensor:
            total = None
            for path, tensor in flatten_tensors(output, "output").items():
                if path in gradients:
                    compute = torch.promote_types(tensor.dtype, torch.float32)
                    term = (tensor.to(compute) * gradients[path].to(tensor.device, compute)).sum()
                    total = term if total is None else total + term
            return total
        return loss

    def describe(self) -> str:
        head = "its call of the model" if self.calls == 1 else \
            f"the first of its {self.calls} calls of the model"
        return f"{head}, with the gradient the step's loss gave the output"


def capture_call(trainer: UserTrainer, step: int) -> StepCall:
    """Run step ``step`` on ``trainer`` and keep its first call of the model.

    Args:
        trainer: a trainer whose model holds the weights step ``step`` starts from.
        step: the optimizer step (1-based) whose batch is taken.

    Returns:
        The :class:`StepCall`: the call's inputs and its outputs' gradients.
    """
    first = _FirstCall()
    handle = trainer.model.register_forward_hook(first, with_kwargs=True)
    try:
        trainer.step(step)
    finally:
        handle.remove()
    if not first.gradients:
        raise TorchParityError(f"step {step} of {trainer.subject.entry} did not call the model "
                               "with gradients reaching its output: nothing to diagnose")
    return StepCall(first.inputs, first.gradients, first.calls)


class _FirstCall:
    """A forward hook counting the model's calls and keeping the first one's inputs and the
    gradients its outputs receive (its one backward)."""

    def __init__(self) -> None:
        self.calls, self.inputs = 0, None
        self.gradients: dict[str, torch.Tensor] = {}

    def __call__(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        self.calls += 1
        if self.calls > 1:
            return
        self.inputs = _inputs(module, _detached(args), _detached(kwargs))
        for path, tensor in flatten_tensors(output, "output").items():
            if tensor.requires_grad:
                tensor.register_hook(lambda g, path=path: self._keep(path, g))

    def _keep(self, path: str, grad: torch.Tensor) -> None:
        self.gradients[path] = grad.detach().clone()


def _inputs(module: nn.Module, args: tuple, kwargs: dict) -> Any:
    if not kwargs:
        return args
    if not args:
        return kwargs
    return dict(inspect.signature(module.forward).bind(*args, **kwargs).arguments)


def _detached(tree: Any) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.detach().clone()
    if isinstance(tree, dict):
        return {k: _detached(v) for k, v in tree.items()}
    if isinstance(tree, tuple | list):
        return type(tree)(_detached(v) for v in tree)
    return tree


def _cast(tree: Any, dtype: torch.dtype) -> Any:
    if isinstance(tree, torch.Tensor):
        return tree.to(dtype) if tree.is_floating_point() else tree
    if isinstance(tree, dict):
        return {k: _cast(v, dtype) for k, v in tree.items()}
    if isinstance(tree, tuple | list):
        return type(tree)(_cast(v, dtype) for v in tree)
    return tree


def _trained_before(subject: Subject, step: int, device: str) -> UserTrainer:
    """A trainer of ``subject`` in float64 that has taken steps 1..``step - 1``."""
    trainer = UserTrainer(subject, UserRecipe(subject.entry, step),
                          Execution(OWN_ATTENTION, "fp64", device))
    with _cpu_thread(Execution(OWN_ATTENTION, "fp64", device)):
        for before in range(1, step):
            trainer.step(before)
    return trainer


def _cpu_thread(execution: Execution) -> contextlib.AbstractContextManager:
    # one thread on the CPU, as the trajectories were trained
    on_cpu = torch.device(execution.device).type == "cpu"
    return single_thread() if on_cpu else contextlib.nullcontext()


# -- the base's side -------------------------------------------------------------------------

def record_step(subject: Subject, step: int, execution: Execution, folder: Path, *,
                ops: str | None = None, ops_only: bool = False) -> Path:
    """Write A's side of step ``step`` into ``folder``: the weights of the float64 run as the
    step starts (and their layout, the step's inputs' checksum) and the trace of the step's
    call in ``execution``'s parameter dtype under its reference attention, with the float64
    golden.

    Args:
        subject: A, the base's model and recipe.
        step: the first divergent step.
        execution: how the judged run was trained (its dtype and attention backend).
        folder: where to write (created).
        ops: A's ops of these modules kept, as in :func:`~.forward.record`.
        ops_only: the trace holds only those ops.

    Returns:
        ``folder``.
    """
    folder.mkdir(parents=True, exist_ok=True)
    trainer = _trained_before(subject, step, execution.device)
    weights = copy.deepcopy(trainer.model)
    with _cpu_thread(execution):
        call = capture_call(trainer, step)
    layout = state_layout(weights)
    state = {name: t.detach().cpu().contiguous() for name, t in weights.state_dict().items()
             if not isinstance(layout[name], str)}  # a tied tensor once
    save_file(state, str(folder / _WEIGHTS))
    (folder / _LAYOUT).write_text(json.dumps({"layout": layout,
                                              "inputs": inputs_digest(call.inputs)}))
    backend = _a_execution(execution).backend
    record(weights, call.inputs, folder / _TRACE, loss_fn=call.loss_fn(),
           backend=None if backend == OWN_ATTENTION else backend, progress=False,
           dtype=execution.mode.param_dtype, ops=ops, ops_only=ops_only)
    return folder


def load_base_weights(model: nn.Module, folder: Path) -> str | None:
    """Copy the base's weights in ``folder`` into ``model``, renamed or fused ones paired by
    name, order and shape.

    Args:
        model: B's model (its floating tensors are overwritten in place).
        folder: what :func:`record_step` wrote at the base.

    Returns:
        None when every weight found its counterpart, else why not (one sentence).
    """
    layout = json.loads((folder / _LAYOUT).read_text())["layout"]
    state = load_file(str(folder / _WEIGHTS))
    own = state_layout(model)
    paired = renaming(layout, own)
    if not paired.complete:
        return "no module table: " + paired.unmatched_sentence("this code")
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if isinstance(own[name], str):
                continue
            pieces = paired.pieces.get(name)
            parts = [state[p.golden] for p in pieces] if pieces else [state[name]]
            tensor.copy_(torch.cat(parts) if len(parts) > 1 else parts[0])
    return None


def main(argv: list[str] | None = None) -> int:
    """The base side in its own process (what ``train --model --diagnose --base`` runs in the
    base's worktree).

    Args:
        argv: ``ENTRY STEP BACKEND DTYPE DEVICE FOLDER [--ops M [--ops-only]]``.

    Returns:
        The exit status: 0 recorded, 2 with the one-line error on stderr.
    """
    parser = argparse.ArgumentParser(prog="torchparity train --diagnose (base side)")
    for name in ("entry", "step", "backend", "dtype", "device", "folder"):
        parser.add_argument(name)
    parser.add_argument("--ops")
    parser.add_argument("--ops-only", action="store_true")
    args = parser.parse_args(argv)
    try:
        record_step(Subject.load(args.entry), int(args.step),
                    Execution(args.backend, args.dtype, args.device), Path(args.folder),
                    ops=args.ops, ops_only=args.ops_only)
    except TorchParityError as exc:
        print(f"torchparity train: error: {exc}", file=sys.stderr)
        return 2
    return 0


def _plain_dtype(execution: Execution) -> str:
    """The dtype whose name runs ``execution``'s parameter dtype with nothing else."""
    return "fp64" if execution.mode.param_dtype == torch.float64 else "fp32"


def _family(point: Point) -> str:
    return point.quantity.partition("[")[0]


def _times(headroom: float) -> str:
    return f"{headroom:.3g}x"


if __name__ == "__main__":
    sys.exit(main())
