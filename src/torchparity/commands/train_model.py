"""``torchparity train --model ENTRY``: a user's model trained by its factory's recipe.

    torchparity train --model models.py:make --steps 200 --update-golden
    torchparity train --model models.py:make --steps 200 --check --json verdict.json
    torchparity train --model models.py:make --steps 200 --base origin/main
    torchparity train --model models.py:make --steps 200 --check --nproc 2

``--update-golden`` trains the float64 trajectory and the rounding-only ensemble whose spread
is the noise band, and stores both; ``--check`` trains once and judges the run against them,
with ``--nproc N`` sharded over N ranks by the factory (train/sharded_training.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path

from rich.console import Console

from torchparity.commands.common import base_side, resolve_device
from torchparity.errors import UsageError
from torchparity.revisions.base import BaseSide
from torchparity.subject.slices import under_torchrun
from torchparity.train.judged_model import (
    ModelPlan,
    judge_model_training,
    update_model_golden,
)
from torchparity.train.sharded_training import judge_sharded_training, start_ranks
from torchparity.train.trainer import OWN_ATTENTION, Execution, TrainConfig
from torchparity.train.user_model import training_subject

_ZOO = TrainConfig()
#: The zoo's recipe options, which a factory's own recipe replaces, and their defaults.
_ZOO_OPTIONS = {"batch_size": _ZOO.batch_size, "accum": 1, "lr": _ZOO.lr,
                "warmup": _ZOO.warmup_steps, "normalization": "tokens", "task": _ZOO.task,
                "parallel": None, "against": None}


def train_model(args: argparse.Namespace, console: Console) -> int:
    """Exit status of ``train --model``: 0 stored or within, 1 diverged."""
    if bool(args.case) == bool(args.model):
        raise UsageError("give --case NAME (a zoo case) or --model ENTRY (your factory)")
    given = [f"--{name.replace('_', '-')}" for name, default in _ZOO_OPTIONS.items()
             if getattr(args, name) != default]
    if given:
        raise UsageError(f"{', '.join(given)} set the zoo's recipe; a factory's model trains "
                         "by its own batches, optimizer and train_step: leave them out")
    if args.diagnose and (args.update_golden or (args.nproc or 1) > 1 or under_torchrun()):
        raise UsageError("--diagnose drills down a run of one process that leaves its band: "
                         "use it with --check or --base REV, without --update-golden or "
                         "--nproc")
    launched = start_ranks(args.nproc, args._argv,
                           judges=args.check and not (args.update_golden or args.base))
    if launched is not None:
        return launched
    side = base_side(args)
    golden_dir = args.golden_dir
    if side:
        if args.update_golden or args.golden_dir:
            raise UsageError("--base trains the base's golden trajectory and judges the "
                             "working tree against it: leave out --update-golden and "
                             "--golden-dir")
        from torchparity.revisions import base_model_trajectories

        golden_dir = str(base_model_trajectories(side, args.model, args.steps, args.dtype))
    elif args.update_golden == args.check:
        raise UsageError("train --model needs --update-golden (store the golden trajectory "
                         "and noise band), --check (judge against them) or --base REV")
    backend = OWN_ATTENTION if args.backend is None else args.backend
    execution = Execution(backend, args.dtype, resolve_device(args.device))
    plan = ModelPlan(training_subject(args.model), args.steps, execution, golden_dir=golden_dir,
                     json=args.json, diagnose=args.diagnose,
                     base_step=_base_step(side, args.model, execution) if side else None)
    if args.update_golden:
        update_model_golden(plan, console)
        return 0
    judge = judge_sharded_training if under_torchrun() else judge_model_training
    return 0 if judge(plan, console) else 1


def _base_step(side: BaseSide, entry: str, execution: Execution
               ) -> Callable[[int, str | None], Path]:
    """Step ``step`` of the base's model recorded at the base (``ops``: its ops only)."""
    from torchparity.revisions import base_training_step

    where = [execution.backend, execution.dtype, execution.device]
    return lambda step, ops: base_training_step(side, entry, step, where, ops)
