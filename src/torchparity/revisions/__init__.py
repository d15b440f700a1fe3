"""The base side of a pre-merge check (``--base REV``): a git revision run in a worktree of its own.

:mod:`~torchparity.revisions.worktree` checks REV out without touching the user's checkout,
:mod:`~torchparity.revisions.base` runs the command there in a process of its own, and
:mod:`~torchparity.revisions.cache` keeps what it made, so the next run costs only the head side.
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
