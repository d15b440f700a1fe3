"""``torchparity train``: train a zoo case, log it, and judge its loss trajectory.

    torchparity train --case llama-tiny --steps 20 --backend sdpa --dtype bf16 --check
    torchparity train --case encdec-prenorm --backend sdpa-math --against manual
    torchparity train --case llama-tiny --nproc 2 --check          # DDP under torchrun
    torchparity train --case mqa --parallel tp --nproc 2           # tensor parallel
    torchparity train --case llama-tiny --parallel fsdp+tp --nproc 4   # FSDP2 x TP, 2-D mesh
    torchparity train --case all --update-golden                   # rewrite golden/<case>/

A distributed run (``--nproc`` > 1) is judged twice: against one process training the same
recipe (noise from that run and its reduction-order twin) and against the float64 golden
(baseline: the one-process run). Rank 0 prints the log lines.

Exit status: 0 when the run (and any check) passed, 1 when the trajectory diverged, 2 on bad
arguments or files, or when a rank of a distributed run failed (its message is printed).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from torchparity import backends
from torchparity.commands.common import add_base_arguments, base_side, dtype_name, resolve_device
from torchparity.errors import UsageError
from torchparity.reference import zoo
from torchparity.train.parallel import PARALLELISMS
from torchparity.train.trainer import (
    DTYPE_MODES,
    NORMALIZATIONS,
    Execution,
    TrainConfig,
    Trainer,
)

_DEFAULTS = TrainConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--case", required=True,
                        help=f"zoo case to train ('all' with --update-golden): "
                             f"{', '.join(zoo.names())}")
    parser.add_argument("--steps", type=int, default=_DEFAULTS.steps,
                        help=f"optimizer steps (default {_DEFAULTS.steps})")
    parser.add_argument("--backend", default="manual", choices=backends.names(),
                        help="attention backend (default manual)")
    parser.add_argument("--dtype", default="fp32", type=dtype_name,
                        choices=list(DTYPE_MODES),
                        help="fp64, fp32 (TF32 off), tf32, bf16 or fp16 (autocast with fp32 "
                             "master weights; fp16 with a grad scaler); default fp32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--batch-size", type=int, default=_DEFAULTS.batch_size,
                        help=f"sequences per optimizer step (default {_DEFAULTS.batch_size})")
    parser.add_argument("--accum", type=int, default=1, help="gradient accumulation micro-steps")
    parser.add_argument("--lr", type=float, default=_DEFAULTS.lr,
                        help=f"peak learning rate (default {_DEFAULTS.lr})")
    parser.add_argument("--warmup", type=int, default=_DEFAULTS.warmup_steps,
                        help=f"warm-up steps (default {_DEFAULTS.warmup_steps})")
    parser.add_argument("--clip", type=float, default=_DEFAULTS.clip_norm,
                        help=f"gradient clipping norm, 0 for none (default {_DEFAULTS.clip_norm})")
    parser.add_argument("--normalization", default="tokens", choices=NORMALIZATIONS,
                        help="divide the summed loss by target tokens or sentences")
    parser.add_argument("--task", default=_DEFAULTS.task,
                        help="copy, reverse, sort or mixed (default mixed)")
    parser.add_argument("--seed", type=int, default=0, help="weights and data seed")
    parser.add_argument("--log-every", type=int, default=10, help="log line every N steps")
    parser.add_argument("--nproc", type=int,
                        help="processes under torchrun (gloo on the CPU, nccl on CUDA; default "
                             "1, or 2 with --parallel)")
    parser.add_argument("--parallel", choices=PARALLELISMS,
                        help="how the processes split the work: ddp (default with --nproc), "
                             "fsdp (FSDP2), tp (tensor parallel), fsdp+tp (2-D mesh, tensor "
                             "parallel groups of 2)")
    judge = parser.add_mutually_exclusive_group()
    judge.add_argument("--check", action="store_true",
                       help="judge the trajectory against the float64 golden (stored for the "
                            "default recipe, else trained here) with the manual backend in "
                            "the same dtype as baseline")
    judge.add_argument("--against", metavar="BACKEND", choices=backends.names(),
                       help="judge against a run of BACKEND in the same dtype, calibrated by "
                            "that run and its reduction-order twin")
    parser.add_argument("--diagnose", action="store_true",
                        help="when the trajectory diverges, diagnose the first diverging step "
                             "(with --nproc: name the first module whose output or gradient "
                             "differs from one process)")
    parser.add_argument("--update-golden", action="store_true",
                        help="(re)write golden/<case>/trajectory for the golden recipe")
    parser.add_argument("--golden-dir", help="golden folder (default: golden/ of the source "
                                             "tree, or $TORCHPARITY_GOLDEN_DIR)")
    parser.add_argument("--json", metavar="PATH", help="write trajectory and verdict as JSON")
    add_base_arguments(parser, "with --check, there `torchparity train --update-golden` "
                               "trains the case's golden recipe in float64, and the run here "
                               "is judged against it (REV must be a revision of torchparity's "
                               "source)")


def run(args: argparse.Namespace) -> int:
    from torchparity.train import trajectory as tj

    console = Console()
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise UsageError(f"cannot write --json {args.json}: its folder does not exist")
    side = base_side(args)
    if args.update_golden:
        if side:
            raise UsageError("--base judges a run against the base's golden trajectory; it "
                             "writes none (leave out --update-golden)")
        return _update_golden(args, console)
    if args.case == "all":
        raise UsageError("--case all is only for --update-golden; name one case")
    config, execution = _config(args), _execution(args)
    if side:
        from torchparity.revisions import base_trajectories

        if not args.check or args.golden_dir or config != tj.golden_config(config.case):
            raise UsageError("--base judges the golden recipe (the default --steps, --lr, "
                             "--batch-size, ...) with --check against the base's golden "
                             "trajectory: add --check, and leave out --golden-dir and the "
                             "recipe's options")
        args.golden_dir = str(base_trajectories(side, config.case))
    backends.resolve(execution.backend, execution.device, _probe_dtype(execution))
    if _nproc(args) > 1:
        return _run_parallel(config, execution, args, console)
    candidate = _train(config, execution, args, console)
    console.print(f"{execution.label()}: {candidate.tokens_per_second:,.0f} tok/s, first step "
                  f"after {candidate.time_to_first_step:.2f}s")
    for note in candidate.notes:
        console.print(f"note: {note}")

    comparison = None
    if args.check:
        comparison = tj.check_against_golden(candidate, store=_store(args))
    elif args.against:
        console.print(f"training the same recipe on {args.against}, and its reduction-order "
                      "twin")
        comparison = tj.judge_against(candidate, config, Execution(
            args.against, execution.dtype, execution.device, execution.compile))
    if comparison is not None:
        console.print(comparison.explain(), markup=False, soft_wrap=True)
    report = None
    if comparison is not None and not comparison.ok and args.diagnose:
        step = comparison.first_divergence.step
        reference_execution = Execution(args.against or "manual", execution.dtype,
                                        execution.device)
        console.print(f"diagnosing step {step}: {reference_execution.label()} vs "
                      f"{execution.label()} on the same weights")
        report = tj.diagnose_step(config, reference_execution, execution, step)
        console.print(report.render(), markup=False, soft_wrap=True)
    if args.json:
        _write_json(args.json, candidate, comparison, report)
    return 0 if comparison is None or comparison.ok else 1


def _nproc(args: argparse.Namespace) -> int:
    nproc = args.nproc if args.nproc is not None else (2 if args.parallel else 1)
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1; got {nproc}")
    if nproc == 1 and args.parallel:
        raise UsageError(f"--parallel {args.parallel} needs at least 2 processes; "
                         "use --nproc 2")
    return nproc


def _run_parallel(config: TrainConfig, execution: Execution, args: argparse.Namespace,
                  console: Console) -> int:
    """Train with ``--nproc`` ranks, judge against one process and the golden."""
    from torchparity.train.distributed import (
        check_layout,
        diagnose_parallel_step,
        judge_parallel,
        run_parallel,
    )

    if args.against:
        raise UsageError("--against runs in one process; leave it out with --nproc > 1 (a "
                         "distributed run is judged against one process and the golden)")
    parallelism, nproc = args.parallel or "ddp", _nproc(args)
    check_layout(config, execution, parallelism, nproc)
    console.print(f"training {config.case} with {nproc} processes, {parallelism.upper()} "
                  f"(torchrun); rank 0 logs")
    candidate = run_parallel(config, execution, parallelism=parallelism, nproc=nproc,
                             log=lambda line: console.print(line, markup=False, soft_wrap=True),
                             log_every=args.log_every)
    console.print(f"{candidate.label()}: {candidate.tokens_per_second:,.0f} tok/s, first "
                  f"step after {candidate.time_to_first_step:.2f}s")
    console.print("training the same recipe in one process, and its reduction-order twin")
    judged = judge_parallel(candidate, config, execution, _store(args))
    for against, comparison in judged.items():
        console.print(f"vs {against}: {comparison.budget_share()}", markup=False)
        console.print(comparison.explain(), markup=False, soft_wrap=True)
    parted = [c.first_divergence.step for c in judged.values() if not c.ok]
    location = None
    if parted and args.diagnose:
        console.print(f"diagnosing step {min(parted)}: {nproc} processes vs one, module by "
                      "module")
        location = diagnose_parallel_step(config, execution, parallelism=parallelism,
                                          nproc=nproc, step=min(parted))
        console.print(location.render(), markup=False, soft_wrap=True)
    if args.json:
        data = {"trajectory": candidate.to_dict(),
                "comparison": judged["float64 golden"].to_dict(),
                "single_process_comparison": judged["one process"].to_dict(),
                "diagnosis": None if location is None else vars(location)}
        Path(args.json).write_text(json.dumps(data, indent=2) + "\n")
    return 0 if all(c.ok for c in judged.values()) else 1


def _config(args: argparse.Namespace) -> TrainConfig:
    return TrainConfig(
        case=args.case, steps=args.steps, batch_size=args.batch_size, accum_steps=args.accum,
        lr=args.lr, warmup_steps=args.warmup, clip_norm=args.clip or None,
        normalization=args.normalization, task=args.task, seed=args.seed)


def _execution(args: argparse.Namespace) -> Execution:
    return Execution(args.backend, args.dtype, resolve_device(args.device), args.compile)


def _probe_dtype(execution: Execution) -> torch.dtype:
    mode = execution.mode
    return mode.autocast_dtype or mode.param_dtype


def _train(config: TrainConfig, execution: Execution, args: argparse.Namespace,
           console: Console) -> Any:
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task(f"{config.case} {execution.label()}", total=config.steps)
        def log(line: str) -> None:
            bar.console.print(line, markup=False, soft_wrap=True)

        trainer = Trainer(config, execution, log=log, log_every=args.log_every)
        for step in range(1, config.steps + 1):
            trainer.step(step)
            bar.advance(task)
    return trainer.trajectory()


def _update_golden(args: argparse.Namespace, console: Console) -> int:
    from torchparity.train import trajectory as tj

    cases = zoo.names() if args.case == "all" else [args.case]
    store = _store(args)
    for case in cases:
        for path in tj.write_golden_trajectory(case, store):
            console.print(f"wrote {path}")
    return 0


def _store(args: argparse.Namespace) -> Any:
    from torchparity.train import trajectory as tj

    return tj.golden_store(args.golden_dir)


def _write_json(path: str, candidate: Any, comparison: Any, report: Any) -> None:
    data = {"trajectory": candidate.to_dict(),
            "comparison": comparison.to_dict() if comparison is not None else None,
            "diagnosis": json.loads(report.to_json()) if report is not None else None}
    Path(path).write_text(json.dumps(data, indent=2) + "\n")
