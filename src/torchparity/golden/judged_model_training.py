"""A user's model trained and its trajectory judged, what ``torchparity train --model`` does:
``--update-golden`` stores the float64 trajectory and the noise band, ``--check`` trains once
and judges the run against them (:mod:`torchparity.golden.model_trajectories`).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from torchparity.diagnosis.pipelines.user_training_step import (
    StepDiagnosis,
    diagnose_user_step,
    step_stage,
)
from torchparity.golden import model_trajectories as mt
from torchparity.subject.model import Subject
from torchparity.text import wrapped
from torchparity.train.ensemble import members_count
from torchparity.train.trainer import Execution
from torchparity.train.trajectory import TrajectoryComparison
from torchparity.train.user_model import UserRecipe


@dataclass(frozen=True)
class ModelPlan:
    """A user's model ``entry`` trained ``steps`` steps under ``execution``; its goldens in
    ``golden_dir``; ``json`` the file the trajectory and verdict go to."""

    entry: str
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
    subject = Subject.load(plan.entry)
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
    """Train once, judge against the golden trajectory and band, print the verdict and its
    sensitivity; True when within."""
    subject = Subject.load(plan.entry)
    store = mt.trajectory_store(subject, plan.golden_dir, plan.execution, plan.steps)
    recipe = UserRecipe(subject.entry, plan.steps)
    bar = steps_bar(console, f"{subject.name} {plan.execution.label()}", plan.steps)

    def measuring(line: str, seconds: float) -> None:
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
        diagnosis = _diagnosed(subject, comparison, plan, console)
        data["diagnosis"] = None if diagnosis is None else diagnosis.to_dict()
    if plan.json:
        Path(plan.json).write_text(json.dumps(data, indent=2) + "\n")
    return comparison.ok


def _diagnosed(subject: Subject, comparison: TrajectoryComparison, plan: ModelPlan,
               console: Console) -> StepDiagnosis | None:
    """The first divergent step drilled down to its stage and module, printed; None (and
    "nothing to diagnose") for a run within the band."""
    stage = step_stage(comparison)
    if stage is None:
        console.print("nothing to diagnose: every step is within the band", markup=False)
        return None
    base, more_ops = None, None
    if plan.base_step is not None and stage.stage != "optimizer":
        base = plan.base_step(stage.step, None)
        more_ops = lambda modules: plan.base_step(stage.step, ",".join(modules))  # noqa: E731
    diagnosis = diagnose_user_step(subject, plan.execution, stage, base=base,
                                   more_ops=more_ops)
    console.print(wrapped(f"diagnosis: {stage.sentence()}."), markup=False, soft_wrap=True)
    if diagnosis.note:
        console.print(wrapped(diagnosis.note), markup=False, soft_wrap=True)
    if diagnosis.report is not None:
        diagnosis.report.show(console)
    if diagnosis.reason:
        console.print(wrapped(diagnosis.reason), markup=False, soft_wrap=True)
    return diagnosis


def show_verdict(comparison: TrajectoryComparison, console: Console) -> None:
    """The verdict paragraph, the budget used per quantity and what the band could detect."""
    for line in (comparison.explain(), comparison.budget_share(),
                 comparison.sensitivity_line()):
        console.print(wrapped(line), markup=False, soft_wrap=True)


class steps_bar:  # noqa: N801 - a context manager used like a function
    """A transient progress bar of ``total`` training steps, a user's model's or a zoo
    case's; entering it gives ``advance()``."""

    def __init__(self, console: Console, description: str, total: int) -> None:
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TimeElapsedColumn(), console=console,
                                 transient=True)
        self.task = self.progress.add_task(description, total=total)

    def __enter__(self) -> Any:
        self.progress.__enter__()
        return lambda: self.progress.advance(self.task)

    def __exit__(self, *exc: object) -> None:
        self.progress.__exit__(*exc)

    def add(self, steps: int) -> None:
        """``steps`` more to come: runs the bar learnt of once it started."""
        self.progress.update(self.task, total=self.progress.tasks[0].total + steps)
