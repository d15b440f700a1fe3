"""``torchparity bench``: backend throughput and start-up, and the cost of the safety net."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from rich.console import Console

from torchparity.bench import report as bench_report
from torchparity.bench.model_runs import PartProgressBar, bench_models
from torchparity.bench.runner import run_bench
from torchparity.bench.settings import DTYPE_CHOICES, PARTS, REFERENCE_CASES, default_settings
from torchparity.commands.common import dtype_name
from torchparity.errors import UsageError


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
        if args.json and not Path(args.json).resolve().parent.is_dir():
            raise UsageError(f"cannot write {args.json}: its directory does not exist")
        result = bench_models(args.model, args.dtype or ["fp32"], device, rounds=args.rounds,
                              threads=args.threads, compile=args.compile,
                              backend=args.backend, skip=set(args.skip))
        if args.json:
            Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        return 0
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
    with PartProgressBar(Console(stderr=True)) as progress:
        result = run_bench(settings, progress)
    bench_report.print_bench_tables(result, console)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        Path(args.markdown).write_text(bench_report.to_markdown(result))
    return 0
