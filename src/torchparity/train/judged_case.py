"""A zoo case trained and its trajectory judged: ``torchparity train``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from torchparity import backends
from torchparity.diagnosis.reports.diagnosis import DiagnosisReport
from torchparity.errors import UsageError
from torchparity.text import wrapped
from torchparity.train.golden_trajectories import (
    GOLDEN_STEPS,
    STORED_DTYPES,
    check_against_golden,
    golden_store,
    judge_against_run,
    runs_per_golden,
    write_golden_trajectory,
)
from torchparity.train.judged_model import steps_bar
from torchparity.train.step_diagnosis.case_step import diagnose_step
from torchparity.train.trainer import Execution, TrainConfig, Trainer, Trajectory
from torchparity.train.trajectory import TrajectoryComparison


@dataclass(frozen=True)
class TrainPlan:
    """What to train and how to judge it: against the goldens, another backend or one process."""

    config: TrainConfig
    execution: Execution
    check: bool = False
    against: str | None = None
    diagnose: bool = False
    golden_dir: str | None = None
    json: str | None = None
    log_every: int = 10
    nproc: int = 1
    parallel: str | None = None


def update_golden_trajectories(cases: list[str], golden_dir: str | None,
                               console: Console) -> None:
    """Train and store each case's float64 golden and its noise bands in ``golden_dir``."""
    store = golden_store(golden_dir)
    runs = runs_per_golden()
    for case in cases:
        console.print(wrapped(f"training {case} in float64 and {runs - 1} rounding-only runs "
                              f"in {' and '.join(STORED_DTYPES)} for the noise bands"),
                      markup=False)
        with steps_bar(console, f"{case} golden", runs * GOLDEN_STEPS) as advance:
            paths = write_golden_trajectory(case, store, advance=advance)
        for path in paths:
            console.print(f"wrote {path}", markup=False, soft_wrap=True)


def train_and_judge(plan: TrainPlan, console: Console) -> bool:
    """Train ``plan``'s run, print it and its verdict; True when it passed (or nothing judged)."""
    execution = plan.execution
    mode = execution.mode
    backends.resolve(execution.backend, execution.device, mode.autocast_dtype or mode.param_dtype)
    if plan.nproc > 1:
        return _train_parallel(plan, console)
    candidate = _train(plan, console)
    console.print(f"{execution.label()}: {candidate.tokens_per_second:,.0f} tok/s, first step "
                  f"after {candidate.time_to_first_step:.2f}s")
    for note in candidate.notes:
        console.print(f"note: {note}")

    def say(line: str) -> None:
        console.print(wrapped(line), markup=False, soft_wrap=True)

    comparison = None
    if plan.check:
        comparison = check_against_golden(candidate, golden_store(plan.golden_dir), say=say)
    elif plan.against:
        comparison = judge_against_run(candidate, plan.config, Execution(
            plan.against, execution.dtype, execution.device, execution.compile), say=say)
    if comparison is not None:
        for line in (comparison.explain(), comparison.budget_share(),
                     comparison.sensitivity_line()):
            say(line)
    report = None
    if comparison is not None and not comparison.ok and plan.diagnose:
        step = comparison.first_divergence.step
        reference_execution = Execution(plan.against or "manual", execution.dtype,
                                        execution.device)
        console.print(f"diagnosing step {step}: {reference_execution.label()} vs "
                      f"{execution.label()} on the same weights")
        report = diagnose_step(plan.config, reference_execution, execution, step)
        console.print(report.render(), markup=False, soft_wrap=True)
    if plan.json:
        _write_json(plan.json, candidate, comparison, report)
    return comparison is None or comparison.ok


def _train_parallel(plan: TrainPlan, console: Console) -> bool:
    """Train with ``plan.nproc`` ranks, judge the run against one process and its band."""
    from torchparity.train.distributed import check_layout, diagnose_parallel_step, run_parallel

    if plan.against:
        raise UsageError("--against runs in one process; leave it out with --nproc > 1 (a "
                         "distributed run is judged against one process and the golden)")
    config, execution, nproc = plan.config, plan.execution, plan.nproc
    parallelism = plan.parallel or "ddp"
    check_layout(config, execution, parallelism, nproc)
    console.print(f"training {config.case} with {nproc} processes, {parallelism.upper()} "
                  f"(torchrun); rank 0 logs")
    candidate = run_parallel(config, execution, parallelism=parallelism, nproc=nproc,
                             log=lambda line: console.print(line, markup=False, soft_wrap=True),
                             log_every=plan.log_every)
    console.print(f"{candidate.label()}: {candidate.tokens_per_second:,.0f} tok/s, first "
                  f"step after {candidate.time_to_first_step:.2f}s")
    comparison = judge_against_run(
        candidate, config, execution,
        say=lambda line: console.print(wrapped(line), markup=False, soft_wrap=True))
    for line in (f"vs one process: {comparison.budget_share()}", comparison.explain()):
        console.print(wrapped(line), markup=False, soft_wrap=True)
    location = None
    if not comparison.ok and plan.diagnose:
        step = comparison.first_divergence.step
        console.print(f"diagnosing step {step}: {nproc} processes vs one, module by module")
        location = diagnose_parallel_step(config, execution, parallelism=parallelism,
                                          nproc=nproc, step=step)
        console.print(location.render(), markup=False, soft_wrap=True)
    if plan.json:
        data = {"trajectory": candidate.to_dict(), "comparison": comparison.to_dict(),
                "diagnosis": None if location is None else vars(location)}
        Path(plan.json).write_text(json.dumps(data, indent=2) + "\n")
    return comparison.ok


def _train(plan: TrainPlan, console: Console) -> Trajectory:
    config, execution = plan.config, plan.execution
    with steps_bar(console, f"{config.case} {execution.label()}", config.steps) as advance:
        trainer = Trainer(config, execution, log_every=plan.log_every,
                          log=lambda line: console.print(line, markup=False, soft_wrap=True))
        for step in range(1, config.steps + 1):
            trainer.step(step)
            advance()
    return trainer.trajectory()


def _write_json(path: str, candidate: Trajectory, comparison: TrajectoryComparison | None,
                report: DiagnosisReport | None) -> None:
    data: dict[str, Any] = {
        "trajectory": candidate.to_dict(),
        "comparison": comparison.to_dict() if comparison is not None else None,
        "diagnosis": json.loads(report.to_json()) if report is not None else None}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
