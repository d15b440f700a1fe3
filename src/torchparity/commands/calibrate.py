"""``torchparity calibrate``: measure the tolerance model's false-alarm and detection rates.

The study itself lives in :mod:`torchparity.calibration`. Every draw is a random pre-norm
attention block (RMSNorm, q/k/v projections, rotary, attention with a random mask) or a tiny
reference model drawn from the property suite's strategies, computed three ways: the golden
(float64, manual attention), the baseline (manual attention in the candidate dtype) and
candidates. Candidates are every legitimate CPU backend, which must pass (a failure is a false
alarm), and the manual path with one planted bug, which must diverge whenever the bug is visible:
when its effect on the float64 output exceeds the fp32 noise (the fp32 baseline's error).
``--training`` runs the training study instead (:mod:`torchparity.calibration.training`)."""

from __future__ import annotations

import argparse

from torchparity import backends
from torchparity.calibration.problems import CALIBRATED
from torchparity.calibration.runs import (
    Destination,
    StudySettings,
    run_per_capability,
    run_sketched,
    run_study,
    run_training,
)
from torchparity.calibration.study import FAMILIES, cpu_backends
from torchparity.calibration.training import TrainingSettings
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
    parser.add_argument(
        "--training",
        action="store_true",
        help="run the training study instead: the noise band's false alarms over legitimate "
        "refactors and the smallest planted training bug it catches, per seed, horizon and "
        "dtype (fp32, bf16); --out replaces its section of the file",
    )
    parser.add_argument("--seeds", action="append", metavar="[DTYPE=]N",
                        help="--training: seeds per dtype, N for all or DTYPE=N for one "
                        "(repeatable; default 10)")
    parser.add_argument("--horizon", action="append", type=int, metavar="STEPS",
                        help="--training: steps a check is judged over (repeatable; default "
                        "20 and 200)")
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
    if args.training:
        destination = Destination(args.out, args.json, _training_command(args))
        settings = TrainingSettings.parse(args.seeds or [], args.horizon or [], args.dtype or [],
                                          first_seed=args.seed)
        return 0 if run_training(settings, destination) else 1
    if args.sketched:
        return 0 if run_sketched(args.draws, args.seed, args.dtype, args.out, args.json) else 1
    if args.capabilities:
        return 0 if run_per_capability(_study_arguments(args), args.out) else 1
    settings = StudySettings(args.draws, args.seed, dtypes, backend_names, args.flex_every,
                             tuple(families))
    ok = run_study(settings, Destination(args.out, args.json, _command_line(args)))
    return 0 if ok else 1


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


def _training_command(args: argparse.Namespace) -> str:
    parts = ["torchparity calibrate --training", f"--seed {args.seed}"]
    parts += [f"--seeds {s}" for s in args.seeds or []]
    parts += [f"--horizon {h}" for h in args.horizon or []]
    parts += [f"--dtype {d}" for d in args.dtype or []]
    parts += [f"--out {args.out}"] if args.out else []
    return " ".join(parts)
