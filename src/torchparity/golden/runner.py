"""``torchparity check`` in one call, goldens validated first; ``golden verify`` and ``update``."""

from __future__ import annotations

import functools
import multiprocessing
import os
import queue
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from torchparity import backends
from torchparity.collector import freeze_for_good
from torchparity.errors import UsageError
from torchparity.golden import check_loop, sharded
from torchparity.golden.cases import OUTPUT_KINDS, check_case, load_case
from torchparity.golden.cell_selection import select_cases, select_cells
from torchparity.golden.cells import REFERENCE, Cell, CheckResult
from torchparity.golden.html import write_html
from torchparity.golden.model_check import backend_names, check_subject
from torchparity.golden.report import Machines, Page, check_page, render, write_json
from torchparity.golden.store import GoldenStore, default_golden_dir
from torchparity.golden.user_models import (
    islands_sentence,
    load_goldens,
    model_store,
    user_golden_dir,
    write_goldens,
)
from torchparity.reference import zoo
from torchparity.subject import Subject
from torchparity.subject.names import NameMap
from torchparity.threads import single_thread

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import Progress


@dataclass
class CheckReport:
    """What :func:`check_goldens` found, with the cells, cases and machines its report needs."""

    results: list[CheckResult]
    cells: list[Cell]
    cases: list[zoo.ZooCase]
    machines: Machines
    golden_dir: Path  # the zoo's, or the models' when no zoo case is checked
    model_root: Path

    @property
    def ok(self) -> bool:
        """Whether every result passed."""
        return all(r.ok for r in self.results)

    def page(self, elapsed: float) -> Page:
        """The table, its footnotes, the failures and the summary, for terminal and HTML alike."""
        return check_page(self.results, self.cells, elapsed, self.machines)

    def render(self, console: Console, elapsed: float) -> None:
        """Print the report on ``console`` (a log: 80 columns), lines wrapped, the table folded."""
        render(console, self.page(elapsed))

    def write(self, json: str | None, html: str | None, elapsed: float) -> None:
        """Write the results as JSON and the report as an HTML page, each where asked."""
        if json:
            write_json(Path(json), self.results, self.ok, self.golden_dir, self.machines)
        if html:
            write_html(Path(html), self.page(elapsed))


#: ``check --train``'s golden trajectories, given by the training wing: the cases' store read
#: (every golden validated before any cell runs) to each case's feed of the loop.
TrajectoryFeeds = Callable[[GoldenStore, list[str]], Callable[[str], check_loop.Feed]]


@dataclass(frozen=True)
class CheckRequest:
    """What one check is asked: zoo ``cases`` (None: all, or none with ``models``) and ``models``.

    The zoo's goldens come from ``golden_dir``, the models' from ``model_root`` (a base
    revision's) else ``golden_dir`` or :func:`user_golden_dir`. ``jobs``: processes for the zoo's
    cells; ``train``: each case's golden trajectory too; ``json``, ``html``: where the report
    goes (their folders must exist); ``name_map``: the goldens' module names to the models'
    (renamed weights).
    """

    cases: list[str] | None
    models: list[Subject]
    backend: list[str] | None = None
    dtype: list[str] | None = None
    device: list[str] | None = None
    compile_forms: list[str] = field(default_factory=list)
    golden_dir: str | None = None
    model_root: Path | None = None
    jobs: int | None = None
    train: TrajectoryFeeds | None = None
    json: str | None = None
    html: str | None = None
    name_map: NameMap | None = None


def check_goldens(request: CheckRequest, progress: Progress) -> CheckReport:
    """Check what ``request`` asks against its goldens, shown on ``progress`` while the cells run.

    Raises:
        UsageError, GoldenError: every choice and every golden is validated, and the folders
            of ``json`` and ``html`` must exist, before any cell runs.
    """
    cases, models, name_map = request.cases, request.models, request.name_map
    golden_dir, json, html = request.golden_dir, request.json, request.html
    if name_map and (sharded.active() or not models):
        raise UsageError("--name-map maps the goldens' module names of a --model entry checked "
                         "in one process (a zoo case's and a sharded model's weights keep "
                         "their names): give --model ENTRY, without --nproc")
    made_here = request.model_root is not None
    model_root = request.model_root if made_here else user_golden_dir(golden_dir)
    chosen = [] if models and not cases else select_cases(cases)
    if request.train and not chosen:
        raise UsageError("--train trains the zoo's cases by their golden recipes, which a "
                         "--model entry has not: add --case NAME, or leave --train out")
    # The zoo's goldens live in the source tree, a user's under the working directory.
    store = GoldenStore(default_golden_dir(golden_dir) if chosen else model_root)
    if chosen:
        store.require_root()
    cells = select_cells(request.backend, request.dtype, request.device,
                         backend_names(models) if models else backends.names(),
                         request.compile_forms)
    jobs = _jobs(request.jobs)
    for flag, path in (("--json", json), ("--html", html)):
        if path and not Path(path).resolve().parent.is_dir():
            raise UsageError(f"{flag} {path}: its folder does not exist")
    goldens = {case.name: load_case(store, case) for case in chosen}
    goldens |= {subject.name: load_goldens(subject, model_store(subject, model_root))
                for subject in models}
    # The base's goldens are made here and now, by a torchparity that may not record machines.
    machines = Machines.of(goldens, cells, made_here=made_here)
    feeds = request.train(store, [case.name for case in chosen]) if request.train else None
    with progress:
        results = execute(store, chosen, cells, jobs, progress) if chosen else []
        results += check_user_models(models, model_root, cells, progress, name_map)
        if feeds is not None:
            results += train_results(feeds, chosen, cells, progress)
    return CheckReport(results, cells, chosen, machines, store.root, model_root)


