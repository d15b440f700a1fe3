"""A user's model trained sharded over the ranks and judged by its one-process goldens."""

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
from torchparity.subject.slices import under_torchrun
from torchparity.text import wrapped
from torchparity.train import model_trajectories as mt
from torchparity.train.judged_model import ModelPlan, show_verdict
from torchparity.train.trainer import Execution, Trajectory
from torchparity.train.trajectory import compare_trajectories
from torchparity.train.user_model import UserRecipe, UserTrainer, check_hooks

# Every rank builds the model as check --model --nproc does and trains it by the factory's
# recipe on the step's whole batch; the golden stays one process's: nothing here writes one.


def start_ranks(nproc: int | None, argv: list[str], *, judges: bool) -> int | None:
    """Where ``train --model`` runs: as ``nproc`` ranks, as one rank, or in one process.

    Returns:
        The exit status of the ranks started; None where this process runs the command.

    Raises:
        UsageError: a sharded run that does more than judge (``--check`` only, no ``--base``).
    """
    if (nproc or 1) <= 1 and not under_torchrun():
        return None
    if not judges:
        raise UsageError("a sharded run (--nproc) is judged with --check against the golden "
                         "trajectory and noise band of one process: make them without "
                         "--nproc (--update-golden), and leave out --base")
    return start(nproc, argv)


class ShardedTrainer(UserTrainer):
    """A ``UserTrainer`` of this rank's part of the model whose norms are the whole model's."""

    # a DTensor's norm gathered, a plain slice's squared norm summed over the ranks, a tensor
    # every rank holds whole counted once

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

    Raises:
        TorchParityError: a collective failed, naming where the other ranks are.
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
    """On every rank: read the goldens, train sharded, judge; rank 0 prints and writes JSON."""
    import torch.distributed as dist

    subject = plan.subject
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
