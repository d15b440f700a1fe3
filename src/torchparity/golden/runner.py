"""Running the check's matrix: zoo cases in worker processes, users' models and training
trajectories in this one, with progress reported as each cell finishes."""

from __future__ import annotations

import multiprocessing
import queue
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from torchparity.golden.cases import OUTPUT_KINDS, check_case
from torchparity.golden.cells import REFERENCE, Cell, CheckResult, single_thread
from torchparity.golden.model_check import check_subject
from torchparity.golden.store import GoldenStore
from torchparity.golden.user_models import model_store
from torchparity.reference import zoo
from torchparity.subject import Subject


def execute(store: GoldenStore, cases: list[zoo.ZooCase], cells: list[Cell], jobs: int,
            progress: Any) -> list[CheckResult]:
    """Check ``cases`` in ``cells``; results in case, cell, output order.

    Cells are grouped by dtype and device (each group shares its baseline and the traces of
    compiled kernels); with ``jobs > 1`` the groups run in that many spawned processes.
    """
    task = progress.add_task("checking", total=len(cases) * len(cells))

    def advance(label: str) -> None:
        progress.update(task, advance=1, description=label)

    groups = _groups(cells)
    if jobs == 1 or len(groups) == 1:
        with single_thread():
            results = [r for group in groups for case in cases
                       for r in check_case(store, case, group,
                                           lambda label, c=case: advance(f"{c.name} {label}"))]
    else:
        results = _execute_parallel(store, cases, groups, jobs, advance)
    case_order = {c.name: i for i, c in enumerate(cases)}
    cell_order = {c: i for i, c in enumerate(cells)}
    output_order = {o: i for i, o in enumerate(OUTPUT_KINDS)}
    return sorted(results, key=lambda r: (case_order[r.case], cell_order[r.cell],
                                          output_order[r.output]))


def _groups(cells: list[Cell]) -> list[list[Cell]]:
    groups: dict[tuple[str, str], list[Cell]] = {}
    for cell in cells:
        key = ("reference", "") if cell == REFERENCE else (cell.device, cell.dtype)
        groups.setdefault(key, []).append(cell)
    # The reference group is the cheapest: run it last, in whichever worker is free first.
    return sorted(groups.values(), key=lambda group: group[0] == REFERENCE)


_progress_queue: Any = None


def _init_worker(progress_queue: Any) -> None:
    global _progress_queue
    _progress_queue = progress_queue
    torch.set_num_threads(1)  # one core per worker (see golden.cases.single_thread)


def _check_group(root: str, case_names: list[str], cells: list[Cell]) -> list[CheckResult]:
    store = GoldenStore(root)
    results = []
    for name in case_names:
        results += check_case(store, zoo.get(name), cells,
                              lambda label, n=name: _progress_queue.put(f"{n} {label}"))
    return results


def _execute_parallel(store: GoldenStore, cases: list[zoo.ZooCase], groups: list[list[Cell]],
                      jobs: int, advance: Callable[[str], None]) -> list[CheckResult]:
    context = multiprocessing.get_context("spawn")  # fork is unsafe once torch has threads
    progress_queue = context.Queue()
    names = [case.name for case in cases]
    with ProcessPoolExecutor(min(jobs, len(groups)), mp_context=context,
                             initializer=_init_worker, initargs=(progress_queue,)) as pool:
        futures = [pool.submit(_check_group, str(store.root), names, group) for group in groups]
        while not all(f.done() for f in futures):
            _drain(progress_queue, advance, timeout=0.1)
        results = [r for f in futures for r in f.result()]
    _drain(progress_queue, advance, timeout=0.0)
    return results


def _drain(progress_queue: Any, advance: Callable[[str], None], timeout: float) -> None:
    try:
        advance(progress_queue.get(timeout=timeout))
        while True:
            advance(progress_queue.get_nowait())
    except queue.Empty:
        pass


def check_models(subjects: list[Subject], root: Path, cells: list[Cell],
                 progress: Any) -> list[CheckResult]:
    """Check users' models in this process (their factories need not import elsewhere)."""
    task = progress.add_task("checking", total=len(subjects) * len(cells))
    results = []
    with single_thread():
        for subject in subjects:
            results += check_subject(
                subject, model_store(subject, root), cells,
                lambda label, s=subject: progress.update(task, advance=1,
                                                         description=f"{s.name} {label}"),
                lambda label, text, s=subject: progress.update(
                    task, description=f"{s.name} {label}: {text}"))
    return results


def train_results(store: GoldenStore, cases: list[zoo.ZooCase], cells: list[Cell],
                  progress: Any) -> list[CheckResult]:
    """The ``trajectory`` rows of ``check --train`` (see :mod:`torchparity.golden.training`)."""
    from torchparity.golden.training import check_trajectories

    trained = [cell for cell in cells if cell != REFERENCE and not cell.compile]
    task = progress.add_task("training", total=len(cases) * len(trained))
    with single_thread():
        return check_trajectories(store, [case.name for case in cases], trained,
                                  lambda label: progress.update(task, advance=1,
                                                                description=label))
