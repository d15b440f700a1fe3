"""A user's model's golden trajectories: its recipe trained in float64, stored with the noise
band of its rounding-only ensemble in the dtype judged, and a run judged against them.

One golden per dtype, ``<name>/trajectory_<dtype>``, written and read as the zoo's trajectory
goldens are (:mod:`torchparity.golden.trajectories`): a float64 series per quantity and ``lr``,
and ``band.<quantity>``, the ensemble's spread per step. The JSON records the steps, the
members and a checksum of every step's batch, so a later read refuses changed data by the step
it changed at. A golden update pays for the ensemble; a check trains one run.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchparity.golden.store import Golden, GoldenStale, GoldenStore, checksum
from torchparity.golden.trajectories import read_trajectory, write_trajectory
from torchparity.golden.user_models import user_golden_dir
from torchparity.subject.model import Subject
from torchparity.subject.trees import flatten_tensors
from torchparity.train.ensemble import measure_band
from torchparity.train.trainer import OWN_ATTENTION, Execution, Trajectory
from torchparity.train.trajectory import NoiseBand, TrajectoryComparison, compare_trajectories
from torchparity.train.user_model import ModelRuns, UserRecipe, check_hooks, train_user_model

Advance = Callable[[], None]


def trajectory_store(subject: Subject, root: Any, execution: Execution, steps: int
                     ) -> GoldenStore:
    """The store under ``root`` (default: :func:`user_golden_dir`) whose messages name the
    update command of this model, dtype and number of steps."""
    root = user_golden_dir(root)
    command = f"torchparity train --model {subject.entry} --steps {steps} --update-golden"
    if execution.dtype != "fp32":
        command += f" --dtype {execution.dtype}"
    if root.resolve() != user_golden_dir().resolve():
        command += f" --golden-dir {root}"
    return GoldenStore(root, update_command=command)


def reference_execution(execution: Execution) -> Execution:
    """The float64 run of the recipe on the execution's device: the model's own attention,
    or, where a backend replaces it, torchparity's manual attention (fused kernels have no
    float64)."""
    backend = OWN_ATTENTION if execution.backend == OWN_ATTENTION else "manual"
    return Execution(backend, "fp64", execution.device)


def write_model_trajectory(subject: Subject, recipe: UserRecipe, execution: Execution,
                           store: GoldenStore, *, advance: Advance = lambda: None
                           ) -> list[Path]:
    """Train ``subject``'s recipe in float64 and its noise ensemble under ``execution``, then
    store both. Nothing is written unless every run trained to the end with finite losses."""
    check_hooks(subject)
    reference = train_user_model(subject, recipe, reference_execution(execution),
                                 advance=advance)
    band = measure_band(ModelRuns(subject, recipe), execution, reference, advance=advance)
    meta = {"execution": execution.to_dict(),
            "data_checksums": data_checksums(subject, recipe.steps)}
    return write_trajectory(store, subject.name, reference, band, meta)


def read_model_trajectory(subject: Subject, recipe: UserRecipe, execution: Execution,
                          store: GoldenStore) -> tuple[Trajectory, NoiseBand]:
    """The float64 trajectory and the noise band stored for ``subject`` in ``execution``'s
    dtype, cut to ``recipe.steps`` (the first steps of a longer golden are a golden of their
    own: a factory's recipe does not know how long it is trained).

    Raises the store's one-line errors and :class:`~torchparity.golden.GoldenStale` naming the
    first step whose batch changed, or a :class:`UsageError` for more steps than it holds.
    """
    def fresh(golden: Golden) -> None:
        checksums = golden.summary.get("data_checksums", [])
        for step, (old, new) in enumerate(zip(checksums, data_checksums(subject, recipe.steps),
                                              strict=False), start=1):
            if old != new:
                raise GoldenStale(f"the batch of step {step} is not the one {golden.path} was "
                                  f"made with; if the data changed on purpose, run "
                                  f"`{store.update_command}`")

    return read_trajectory(store, subject.name, execution.dtype, recipe,
                           reference_execution(execution), recipe.steps, fresh)


def check_model_trajectory(subject: Subject, recipe: UserRecipe, execution: Execution,
                           store: GoldenStore, *, advance: Advance = lambda: None
                           ) -> tuple[Trajectory, TrajectoryComparison]:
    """Train ``subject`` once under ``execution`` and judge it against its golden trajectory
    and noise band (read, and refused when stale, before any training)."""
    check_hooks(subject)
    reference, band = read_model_trajectory(subject, recipe, execution, store)
    candidate = train_user_model(subject, recipe, execution, advance=advance)
    return candidate, compare_trajectories(candidate, reference, band,
                                           compute_dtype=execution.dtype)


def data_checksums(subject: Subject, steps: int) -> list[str]:
    """A checksum of the batch of every step 1..``steps`` (floating tensors in float64)."""
    sums = []
    for step in range(1, steps + 1):
        batch = subject.guarded(lambda step=step: subject.batches(step), f"batches({step})")
        sums.append(checksum(flatten_tensors(batch, "batch"), dtype=torch.float64))
    return sums
