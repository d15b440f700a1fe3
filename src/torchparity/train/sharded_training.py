"""A user's model trained sharded over the ranks of ``torchrun`` and judged against its
one-process golden trajectory and noise band: ``torchparity train --model ENTRY --nproc N
--check``.

The command starts itself again as N ranks (:func:`start_ranks`, through
:func:`torchparity.distributed.ranks.start`); inside a user's own ``torchrun ... -m torchparity
train --model ...`` it finds itself a rank and runs as one. Every rank builds the model as
``check --model --nproc`` does (:func:`torchparity.distributed.sharding.placed`): sharded by
the factory's plan over its mesh, or the model the factory sharded itself (DTensors, FSDP2, or
plain slices by hand). Each rank then trains it by the factory's recipe (every rank gets the
step's whole batch: a data-parallel ``train_step`` takes its rank's rows and returns the whole
batch's loss). The quantities recorded are the whole model's (:class:`ShardedTrainer`), so the
golden, trained in one process in float64, judges them as it judges one process's run; rank 0
prints the verdict and writes the JSON. The golden stays one process's: nothing here writes
one.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from rich.console import Console

from torchparity.distributed import group, sharding
from torchparity.distributed.ranks import collectively, start
from torchparity.errors import UsageError
from torchparity.subject.model import Subject
from torchparity.subject.running import is_dtensor
from torchparity.text import wrapped
from torchparity.train import model_trajectories as mt
from torchparity.train.judged_model import ModelPlan, show_verdict
from torchparity.train.trainer import Execution, Trajectory
from torchparity.train.trajectory import compare_trajectories
from torchparity.train.user_model import UserRecipe, UserTrainer, check_hooks, training_subject


def start_ranks(nproc: int | None, argv: list[str], *, judges: bool) -> int | None:
    """Where ``train --model`` runs.

    Args:
        nproc: the ``--nproc`` given (None: not given).
        argv: the command line, started again under torchrun.
        judges: whether the command only judges a run (``--check``, no golden made, no
            ``--base``): all a sharded run may do.

    Returns:
        With ``nproc`` > 1, the exit status of ``torchparity argv`` run as ``nproc`` ranks
        (a rank that fails ends it in one line); under torchrun None, this process joined as
        one rank; else None: one process.

    Raises:
        UsageError: in one line, for a sharded run that does not only judge: the golden
            trajectory and noise band are one process's float64 run.
    """
    if (nproc or 1) <= 1 and not group.under_torchrun():
        return None
    if not judges:
        raise UsageError("a sharded run (--nproc) is judged with --check against the golden "
                         "trajectory and noise band of one process: make them without "
                         "--nproc (--update-golden), and leave out --base")
    return start(nproc, argv)


class ShardedTrainer(UserTrainer):
    """A :class:`UserTrainer` of this rank's part of the model, sharded as the factory says,
    whose gradient and update norms are the whole model's: a DTensor's norm gathered
    (``full_tensor``), a plain slice's squared norm summed over the ranks, and a tensor every
    rank holds whole counted once, as this rank holds it."""

    def _build_model(self) -> torch.nn.Module:
        model, _ = sharding.placed(self.subject, self.device, self.mode.param_dtype)
        held = self.subject.slices
        self._sliced = {id(p) for name, p in model.named_parameters()
                        if held is not None and held.of(name) is not None}
        return model.train()

    def _group_norm(self, group: list[torch.Tensor], norms: list[torch.Tensor | None]) -> float:
        import torch.distributed as dist

        whole = 0.0
        sliced = torch.zeros((), dtype=torch.float64, device=self.device)
        for param, norm in zip(group, norms, strict=True):
            if norm is None:
                continue
            if is_dtensor(norm):  # in the order of the group: every rank gathers alike
                whole += sharding.whole(norm).item() ** 2
            elif id(param) in self._sliced:
                sliced += norm.to(torch.float64) ** 2
            else:
                whole += float(norm) ** 2
        if self.subject.slices is not None:
            dist.all_reduce(sliced)
        return math.sqrt(whole + sliced.item())


def train_sharded(subject: Subject, recipe: UserRecipe, execution: Execution) -> Trajectory:
    """``subject`` trained by its recipe on every rank, sharded as its factory says.

    Args:
        subject: the factory's subject, loaded on this rank.
        recipe: how many steps, by the factory's recipe.
        execution: the dtype, device and attention of the run.

    Returns:
        This rank's record of the whole model's trajectory.

    Raises:
        TorchParityError: in one line, when a collective fails (a rank that died or did not
            come), naming where the other ranks are (``step N``).
    """
    def run() -> Trajectory:
        trainer = ShardedTrainer(subject, recipe, execution)
        for step in range(1, recipe.steps + 1):
            group.mark(f"step {step}")
            trainer.step(step)
        return trainer.trajectory()

    try:
        trajectory = collectively("the sharded training run", run)
    except BaseException:
        group.abandon()  # this rank may have failed alone: torchrun then stops the others
        raise
    trajectory.notes.append(f"trained sharded over {group.world_size()} ranks")
    return trajectory


def judge_sharded_training(plan: ModelPlan, console: Console) -> bool:
    """On every rank: read the golden trajectory and band (a missing or stale one refused
    before any training), train sharded, judge; rank 0 prints the verdict and writes
    ``plan.json``.

    Args:
        plan: the entry, steps, execution, golden folder and JSON file of the check.
        console: where rank 0 prints (the other ranks' output is silenced).

    Returns:
        Whether rank 0's run is within the band, on every rank.
    """
    import torch.distributed as dist

    subject = training_subject(plan.entry)
    check_hooks(subject)
    store = mt.trajectory_store(subject, plan.golden_dir, plan.execution, plan.steps)
    recipe = UserRecipe(subject.entry, plan.steps)
    reference, band = mt.read_model_trajectory(subject, recipe, plan.execution, store)
    ranks = group.world_size()
    console.print(wrapped(f"training {subject.name} {plan.steps} steps in "
                          f"{plan.execution.dtype}, sharded over {ranks} ranks, judged by "
                          "the one-process golden trajectory and noise band"), markup=False)
    candidate = train_sharded(subject, recipe, plan.execution)
    comparison = compare_trajectories(candidate, reference, band,
                                      compute_dtype=plan.execution.dtype)
    if group.rank() == 0:
        console.print(f"{subject.name} {plan.execution.label()} on {ranks} ranks: "
                      f"{plan.steps} steps", markup=False)
        show_verdict(comparison, console)
        if plan.json:
            data = {"ranks": ranks, "trajectory": candidate.to_dict(),
                    "comparison": comparison.to_dict()}
            Path(plan.json).write_text(json.dumps(data, indent=2) + "\n")
    verdict = [comparison.ok]
    dist.broadcast_object_list(verdict, src=0)  # every rank exits with rank 0's verdict
    return bool(verdict[0])
