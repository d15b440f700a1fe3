"""A user's model trained and its trajectory judged: ``torchparity train --model``."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from torchparity.subject.model import Subject
from torchparity.text import wrapped
from torchparity.train import model_trajectories as mt
from torchparity.train.ensemble import members_count
from torchparity.train.optimizer_groups import GroupChange, compare_groups
from torchparity.train.step_diagnosis.user_step import (
    StepDiagnosis,
    StepStage,
    diagnose_user_step,
    group_causes,
    step_stage,
)
from torchparity.train.trainer import Execution, StepDone, Trajectory
from torchparity.train.trajectory import TrajectoryComparison
from torchparity.train.user_model import UserRecipe


@dataclass(frozen=True)
class ModelPlan:
    """A user's model trained ``steps`` steps under ``execution`` and judged by its goldens."""

    subject: Subject  # loaded with its recipe (user_model.training_subject)
    steps: int
    execution: Execution
    golden_dir: str | None = None
    json: str | None = None
    diagnose: bool = False
    #: ``base_step(step, ops)``: the folder the base wrote step ``step`` of its model into
    #: (:func:`~torchparity.revisions.base_training_step`); None: no base.
    base_step: Callable[[int, str | None], Path] | None = None


def update_model_golden(plan: ModelPlan, console: Console) -> None:
    """Train the float64 trajectory and the noise ensemble, store them, say where."""
    subject = plan.subject
    store = mt.trajectory_store(subject, plan.golden_dir, plan.execution, plan.steps)
    runs = 1 + members_count(plan.execution)
    console.print(wrapped(f"training {subject.name} {plan.steps} steps in float64 and "
                          f"{runs - 1} rounding-only runs in {plan.execution.dtype} for the "
                          "noise band"), markup=False)
    with steps_bar(console, f"{subject.name} golden", runs * plan.steps) as advance:
        paths = mt.write_model_trajectory(subject, UserRecipe(subject.entry, plan.steps),
                                          plan.execution, store, advance=advance)
    for path in paths:
        console.print(f"wrote {path}", markup=False, soft_wrap=True)


def judge_model_training(plan: ModelPlan, console: Console) -> bool:
    """Train once, judge against the golden trajectory and band, print; True when within."""
    subject = plan.subject
    store = mt.trajectory_store(subject, plan.golden_dir, plan.execution, plan.steps)
    recipe = UserRecipe(subject.entry, plan.steps)
    bar = steps_bar(console, f"{subject.name} {plan.execution.label()}", plan.steps)

    def measuring(line: str) -> None:
        console.print(wrapped(line), markup=False, soft_wrap=True)
        bar.add(plan.steps * members_count(plan.execution))

    with bar as advance:
        candidate, comparison = mt.check_model_trajectory(subject, recipe, plan.execution,
                                                          store, advance=advance,
                                                          say=measuring)
    console.print(f"{subject.name} {plan.execution.label()}: {plan.steps} steps", markup=False)
    for note in comparison.notes:
        console.print(wrapped(note), markup=False, soft_wrap=True)
    show_verdict(comparison, console)
    data = {"trajectory": candidate.to_dict(), "comparison": comparison.to_dict()}
    if plan.diagnose:
        diagnosis = _diagnosed(subject, candidate, comparison, plan, console)
        data["diagnosis"] = None if diagnosis is None else diagnosis.to_dict()
    if plan.json:
        Path(plan.json).write_text(json.dumps(data, indent=2) + "\n")
    return comparison.ok


def _diagnosed(subject: Subject, candidate: Trajectory, comparison: TrajectoryComparison,
               plan: ModelPlan, console: Console) -> StepDiagnosis | None:
    """The first divergent step diagnosed and printed: the optimizer's groups, then its module."""
    stage = step_stage(comparison)
    if stage is None:
        console.print("nothing to diagnose: every step is within the band", markup=False)
        return None
    say = lambda line: console.print(wrapped(line), markup=False, soft_wrap=True)  # noqa: E731
    causes, unexplained = _group_changes(subject, candidate, comparison, stage, plan, say)
    if causes:
        stage = StepStage(stage.step, "optimizer", stage.quantity, stage.headroom, stage.groups)
        say(f"diagnosis: step {stage.step} parts in the optimizer: its parameter groups are "
            "not the golden's (A: the golden's run, B: this one):")
        for cause in causes:
            say(f"- {cause.sentence}")
        reason = ("the update, and the norms per group, follow from that change of the "
                  "optimizer: no module to look for")
        say(reason)
        return StepDiagnosis(stage, causes=[c.sentence for c in causes], reason=reason)
    base, more_ops = None, None
    if plan.base_step is not None and stage.stage != "optimizer":
        base = plan.base_step(stage.step, None)
        more_ops = lambda modules: plan.base_step(stage.step, ",".join(modules))  # noqa: E731
    diagnosis = diagnose_user_step(subject, plan.execution, stage, base=base,
                                   more_ops=more_ops)
    say(f"diagnosis: {stage.sentence()}.")
    if diagnosis.note:
        say(diagnosis.note)
    if diagnosis.report is not None and diagnosis.report.ok:
        # The table would end "Verdict: pass" under a run that failed: it is in --json.
        say(f"A's and B's call of the model at step {stage.step} agree module by module (no "
            "module's output or gradient leaves its budget): the step parts outside that "
            "call (its loss, the training step's own code, the optimizer) or in a rounding "
            "the call was not judged in; the table is in --json")
    elif diagnosis.report is not None:
        diagnosis.report.show(console)
    if diagnosis.reason:
        say(diagnosis.reason)
    for change in unexplained:
        say(f"the optimizer's groups also differ, though not in a way that can make step "
            f"{stage.step} part: {change.sentence}")
    return diagnosis


def _group_changes(subject: Subject, candidate: Trajectory, comparison: TrajectoryComparison,
                   stage: StepStage, plan: ModelPlan, say: Callable[[str], None]
                   ) -> tuple[list[GroupChange], list[GroupChange]]:
    """The changes of the optimizer's groups that explain the parting step, and the others."""
    store = mt.trajectory_store(subject, plan.golden_dir, plan.execution, plan.steps)
    golden = mt.read_model_golden(subject, UserRecipe(subject.entry, plan.steps),
                                  plan.execution, store)
    a, b = golden.optimizer_groups(), candidate.optimizer
    if a is None or b is None:
        say(f"the optimizer's groups could not be compared: {golden.golden.path} was written "
            "without them (an --update-golden now stores them)")
        return [], []
    changes = compare_groups(a, b, stage.step)
    causes = group_causes(comparison, stage, changes)
    return causes, [c for c in changes if c not in causes]


def show_verdict(comparison: TrajectoryComparison, console: Console) -> None:
    """The verdict paragraph, the budget used per quantity and what the band could detect."""
    for line in (comparison.explain(), comparison.budget_share(),
                 comparison.sensitivity_line()):
        console.print(wrapped(line), markup=False, soft_wrap=True)


class steps_bar:  # noqa: N801 - a context manager used like a function
    """A transient progress bar of ``total`` training steps; entering it gives ``advance()``."""

    def __init__(self, console: Console, description: str, total: int) -> None:
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                                 transient=True)
        self.task = self.progress.add_task(description, total=total)

    def __enter__(self) -> StepDone:
        self.progress.__enter__()
        return lambda: self.progress.advance(self.task)

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def add(self, steps: int) -> None:
        """``steps`` more to come: runs the bar learnt of once it started."""
        self.progress.update(self.task, total=self.progress.tasks[0].total + steps)
