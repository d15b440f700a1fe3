"""A user's training step that leaves its band, drilled down to its stage and module.

The stage is read off the quantities judged at the first divergent step k. The module needs A
on the weights the float64 run has as step k starts; A and B take the step's first call of the
model with the step's own loss as a linear loss (the output dotted with the gradient the loss
gave it in float64), so every module's gradient is the step's. Without a base, A is this code
under the reference execution; with ``--base REV``, the base's code (:mod:`.base_side`).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchparity.comparison.tensor import json_safe
from torchparity.diagnosis.core.trace import inputs_digest
from torchparity.diagnosis.pipelines.forward import diagnose, diagnose_against
from torchparity.diagnosis.reports.diagnosis import DiagnosisReport
from torchparity.subject.model import Subject
from torchparity.subject.running import cast_inputs
from torchparity.train.optimizer_groups import GroupChange
from torchparity.train.step_diagnosis.base_side import (
    LAYOUT_FILE,
    TRACE_FOLDER,
    load_base_weights,
)
from torchparity.train.step_diagnosis.case_step import runs_as
from torchparity.train.step_diagnosis.step_call import (
    a_execution,
    capture_call,
    cpu_thread,
    trained_before,
)
from torchparity.train.trainer import OWN_ATTENTION, Execution
from torchparity.train.trajectory import Point, TrajectoryComparison
from torchparity.train.user_model import UserRecipe, UserTrainer

#: What a code change needs to be found module by module.
ADD_BASE = "the module is found against the base's code: add --base REV"
#: The stage each judged quantity (or its per-group form) measures, in the order they run.
_STAGES = {"loss": "forward", "grad_norm": "backward", "update_norm": "optimizer"}


@dataclass
class StepStage:
    """Where step ``step`` parts (forward, backward, optimizer), and the groups out of band."""

    step: int
    stage: str
    quantity: str
    headroom: float
    groups: dict[str, float] = field(default_factory=dict)

    def sentence(self) -> str:
        """``step 1 parts in the optimizer update of parameter group no_decay (2.9e+04x its band)``
        """
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
    """The stage of the first divergent step of ``comparison``; None when every step is within."""
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
    """The stage of a step that parts, and its module report or why there is none."""

    stage: StepStage
    report: DiagnosisReport | None = None
    reason: str | None = None
    note: str | None = None
    causes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {**self.stage.to_dict(), "note": self.note, "reason": self.reason,
                "causes": self.causes,
                "modules": None if self.report is None else self.report.to_dict()}


def group_causes(comparison: TrajectoryComparison, stage: StepStage,
                 changes: list[GroupChange]) -> list[GroupChange]:
    """The changes of the optimizer's groups that explain the first divergent step."""
    out = [p.quantity for p in comparison.points if p.step == stage.step and not p.ok]

    # A change acts from its step's update on: an earlier one explains anything, one at the
    # step only its update norms and, for a parameter that changed group, per-group gradients.
    def explains(change: GroupChange) -> bool:
        if change.step < stage.step:
            return True
        return change.step == stage.step and all(
            q.startswith("update_norm") or (change.members and q.startswith("grad_norm["))
            for q in out)

    return [c for c in changes if explains(c)]


def diagnose_user_step(subject: Subject, execution: Execution, stage: StepStage, *,
                       base: Path | None = None,
                       more_ops: Callable[[list[str]], Path] | None = None) -> StepDiagnosis:
    """Drill ``stage`` (of ``subject`` trained under ``execution``) down to the module.

    Args:
        subject: B, the model whose run parted.
        execution: how B's run was trained (backend, dtype, device).
        stage: the stage :func:`step_stage` found.
        base: A's weights and step trace, recorded at the base; None: A is ``subject`` itself
            under the reference execution.
        more_ops: with ``base``, the folder of A's ops of the given modules, recorded at the base.

    Returns:
        The module report, or the reason it has none.
    """
    if stage.stage == "optimizer":
        return StepDiagnosis(stage, reason=f"the loss and gradients of step {stage.step} are "
                             "within the band: no module to look for; the optimizer's update "
                             "parts (its hyperparameters, weight decay, the learning rate)")
    reference = a_execution(execution)
    if base is None:
        return _against_itself(subject, execution, reference, stage)
    return _against_base(subject, execution, stage, base, more_ops)


def _against_itself(subject: Subject, execution: Execution, reference: Execution,
                    stage: StepStage) -> StepDiagnosis:
    if reference == execution:
        return StepDiagnosis(stage, reason=(
            f"no module table: without --base, A would be this code in this very execution "
            f"({execution.label()}), nothing to tell apart; {ADD_BASE}"))
    trainer = trained_before(subject, stage.step, execution.device)
    weights = copy.deepcopy(trainer.model)
    with cpu_thread(execution):
        call = capture_call(trainer, stage.step)
    param = execution.mode.param_dtype
    model_a = weights.to(param)
    inputs = cast_inputs(call.inputs, execution.device, param)
    report = diagnose(model_a, copy.deepcopy(model_a), inputs,
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
    with cpu_thread(execution):
        call = capture_call(trainer, stage.step)
    recorded = json.loads((base / LAYOUT_FILE).read_text())["inputs"]
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
    with_ops = None if more_ops is None else (lambda modules: more_ops(modules) / TRACE_FOLDER)
    report = diagnose_against(base / TRACE_FOLDER, weights, call.inputs, loss_fn=call.loss_fn(),
                              backend=runs_as(plain), progress=False, more_ops=with_ops)
    return StepDiagnosis(stage, report, note=note)


def _plain_dtype(execution: Execution) -> str:
    """The dtype whose name runs ``execution``'s parameter dtype with nothing else."""
    return "fp64" if execution.mode.param_dtype == torch.float64 else "fp32"


def _family(point: Point) -> str:
    return point.quantity.partition("[")[0]


def _times(headroom: float) -> str:
    return f"{headroom:.3g}x"


