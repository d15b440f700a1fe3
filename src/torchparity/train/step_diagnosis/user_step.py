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
- With ``--base REV`` the base's code is A: :mod:`.base_side` runs in the base's worktree,
  in a process of its own, and writes A's weights and the trace :func:`~.forward.record`
  makes of its step (:func:`.base_side.record_step`); B loads A's weights (renamed or fused
  ones paired as the goldens pair them, :mod:`torchparity.golden.renamed`) and is judged
  against the trace (:func:`~.forward.diagnose_against`), its ops recorded at the base when a
  module parts.
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
    diagnosis (``report``) or why there is none (``reason``); ``note`` what A was;
    ``causes`` the changes of the optimizer's groups that explain the step."""

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
    """The changes of the optimizer's groups that explain the first divergent step.

    A change acts from the update of its step on: one at an earlier step explains anything
    the step measures; one at the step itself only its update norms, and, for a parameter
    that changed group, the per-group gradient norms (of other members now). The loss and
    total gradient norm of step 1 are measured before any update: no group change explains
    them.

    Args:
        comparison: the run judged against its golden.
        stage: the stage of its first divergent step.
        changes: what :func:`~torchparity.train.optimizer_groups.compare_groups` found up to
            that step.

    Returns:
        The changes that explain it, in the order given.
    """
    out = [p.quantity for p in comparison.points if p.step == stage.step and not p.ok]

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
        base: a folder :func:`.base_side.record_step` wrote at the base (A's weights and
            its step's trace); None: A is ``subject`` itself under the reference execution.
        more_ops: with ``base``, ``more_ops(modules)`` is a folder
            :func:`.base_side.record_step` wrote at the base with A's ops of those modules.

    Returns:
        The :class:`StepDiagnosis`: the module report, or the reason it has none.
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


