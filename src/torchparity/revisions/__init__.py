"""The base side of a pre-merge check: a git revision run in a worktree of its own.

``check --model ENTRY --base REV``, ``diagnose ENTRY --base REV`` and ``train --case CASE
--check --base REV`` compare the working tree with REV:
:mod:`~torchparity.revisions.worktree` checks REV out in a temporary, detached worktree (the
user's checkout, index, stash and branches are never touched),
:mod:`~torchparity.revisions.base` runs ``torchparity golden update --model``, ``torchparity
record`` or ``torchparity train --update-golden`` there in a process of its own, and
:mod:`~torchparity.revisions.cache` keeps what it made, keyed by everything that changes it,
so that the next run against the same base costs only the head side.
"""

from torchparity.revisions.base import (
    BaseSide,
    base_goldens,
    base_model_trajectories,
    base_trace,
    base_training_step,
    base_trajectories,
)

__all__ = ["BaseSide", "base_goldens", "base_model_trajectories", "base_trace",
           "base_training_step", "base_trajectories"]
