"""``torchparity check``: the pre-merge command.

Checks every zoo case against its golden outputs in every cell (attention backend x dtype x
device) this machine offers and prints a table: rows are cases, columns backends, each cell the
verdict and headroom (share of the tolerance budget used) per dtype. Exit status 0 when every
cell passes, 1 when any output diverged or its weights/inputs changed, 2 for a usage or golden
error. See :mod:`torchparity.golden.cases` for what is compared and how.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import queue
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

from torchparity import backends
from torchparity.commands.common import dtype_name
from torchparity.errors import UsageError
from torchparity.golden.cases import (
    OUTPUT_KINDS,
    REFERENCE,
    Cell,
    CheckResult,
    check_case,
    load_case,
    single_thread,
)
from torchparity.golden.store import GOLDEN_DIR_ENV, GoldenStore, default_golden_dir
from torchparity.golden.user_models import (
    Subject,
    backend_names,
    check_subject,
    load_goldens,
    user_golden_dir,
)
from torchparity.reference import zoo

DEFAULT_DTYPES = {"cpu": ["fp32", "bf16"], "cuda": ["fp32", "tf32", "bf16", "fp16"]}
CHECK_DTYPES = ("fp32", "tf32", "bf16", "fp16")

GOLDEN_DIR_HELP = (f"folder of the golden outputs (default: ${GOLDEN_DIR_ENV}, else golden/ of "
                   "the torchparity source tree around the working directory, else of the "
                   "source tree torchparity is imported from); `torchparity golden update` "
                   "creates it")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Compare every zoo case with its goldens, forward and backward, on every attention "
        "backend and dtype available (fp32 and bf16 on the CPU; also tf32 and fp16 on CUDA). "
        "The reference column recomputes the goldens in float64 and catches changed math; the "
        "other columns are judged by the tolerance model against the manual backend in the "
        "same dtype. With --model, your own model is checked the same way against its goldens "
        "(docs/your-model.md). Exit status: 0 all pass, 1 something diverged, 2 usage or "
        "golden error, 3 your model's factory raised.")
    parser.add_argument("--case", action="append", metavar="NAME",
                        help="zoo case to check (repeatable; default: all, or none with "
                             "--model)")
    parser.add_argument("--model", action="append", metavar="ENTRY",
                        help="your own model: file.py:factory or package.module:factory, a "
                             "callable returning (model, inputs[, loss_fn]) (repeatable; see "
                             "docs/your-model.md); its goldens come from `torchparity golden "
                             "update --model ENTRY`")
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help=f"attention backend (repeatable; default: all of "
                             f"{', '.join(backends.names())}; with a transformers --model "
                             f"also hf-eager, its eager attention)")
    parser.add_argument("--dtype", action="append", metavar="DTYPE", type=dtype_name,
                        help=f"dtype (repeatable; one of {', '.join(CHECK_DTYPES)}, or torch's "
                             f"names such as float32 and bfloat16; default: "
                             f"fp32, bf16 on cpu and also tf32, fp16 on cuda)")
    parser.add_argument("--device", action="append", metavar="DEVICE",
                        help="device (repeatable; default: cpu, and cuda when available)")
    parser.add_argument("--golden-dir", metavar="DIR",
                        help=GOLDEN_DIR_HELP + f"; for --model: ${GOLDEN_DIR_ENV}, else "
                             "golden/ in the working directory")
    parser.add_argument("--json", metavar="PATH", help="also write the results as JSON to PATH")
    parser.add_argument("--jobs", type=int, metavar="N",
                        help="worker processes (default: 2 when the machine has 2+ cores; 1 "
                             "runs in this process)")
    parser.add_argument("--train", action="store_true",
                        help="also train each case's golden recipe (20 steps) in every cell "
                             "but the reference one and judge the loss, gradient-norm and "
                             "update-norm trajectory against the golden trajectory")


def run(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    subjects = [Subject.load(entry) for entry in args.model or []]
    cases = [] if subjects and not args.case else select_cases(args.case)
    # The zoo's goldens live in the source tree, a user's under the working directory.
    store = GoldenStore(default_golden_dir(args.golden_dir) if cases else
                        user_golden_dir(args.golden_dir))
    model_root = user_golden_dir(args.golden_dir)
    if cases:
        store.require_root()
    cells = select_cells(args.backend, args.dtype, args.device,
                         backend_names(subjects) if subjects else backends.names())
    jobs = _jobs(args.jobs)
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise UsageError(f"--json {args.json}: its folder does not exist")
    for case in cases:  # every golden is validated before any work starts
        load_case(store, case)
    for subject in subjects:
        load_goldens(subject, subject.store(model_root))
    trajectories = _trajectory_store(store, cases) if args.train else None

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    progress = Progress(TextColumn("{task.description:<36}"), BarColumn(), MofNCompleteColumn(),
                        TimeElapsedColumn(), console=Console(stderr=True), transient=True)
    with progress:
        results = execute(store, cases, cells, jobs, progress) if cases else []
        results += check_models(subjects, model_root, cells, progress)
        if trajectories is not None:
            results += train_results(trajectories, cases, cells, progress)
    elapsed = time.perf_counter() - started

    console = Console(soft_wrap=True)
    render(console, results, cells, cases, elapsed)
    ok = all(r.ok for r in results)
    if args.json:
        write_json(Path(args.json), results, ok, store.root)
    return 0 if ok else 1


# --- what to check --------------------------------------------------------------------------


def select_cases(names: list[str] | None) -> list[zoo.ZooCase]:
    """The zoo cases named (all when None); an unknown name is a :class:`UsageError`."""
    for name in names or []:
        if name not in zoo.names():
            raise UsageError(f"unknown zoo case {name!r}; choose from {', '.join(zoo.names())}")
    return [zoo.get(name) for name in zoo.names() if names is None or name in names]


def select_cells(backend_names: list[str] | None, dtypes: list[str] | None,
                 devices: list[str] | None, known: list[str] | None = None) -> list[Cell]:
    """The reference cell, then every (device, dtype, backend) selected, in a stable order.

    ``known`` are the backends to choose from (default: the attention backends). Backends that
    cannot run a cell are kept: they are reported as ``n/a`` with the reason.
    """
    known = known or backends.names()
    for name in backend_names or []:
        if name not in known:
            raise UsageError(f"unknown attention backend {name!r}; choose from "
                             f"{', '.join(known)}")
    for dtype in dtypes or []:
        if dtype not in CHECK_DTYPES:
            raise UsageError(f"unknown dtype {dtype!r} for --dtype; choose from "
                             f"{', '.join(CHECK_DTYPES)} (the fp64 reference always runs)")
    chosen_backends = [b for b in known if backend_names is None or b in backend_names]
    cells = [REFERENCE]
    for device in _devices(devices):
        kind = torch.device(device).type
        wanted = DEFAULT_DTYPES[kind] if dtypes is None else [
            d for d in CHECK_DTYPES if d in dtypes and (d != "tf32" or kind == "cuda")]
        if dtypes is not None and devices is not None and not wanted:
            raise UsageError(f"none of the dtypes {', '.join(dtypes)} runs on {device} "
                             f"(tf32 is CUDA only)")
        cells += [Cell(b, d, device) for d in wanted for b in chosen_backends]
    if dtypes is not None and len(cells) == 1:
        raise UsageError(f"none of the dtypes {', '.join(dtypes)} runs here (tf32 needs CUDA)")
    return cells


def _devices(devices: list[str] | None) -> list[str]:
    if devices is None:
        return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    for device in devices:
        try:
            kind = torch.device(device).type
        except RuntimeError:
            kind = None
        if kind not in DEFAULT_DTYPES:
            raise UsageError(f"unknown device {device!r} for --device; use cpu or cuda[:N]")
        if kind == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"--device {device}: no CUDA device is available here")
    return list(dict.fromkeys(devices))


def _trajectory_store(store: GoldenStore, cases: list[zoo.ZooCase]) -> GoldenStore:
    from torchparity.golden.training import load_trajectories

    return load_trajectories(store, [case.name for case in cases])


def _jobs(jobs: int | None) -> int:
    if jobs is None:
        return 2 if (os.cpu_count() or 1) >= 2 else 1
    if jobs < 1:
        raise UsageError(f"--jobs must be at least 1, got {jobs}")
    return jobs


# --- running --------------------------------------------------------------------------------


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
    return sorted(results, key=lambda r: (case_order[r.case],
                                          cell_order[Cell(r.backend, r.dtype, r.device)],
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
    torch.set_num_threads(1)  # one core per worker (see golden_cases.single_thread)


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
            results += check_subject(subject, subject.store(root), cells,
                                     lambda label, s=subject: progress.update(
                                         task, advance=1, description=f"{s.name} {label}"))
    return results


def train_results(store: GoldenStore, cases: list[zoo.ZooCase], cells: list[Cell],
                  progress: Any) -> list[CheckResult]:
    """The ``trajectory`` rows of ``check --train`` (see :mod:`torchparity.golden.training`)."""
    from torchparity.golden.training import check_trajectories

    trained = [cell for cell in cells if cell != REFERENCE]
    task = progress.add_task("training", total=len(cases) * len(trained))
    with single_thread():
        return check_trajectories(store, [case.name for case in cases], trained,
                                  lambda label: progress.update(task, advance=1,
                                                                description=label))


# --- reporting ------------------------------------------------------------------------------


def write_json(path: Path, results: list[CheckResult], ok: bool, golden_dir: Path) -> None:
    """``{"ok", "golden_dir", "torch", "results": [row, ...]}``; see :class:`CheckResult`."""
    payload = {"ok": ok, "golden_dir": str(golden_dir), "torch": torch.__version__,
               "results": [r.to_dict() for r in results]}
    try:
        path.write_text(json.dumps(payload, indent=1) + "\n", encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot write --json {path}: {exc.strerror}") from None


def render(console: Any, results: list[CheckResult], cells: list[Cell],
           cases: list[zoo.ZooCase], elapsed: float) -> None:
    """The table, its footnotes, one line per failure and the summary."""
    from rich.table import Table

    by_cell: dict[tuple[str, Cell], list[CheckResult]] = {}
    for r in results:
        by_cell.setdefault((r.case, Cell(r.backend, r.dtype, r.device)), []).append(r)
    never_run = _never_available(results)
    footnotes: dict[str, int] = {}
    columns = [b for b in dict.fromkeys(c.backend for c in cells if c != REFERENCE)
               if b not in never_run]
    table = Table(title="torchparity check: verdict and share of the tolerance budget used "
                        "(≡ bit-identical to the baseline)", title_justify="left")
    for header in ["case", "reference", *columns]:
        table.add_column(header, no_wrap=True)
    several_devices = len({c.device for c in cells if c != REFERENCE}) > 1
    for case in dict.fromkeys(r.case for r in results):
        row = [case]
        for column in ["reference", *columns]:
            lines = [_cell_text(by_cell[case, cell], footnotes, several_devices)
                     for cell in cells
                     if (cell == REFERENCE) == (column == "reference")
                     and (column == "reference" or cell.backend == column)
                     and (case, cell) in by_cell]
            row.append("\n".join(lines))
        table.add_row(*row)
    print_table(console, table)
    for note, number in footnotes.items():
        console.print(f"[{number}] {note}", markup=False, highlight=False)
    for backend, reason in never_run.items():
        console.print(f"{backend}: n/a in every cell here ({reason})", highlight=False)
    for r in results:
        if not r.ok:
            console.print(f"FAIL {r.case} {r.backend} {r.dtype} {r.device} {r.output}: "
                          f"{r.explain or r.reason}", markup=False, highlight=False)
    console.print(_sensitivity_line(results), markup=False, highlight=False)
    console.print(_summary(results, elapsed), markup=False, highlight=False)


def _sensitivity_line(results: list[CheckResult]) -> str:
    """What the passing cells rule out: per dtype and kind, the largest relative change of an
    output that could have passed (the least sensitive cell's)."""
    weakest: dict[tuple[str, str], float] = {}
    for r in results:
        if r.sensitivity is not None:
            key = (r.dtype, r.kind)
            weakest[key] = max(weakest.get(key, 0.0), r.sensitivity)
    parts = [f"{dtype} {kind} {value:.2g}" for (dtype, kind), value in sorted(weakest.items())]
    return ("Sensitivity (a change of an output by more than this share of its golden's scale"
            " would have been flagged): " + (", ".join(parts) or "none compared"))


def print_table(console: Any, table: Any) -> None:
    """Print a rich table; logs and pipes get all of it rather than an 80-column cut."""
    from rich.measure import Measurement

    if not console.is_terminal:
        wide = console.options.update_width(1000)
        console.width = max(console.width, Measurement.get(console, wide, table).maximum)
    console.print(table)


def _never_available(results: Iterable[CheckResult]) -> dict[str, str]:
    """Backends that are n/a for every output of every cell, with one of their reasons."""
    reasons: dict[str, str | None] = {}
    for r in results:
        if r.backend in reasons and reasons[r.backend] is None:
            continue
        reasons[r.backend] = r.reason if r.verdict == "n/a" else None
    return {b: reason for b, reason in reasons.items() if reason is not None}


def _cell_text(rows: list[CheckResult], footnotes: dict[str, int], with_device: bool) -> str:
    first = rows[0]
    label = f"{first.device} {first.dtype}" if with_device else first.dtype
    failed = [r for r in rows if not r.ok]
    compared = [r for r in rows if r.headroom is not None]
    unavailable = [r for r in rows if r.verdict == "n/a"]
    if failed:
        verdicts = {r.verdict for r in failed}
        worst = max((r.headroom for r in failed if r.headroom is not None), default=None)
        text = "✗ " + "/".join(sorted(verdicts)) + (f" {_share(worst)}" if worst else "")
    elif compared:
        identical = all(r.verdict == "identical" for r in compared)
        text = "≡" if identical else f"✓ {_share(max(r.headroom for r in compared))}"
    else:
        text = "n/a"
    differing = [f"{r.output}: {s}" for r in rows for s in r.structure or []]
    if differing:
        note = "structure differs (not a divergence): " + "; ".join(differing)
        text += f" [{footnotes.setdefault(note, len(footnotes) + 1)}]"
    if unavailable:
        outputs = ", ".join(r.output for r in unavailable)
        note = f"{outputs} n/a: {unavailable[0].reason}" if compared or failed else \
            f"n/a: {unavailable[0].reason}"
        number = footnotes.setdefault(note, len(footnotes) + 1)
        text += f" [{number}]"
    return f"{label} {text}"


def _share(headroom: float) -> str:
    if headroom == float("inf"):
        return "inf"
    return f"{headroom:.0%}" if headroom < 10 else f"{headroom:.3g}x"


def _summary(results: list[CheckResult], elapsed: float) -> str:
    counts: dict[str, int] = {}
    for r in results:
        counts[r.verdict] = counts.get(r.verdict, 0) + 1
    parts = ", ".join(f"{n} {verdict}" for verdict, n in sorted(counts.items()))
    status = "OK" if all(r.ok for r in results) else "FAILED"
    cases = len({r.case for r in results})
    return (f"{status}: {len(results)} outputs of {cases} case(s) or model(s) in {elapsed:.1f} s "
            f"({parts})")