def _jobs(jobs: int | None) -> int:
    if jobs is None:
        return 2 if (os.cpu_count() or 1) >= 2 else 1
    if jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {jobs}")
    return jobs


def execute(store: GoldenStore, cases: list[zoo.ZooCase], cells: list[Cell], jobs: int,
            progress: Progress) -> list[CheckResult]:
    """Check ``cases`` in ``cells``, in ``jobs`` processes; results in case, cell, output order."""
    task = progress.add_task("checking", total=len(cases) * len(cells))

    def advance(label: str) -> None:
        progress.update(task, advance=1, description=label)

    # groups by dtype and device share a baseline and compiled kernels; the cheap reference group
    # runs first, here, so the cases whose model changed are judged against today's float64 too
    groups = _groups(cells)
    with single_thread():
        results = [r for group in groups if REFERENCE in group for case in cases
                   for r in check_case(store, case, group,
                                       lambda label, c=case: advance(f"{c.name} {label}"))]
    changed = sorted({r.case for r in results if r.cell == REFERENCE and r.verdict == "diverged"})
    groups = [group for group in groups if REFERENCE not in group]
    if jobs == 1 or len(groups) == 1:
        with single_thread():
            results += [r for group in groups for case in cases
                        for r in check_case(store, case, group,
                                            lambda label, c=case: advance(f"{c.name} {label}"),
                                            case.name in changed)]
    elif groups:
        results += _execute_parallel(store, cases, groups, jobs, advance, changed)
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
    return list(groups.values())


_progress_queue: Any = None


def _init_worker(progress_queue: Any) -> None:
    global _progress_queue
    _progress_queue = progress_queue
    torch.set_num_threads(1)  # one core per worker (see golden.cases.single_thread)
    freeze_for_good()  # the imports' objects (see torchparity.collector)


def _check_group(root: str, case_names: list[str], cells: list[Cell],
                 changed: list[str]) -> list[CheckResult]:
    store = GoldenStore(root)
    results = []
    for name in case_names:
        results += check_case(store, zoo.get(name), cells,
                              lambda label, n=name: _progress_queue.put(f"{n} {label}"),
                              name in changed)
    return results


def _execute_parallel(store: GoldenStore, cases: list[zoo.ZooCase], groups: list[list[Cell]],
                      jobs: int, advance: Callable[[str], None],
                      changed: list[str]) -> list[CheckResult]:
    context = multiprocessing.get_context("spawn")  # fork is unsafe once torch has threads
    progress_queue = context.Queue()
    names = [case.name for case in cases]
    with ProcessPoolExecutor(min(jobs, len(groups)), mp_context=context,
                             initializer=_init_worker, initargs=(progress_queue,)) as pool:
        futures = [pool.submit(_check_group, str(store.root), names, group, changed)
                   for group in groups]
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


def check_user_models(subjects: list[Subject], root: Path, cells: list[Cell],
                      progress: Progress, name_map: NameMap | None = None) -> list[CheckResult]:
    """Check users' models in this process (their factories need not import elsewhere)."""
    task = progress.add_task("checking", total=len(subjects) * len(cells))
    results = []
    with single_thread():
        for subject in subjects:
            check_one = (sharded.check_sharded if sharded.active() else
                         functools.partial(check_subject, name_map=name_map))
            results += check_one(
                subject, model_store(subject, root), cells,
                lambda label, s=subject: progress.update(task, advance=1,
                                                         description=f"{s.name} {label}"),
                lambda label, text, s=subject: progress.update(
                    task, description=f"{s.name} {label}: {text}"))
    return results


def train_results(feeds: Callable[[str], check_loop.Feed], cases: list[zoo.ZooCase],
                  cells: list[Cell], progress: Progress) -> list[CheckResult]:
    """The ``trajectory`` rows of ``check --train``: each case's feed in every cell that trains."""
    trained = [cell for cell in cells if cell != REFERENCE and not cell.compile]
    task = progress.add_task("training", total=len(cases) * len(trained))
    with single_thread():
        return [result for case in cases for result in check_loop.check_cells(
            feeds(case.name), trained, lambda label, name=case.name: progress.update(
                task, advance=1, description=f"{name} {label} trajectory"))]


# --- golden update and verify ---------------------------------------------------------------


def update_models(subjects: list[Subject], root: Path, status: Callable[[Subject, str], None]
                  ) -> Iterator[tuple[Subject, dict[str, str], str | None]]:
    """Write each model's goldens in turn: what each write did, where float64 runs narrower."""
    with single_thread():
        for subject in subjects:
            status(subject, "")
            store = model_store(subject, root)
            statuses = (sharded.write_sharded_goldens(subject, store) if sharded.active() else
                        write_goldens(subject, store, lambda text, s=subject: status(s, text)))
            yield subject, statuses, islands_sentence(load_goldens(subject, store))


def verify_cases(store: GoldenStore, cases: list[zoo.ZooCase]
                 ) -> Iterator[tuple[zoo.ZooCase, list[CheckResult]]]:
    """The zoo's goldens recomputed in float64 and judged case by case, all validated first."""
    for case in cases:
        load_case(store, case)
    for case in cases:
        yield case, check_case(store, case, [REFERENCE])


def verify_models(subjects: list[Subject], root: Path
                  ) -> Iterator[tuple[Subject, list[CheckResult]]]:
    """Each model's goldens recomputed in float64 and judged, as :func:`verify_cases` does."""
    for subject in subjects:
        load_goldens(subject, model_store(subject, root))
    with single_thread():
        for subject in subjects:
            yield subject, check_subject(subject, model_store(subject, root), [REFERENCE])

