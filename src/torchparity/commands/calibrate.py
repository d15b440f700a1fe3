"""``torchparity calibrate``: measure the tolerance model's false-alarm and detection rates.

The study itself lives in :mod:`torchparity.calibration`. Every draw is a random pre-norm
attention block (RMSNorm, q/k/v projections, rotary, attention with a random mask) or a tiny
reference model drawn from the property suite's strategies, computed three ways: the golden
(float64, manual attention), the baseline (manual attention in the candidate dtype) and
candidates. Candidates are every legitimate CPU backend, which must pass (a failure is a false
alarm), and the manual path with one planted bug, which must diverge whenever the bug is visible:
when its effect on the float64 output exceeds the fp32 noise (the fp32 baseline's error)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from torchparity import backends, machine
from torchparity.calibration import capabilities, sketched
from torchparity.calibration.problems import CALIBRATED
from torchparity.calibration.report import json_safe, print_tables, render_markdown
from torchparity.calibration.study import FAMILIES, calibrate, cpu_backends
from torchparity.commands.common import dtype_name
from torchparity.errors import UsageError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--draws", type=int, default=200,
                        help="random problems of each family (default 200)")
    parser.add_argument(
        "--problems",
        action="append",
        choices=FAMILIES,
        help="families of problems (repeatable; default both): attention blocks (long"
        " sequences, large logits) and the property suite's tiny models",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the first draw (default 0)")
    parser.add_argument(
        "--dtype",
        action="append",
        type=dtype_name,
        choices=list(CALIBRATED),
        help="candidate dtype (repeatable; default: fp32, bf16, fp16, fp64)",
    )
    parser.add_argument(
        "--backend",
        action="append",
        help="legitimate backend to test (repeatable; default: every one available on the CPU)",
    )
    parser.add_argument(
        "--flex-every",
        type=int,
        default=4,
        metavar="N",
        help="run flex on every Nth draw only: it recompiles on each CPU call (default 4)",
    )
    parser.add_argument(
        "--sketched",
        action="store_true",
        help="run the sketched study instead: the draws grown to the size where goldens are "
        "sketched, judged full and sketched; --out replaces its section of the file",
    )
    parser.add_argument(
        "--capabilities",
        action="store_true",
        help="run the same draws under each instruction set this CPU offers (one process "
        "each, ATEN_CPU_CAPABILITY) and compare their false alarms and detection; --out "
        "replaces its section of the file",
    )
    parser.add_argument("--out", metavar="PATH", help="write the report as markdown to PATH")
    parser.add_argument("--json", metavar="PATH", help="write the measurements as JSON to PATH")


def run(args: argparse.Namespace) -> int:
    if args.draws < 1:
        raise UsageError(f"--draws must be at least 1, got {args.draws}")
    if args.flex_every < 1:
        raise UsageError(f"--flex-every must be at least 1, got {args.flex_every}")
    dtypes = args.dtype or list(CALIBRATED)
    families = args.problems or list(FAMILIES)
    backend_names = args.backend or cpu_backends()
    unknown = [b for b in backend_names if b not in backends.names()]
    if unknown:
        raise UsageError(
            f"unknown --backend {', '.join(unknown)}; choose from {', '.join(backends.names())}"
        )
    if args.sketched:
        return _run_sketched(args)
    if args.capabilities:
        return _run_per_capability(args)
    console = Console(stderr=True)
    with Progress(
        "calibrating", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("draws", total=args.draws * len(families))
        results = calibrate(
            args.draws,
            seed=args.seed,
            dtypes=dtypes,
            backend_names=backend_names,
            flex_every=args.flex_every,
            families=tuple(families),
            on_draw=lambda: progress.advance(task),
        )
    print_tables(results, Console())
    if args.out:
        text = render_markdown(results, command=_command_line(args))
        path = Path(args.out)
        document = path.read_text() if path.exists() else ""
        for section in (sketched.SECTION, capabilities.SECTION):  # written by their own runs
            if (kept := section.of(document)) is not None:
                text = section.merged(text, kept)
        _write(path, text)
    if args.json:
        _write(Path(args.json), json.dumps(json_safe(results.to_dict()), indent=2) + "\n")
    return 0 if results.n_false_alarms == 0 and results.detection_goal_met() else 1


def _run_sketched(args: argparse.Namespace) -> int:
    with Progress(
        "sketched study", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True),
    ) as progress:
        task = progress.add_task("draws", total=args.draws)
        dtypes = tuple(d for d in args.dtype or sketched.SKETCHED_DTYPES if d != "fp64")
        results = sketched.calibrate_sketched(args.draws, seed=args.seed, dtypes=dtypes,
                                              on_draw=lambda: progress.advance(task))
    command = f"torchparity calibrate --sketched --draws {args.draws} --seed {args.seed}"
    command += "".join(f" --dtype {d}" for d in args.dtype or [])
    section = sketched.render_section(
        results, command=command + (f" --out {args.out}" if args.out else ""))
    print(section)
    if args.out:
        path = Path(args.out)
        _write(path, sketched.merged(path.read_text() if path.exists() else "", section))
    if args.json:
        _write(Path(args.json), json.dumps(json_safe(results.to_dict()), indent=2) + "\n")
    return 0 if results.false_alarms == 0 else 1


def _run_per_capability(args: argparse.Namespace) -> int:
    offered = machine.capabilities()
    with Progress(
        "per instruction set", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True),
    ) as progress:
        task = progress.add_task("capabilities", total=len(offered))
        rows = capabilities.calibrate_each(_study_arguments(args), offered,
                                           on_done=lambda _: progress.advance(task))
    command = "torchparity calibrate --capabilities " + " ".join(_study_arguments(args))
    section = capabilities.render_section(
        rows, command=command + (f" --out {args.out}" if args.out else ""))
    print(section)
    if args.out:
        path = Path(args.out)
        _write(path, capabilities.SECTION.merged(path.read_text() if path.exists() else "",
                                                 section))
    return 0 if all(row.false_alarms == 0 for row in rows) else 1


def _study_arguments(args: argparse.Namespace) -> list[str]:
    """The arguments that choose the draws and candidates, as the command line gives them."""
    parts = [f"--draws {args.draws}", f"--seed {args.seed}", f"--flex-every {args.flex_every}"]
    parts += [f"--problems {p}" for p in args.problems or []]
    parts += [f"--dtype {d}" for d in args.dtype or []]
    parts += [f"--backend {b}" for b in args.backend or []]
    return " ".join(parts).split()


def _command_line(args: argparse.Namespace) -> str:
    parts = ["torchparity calibrate", *_study_arguments(args)]
    parts += [f"--out {args.out}"] if args.out else []
    return " ".join(parts)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
