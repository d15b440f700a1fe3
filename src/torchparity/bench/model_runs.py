"""What ``torchparity bench`` shows while it runs: a bar per part, users' models as they come."""

from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TaskID, TextColumn, TimeElapsedColumn
from rich.progress import Progress as RichProgress

from torchparity.bench import at_size, user_model
from torchparity.bench import report as bench_report
from torchparity.bench.host import machine_info
from torchparity.bench.rounds import Document, Progress
from torchparity.golden.report import print_table
from torchparity.subject import Subject


def bench_models(entries: list[str], dtypes: list[str], device: str, *, rounds: int | None,
                 threads: int | None, compile: bool, backend: list[str] | None,
                 skip: set[str]) -> Document:
    """``bench --model``: each entry's numbers, printed as they come; the result for ``--json``.

    ``skip``: throughput, check (its cost), size (at size).
    """
    in_process = {"throughput", "check"} - skip
    subjects = {entry: Subject.load(entry) for entry in entries} if in_process else {}
    console = Console(soft_wrap=True)
    result: Document = {"machine": machine_info(device, threads),
                              "throughput": [], "size": [], "check": []}
    for entry in entries:
        subject = subjects.pop(entry, None)  # the measured processes get the memory
        if "throughput" not in skip:
            with console.status(f"timing {subject.name}"):
                rows = user_model.model_throughput_rows(subject, dtypes, rounds or 5, device)
            result["throughput"] += rows
            console.print(bench_report.model_throughput_table(subject.name, device, rows))
        if compile and subject is not None:
            with console.status(f"compiling and timing {subject.name}"):
                compiled = user_model.compiled_rows(subject, dtypes, rows, rounds or 5,
                                                    device, backend)
            result["compiled"] = result.get("compiled", []) + compiled
            print_table(console, bench_report.model_compiled_table(subject.name, device, compiled))
        if "check" not in skip:
            with console.status(f"timing check --model {subject.name}"):
                cost = user_model.check_cost(subject)
            result["check"].append(cost)
            console.print(f"check --model {subject.name}: {cost['model_check_s']:.2f} s for "
                          f"{cost['cells']} cells, {cost['plain_ratio']:.1f}× one plain step "
                          f"per cell ({cost['plain_steps_s']:.3f} s); the zoo's "
                          f"{cost['zoo_case']} in the same cells: {cost['zoo_check_s']:.2f} s; "
                          f"ratio {cost['ratio']:.2f}", markup=False)
        del subject
        if "size" not in skip:
            with console.status(f"timing golden update and check of {entry}, each in its own "
                                "process"):
                cost = at_size.measure(entry, dtypes, backend)
            result["size"].append(cost)
            console.print(bench_report.at_size_lines(cost), markup=False, highlight=False)
    return result


class PartProgressBar(Progress):
    """A rich progress bar per part, on stderr."""

    def __init__(self, console: Console) -> None:
        self._bar = RichProgress(TextColumn("{task.fields[part]:<10}"), BarColumn(),
                             MofNCompleteColumn(), TimeElapsedColumn(),
                             TextColumn("{task.description}"), console=console, transient=False)
        self._task: TaskID | None = None

    def __enter__(self) -> PartProgressBar:
        self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._finish()
        self._bar.stop()

    def start(self, part: str, total: int) -> None:
        """A new bar for ``part``, the last one's marked done."""
        self._finish()
        self._task = self._bar.add_task("", total=total, part=part)

    def _finish(self) -> None:
        if self._task is not None:
            self._bar.update(self._task, completed=self._bar.tasks[self._task].total,
                             description="done")

    def advance(self, description: str) -> None:
        # Advancing when the next unit starts keeps the description on what is running now.
        """Count the unit that ran and show what runs now."""
        task = self._bar.tasks[self._task]
        if task.description:
            self._bar.advance(self._task)
        self._bar.update(self._task, description=description)
