"""``torchparity bench``: backend throughput and start-up, and the cost of the safety net."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

from torchparity.bench import report as bench_report
from torchparity.bench.host import machine_info
from torchparity.bench.rounds import Progress
from torchparity.bench.runner import run as run_bench
from torchparity.bench.settings import DTYPE_CHOICES, PARTS, REFERENCE_CASES, default_settings
from torchparity.commands.common import dtype_name
from torchparity.errors import UsageError
from torchparity.golden.report import print_table


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None,
                        help="cpu or cuda (default: cuda when available, else cpu)")
    parser.add_argument("--dtype", action="append", type=dtype_name, choices=DTYPE_CHOICES,
                        help="dtype to measure (repeatable; default: fp32 on the CPU, "
                             "bf16 and fp32 on CUDA)")
    parser.add_argument("--size", action="append", metavar="NAME",
                        help="benchmark size (repeatable; cpu: s, m; cuda: m, l; default: all)")
    parser.add_argument("--case", action="append", metavar="NAME",
                        help="zoo case to scale up as the model (repeatable; default: "
                             f"{' and '.join(REFERENCE_CASES)}; diagnose uses the first)")
    parser.add_argument("--model", action="append", metavar="ENTRY",
                        help="your own model instead of the zoo: file.py:factory or "
                             "package.module:factory (repeatable); measures tokens/s and time "
                             "to the first step per backend, and the cost of `check --model` "
                             "against the same cells of the zoo's check (skip it with "
                             "--skip check)")
    parser.add_argument("--backend", action="append", metavar="NAME",
                        help="attention backend to measure (repeatable; default: all; "
                             "keep manual, the baseline of the ratios)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="interleaved measured rounds per contender (default 5, quick 3)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="unmeasured warm-up steps per contender (default 1)")
    parser.add_argument("--threads", type=int, default=None,
                        help="torch intra-op threads of the measured processes (default: "
                             "torch's own choice, one per core)")
    parser.add_argument("--beams", type=int, metavar="K",
                        help="the decode part also times record + diagnose of a K-beam "
                             "search against a plain beam search of A and B (default: greedy "
                             "only)")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the models; reports graphs, graph breaks and "
                             "recompiles (the zoo: cold compile caches; with --model: each "
                             "backend also compiled dynamic and static, Inductor's caches on, "
                             "against the same backend eagerly; slow on a CPU)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes and few rounds: a smoke run of seconds "
                             "(does not time `torchparity check`)")
    parser.add_argument("--skip", action="append", choices=[*PARTS, "size"], default=[],
                        help="leave a part out (repeatable; size: with --model, the golden "
                             "update and check of the model in their own processes)")
    parser.add_argument("--json", metavar="PATH", help="write the full result as JSON to PATH")
    parser.add_argument("--markdown", metavar="PATH",
                        help="write the tables as Markdown to PATH (for BENCHMARKS.md)")


def run(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        torch.device(device)
    except RuntimeError:
        raise UsageError(f"--device {device!r} is not a torch device (try cpu or cuda)") from None
    if args.model:
        return _bench_models(args, device)
    settings = default_settings(
        device, args.quick, tuple(args.size or ()),
        dtypes=tuple(args.dtype or ()),
        cases=tuple(args.case or ()),
        backends=tuple(args.backend or ()),
        rounds=args.rounds, warmup=args.warmup, compile=args.compile, threads=args.threads,
        beams=args.beams,
        parts=tuple(p for p in PARTS if p not in args.skip),
    )
    for path in (args.json, args.markdown):
        if path and not Path(path).parent.is_dir():
            raise UsageError(f"cannot write {path}: directory {Path(path).parent} does not exist")

    console = Console()
    with _ProgressBar(Console(stderr=True)) as progress:
        result = run_bench(settings, progress)
    bench_report.print_tables(result, console)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(bench_report.to_markdown(result))
    return 0


def _bench_models(args: argparse.Namespace, device: str) -> int:
    from torchparity.bench import at_size, user_model
    from torchparity.subject import Subject

    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise UsageError(f"cannot write {args.json}: its directory does not exist")
    in_process = {"throughput", "check"} - set(args.skip)
    subjects = {entry: Subject.load(entry) for entry in args.model} if in_process else {}
    dtypes = args.dtype or ["fp32"]
    console = Console(soft_wrap=True)
    result: dict[str, Any] = {"machine": machine_info(device, args.threads),
                              "throughput": [], "size": [], "check": []}
    for entry in args.model:
        subject = subjects.pop(entry, None)  # the measured processes get the memory
        if "throughput" not in args.skip:
            with console.status(f"timing {subject.name}"):
                rows = user_model.throughput_rows(subject, dtypes, args.rounds or 5, device)
            result["throughput"] += rows
            console.print(bench_report.model_throughput_table(subject.name, device, rows))
        if args.compile and subject is not None:
            with console.status(f"compiling and timing {subject.name}"):
                compiled = user_model.compiled_rows(subject, dtypes, rows, args.rounds or 5,
                                                    device, args.backend)
            result["compiled"] = result.get("compiled", []) + compiled
            print_table(console, bench_report.model_compiled_table(subject.name, device, compiled))
        if "check" not in args.skip:
            with console.status(f"timing check --model {subject.name}"):
                cost = user_model.check_cost(subject)
            result["check"].append(cost)
            console.print(f"check --model {subject.name}: {cost['model_check_s']:.2f} s for "
                          f"{cost['cells']} cells, {cost['plain_ratio']:.1f}× one plain step "
                          f"per cell ({cost['plain_steps_s']:.3f} s); the zoo's "
                          f"{cost['zoo_case']} in the same cells: {cost['zoo_check_s']:.2f} s; "
                          f"ratio {cost['ratio']:.2f}", markup=False)
        del subject
        if "size" not in args.skip:
            with console.status(f"timing golden update and check of {entry}, each in its own "
                                "process"):
                cost = at_size.measure(entry, dtypes, args.backend)
            result["size"].append(cost)
            console.print(bench_report.at_size_lines(cost), markup=False, highlight=False)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


class _ProgressBar(Progress):
    """A rich progress bar per part, on stderr."""

    def __init__(self, console: Console) -> None:
        from rich.progress import Progress

        self._bar = Progress(TextColumn("{task.fields[part]:<10}"), BarColumn(),
                             MofNCompleteColumn(), TimeElapsedColumn(),
                             TextColumn("{task.description}"), console=console, transient=False)
        self._task: Any = None

    def __enter__(self) -> _ProgressBar:
        self._bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._finish()
        self._bar.stop()

    def start(self, part: str, total: int) -> None:
        self._finish()
        self._task = self._bar.add_task("", total=total, part=part)

    def _finish(self) -> None:
        if self._task is not None:
            self._bar.update(self._task, completed=self._bar.tasks[self._task].total,
                             description="done")

    def advance(self, description: str) -> None:
        # Advancing when the next unit starts keeps the description on what is running now.
        task = self._bar.tasks[self._task]
        if task.description:
            self._bar.advance(self._task)
        self._bar.update(self._task, description=description)
