"""``torchparity train``: train a zoo case, log it, and judge its loss trajectory.

    torchparity train --case llama-tiny --steps 20 --backend sdpa --dtype bf16 --check
    torchparity train --case encdec-prenorm --backend sdpa-math --against manual
    torchparity train --case llama-tiny --nproc 2 --check          # DDP under torchrun
    torchparity train --case llama-tiny --parallel fsdp+tp --nproc 4   # FSDP2 x TP, 2-D mesh

A run is judged within a noise band, as a user's model's: ``--check`` against the float64
golden (:mod:`torchparity.train.golden_trajectories`), ``--against`` and ``--nproc`` > 1 against
BACKEND's or one process's run. ``--model ENTRY``: :mod:`torchparity.commands.train_model`.

Exit status: 0 when the run (and any check) passed, 1 when the trajectory diverged, 2 on bad
arguments or files, or when a rank of a distributed run failed (its message is printed).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.console import Console

from torchparity import backends
from torchparity.commands.common import add_base_arguments, base_side, dtype_name, resolve_device
from torchparity.commands.train_model import train_model
from torchparity.errors import UsageError
from torchparity.reference import zoo
from torchparity.train.golden_trajectories import is_stored
from torchparity.train.judged_case import (
    TrainPlan,
    train_and_judge,
    update_golden_trajectories,
)
from torchparity.train.parallel import PARALLELISMS
from torchparity.train.trainer import DTYPE_MODES, NORMALIZATIONS, Execution, TrainConfig

_DEFAULTS = TrainConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--case", help=f"zoo case to train ('all' with --update-golden): "
                                       f"{', '.join(zoo.names())}")
    parser.add_argument("--model", metavar="ENTRY",
                        help="your model's factory, file.py:name or package.module:name, "
                             "trained by its batches, optimizer and train_step "
                             "(docs/training.md)")
    parser.add_argument("--steps", type=int, default=_DEFAULTS.steps,
                        help=f"optimizer steps (default {_DEFAULTS.steps})")
    parser.add_argument("--backend", choices=backends.names(), metavar="NAME",
                        help=f"attention backend: {', '.join(backends.names())} (default "
                             "manual; with --model the model's own attention)")
    parser.add_argument("--dtype", default="fp32", type=dtype_name, choices=list(DTYPE_MODES),
                        help="fp64, fp32 (TF32 off), tf32, bf16 or fp16 (autocast with fp32 "
                             "master weights; fp16 with a grad scaler); default fp32")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    parser.add_argument("--batch-size", type=int, default=_DEFAULTS.batch_size,
                        help=f"sequences per optimizer step (default {_DEFAULTS.batch_size})")
    parser.add_argument("--accum", type=int, default=1, help="micro-steps accumulated (default 1)")
    parser.add_argument("--lr", type=float, default=_DEFAULTS.lr,
                        help=f"peak learning rate (default {_DEFAULTS.lr})")
    parser.add_argument("--warmup", type=int, default=_DEFAULTS.warmup_steps,
                        help=f"warm-up steps (default {_DEFAULTS.warmup_steps})")
    parser.add_argument("--clip", type=float, default=_DEFAULTS.clip_norm,
                        help=f"gradient clipping norm, 0 for none (default {_DEFAULTS.clip_norm})")
    parser.add_argument("--normalization", default="tokens", choices=NORMALIZATIONS,
                        help="divide the loss sum by target tokens or sentences (default tokens)")
    parser.add_argument("--task", default=_DEFAULTS.task,
                        help="copy, reverse, sort or mixed (default mixed)")
    parser.add_argument("--seed", type=int, default=0, help="weights and data seed (default 0)")
    parser.add_argument("--log-every", type=int, default=10, help="log every N steps (default 10)")
    parser.add_argument("--nproc", type=int,
                        help="processes under torchrun (gloo on the CPU, nccl on CUDA; default "
                             "1, or 2 with --parallel)")
    parser.add_argument("--parallel", choices=PARALLELISMS,
                        help="how the processes split the work: ddp (default with --nproc), "
                             "fsdp (FSDP2), tp (tensor parallel), fsdp+tp (2-D mesh, tensor "
                             "parallel groups of 2)")
    judge = parser.add_mutually_exclusive_group()
    judge.add_argument("--check", action="store_true",
                       help="judge the trajectory against the float64 golden and the noise "
                            "band of its dtype (stored for the default recipe in fp32 and "
                            "bf16, else trained here; --model: any dtype's golden, the band "
                            "measured here when none is stored for the dtype and device)")
    judge.add_argument("--against", metavar="BACKEND", choices=backends.names(),
                       help="judge against a run of BACKEND in the same dtype, within the "
                            "noise band of that run's rounding-only ensemble")
    parser.add_argument("--diagnose", action="store_true",
                        help="diagnose the first diverging step (--model: its stage, and "
                             "with --base REV its module and op; --nproc: the first module "
                             "that differs from one process)")
    parser.add_argument("--update-golden", action="store_true", help="(re)write golden/<name>/"
                        "trajectory_<dtype> (--case: fp32, bf16; --model: --dtype): float64, band")
    parser.add_argument("--golden-dir", metavar="DIR", help="golden folder (default: "
                        "$TORCHPARITY_GOLDEN_DIR, else with --model golden/ in the working "
                        "directory, else golden/ of the torchparity source tree)")
    parser.add_argument("--json", metavar="PATH", help="write trajectory and verdict as JSON")
    add_base_arguments(parser, "there `torchparity train --update-golden` makes the golden "
                               "trajectory the run is judged against: of --model (REV of any "
                               "repository), or of --case with --check (REV of torchparity)")


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.json and not Path(args.json).resolve().parent.is_dir():
        raise UsageError(f"cannot write --json {args.json}: its folder does not exist")
    if args.model or not args.case:
        return train_model(args, console)
    side = base_side(args)
    if args.update_golden:
        if side:
            raise UsageError("--base judges a run against the base's golden trajectory; it "
                             "writes none (leave out --update-golden)")
        cases = zoo.names() if args.case == "all" else [args.case]
        update_golden_trajectories(cases, args.golden_dir, console)
        return 0
    if args.case == "all":
        raise UsageError("--case all is only for --update-golden; name one case")
    config = TrainConfig(
        case=args.case, steps=args.steps, batch_size=args.batch_size, accum_steps=args.accum,
        lr=args.lr, warmup_steps=args.warmup, clip_norm=args.clip or None,
        normalization=args.normalization, task=args.task, seed=args.seed)
    execution = Execution(args.backend or "manual", args.dtype, resolve_device(args.device),
                          args.compile)
    golden_dir = args.golden_dir
    if side:
        from torchparity.revisions import base_trajectories

        if not args.check or args.golden_dir or not is_stored(config, execution):
            raise UsageError("--base judges the golden recipe (the default --steps, --lr, "
                             "--batch-size, ...) in fp32 or bf16 on the CPU with --check "
                             "against the base's golden trajectory: add --check, and leave "
                             "out --golden-dir and the recipe's options")
        golden_dir = str(base_trajectories(side, config.case))
    plan = TrainPlan(config, execution, check=args.check, against=args.against,
                     diagnose=args.diagnose,
                     golden_dir=golden_dir, json=args.json, log_every=args.log_every,
                     nproc=_nproc(args), parallel=args.parallel)
    return 0 if train_and_judge(plan, console) else 1


def _nproc(args: argparse.Namespace) -> int:
    nproc = args.nproc if args.nproc is not None else (2 if args.parallel else 1)
    if nproc < 1:
        raise UsageError(f"--nproc must be at least 1; got {nproc}")
    if nproc == 1 and args.parallel:
        raise UsageError(f"--parallel {args.parallel} needs at least 2 processes; "
                         "use --nproc 2")
    return nproc
