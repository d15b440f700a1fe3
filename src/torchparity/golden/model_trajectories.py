"""A user's model's golden trajectories: its recipe trained in float64, stored with the noise
band of its rounding-only ensemble in the dtype judged, and a run judged against them.

One golden per dtype, ``<name>/trajectory_<dtype>``, in the format of the zoo's trajectory
goldens (:mod:`torchparity.golden.trajectories`): a float64 series per quantity and ``lr``,
and ``band.<quantity>``, the ensemble's spread per step. The JSON records the steps, the
members and a checksum of every step's batch, so a later read refuses changed data by the step
it changed at. A golden update pays for the ensemble; a check trains one run.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchparity.errors import UsageError
from torchparity.golden.store import GoldenStale, GoldenStore, checksum
from torchparity.golden.user_models import user_golden_dir
from torchparity.subject.model import Subject
from torchparity.subject.trees import flatten_tensors
from torchparity.train.ensemble import measure_band
from torchparity.train.trainer import OWN_ATTENTION, Execution, StepRecord, Trajectory
from torchparity.train.trajectory import NoiseBand, TrajectoryComparison, compare_trajectories
from torchparity.train.user_model import UserRecipe, check_hooks, train_user_model

Advance = Callable[[], None]
_BAND = "band."


def output_name(dtype: str) -> str:
    return f"trajectory_{dtype}"


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
    band = measure_band(subject, recipe, execution, reference, advance=advance)
    tensors = {q: v for q, v in reference.series().items()}
    tensors["lr"] = torch.tensor([r.lr for r in reference.records], dtype=torch.float64)
    tensors.update({_BAND + q: v for q, v in band.spread.items()})
    meta = {"kind": "trajectory", "steps": recipe.steps, "execution": execution.to_dict(),
            "members": band.members, "data_checksums": data_checksums(subject, recipe.steps)}
    return store.write(subject.name, output_name(execution.dtype), tensors, meta)


def read_model_trajectory(subject: Subject, recipe: UserRecipe, execution: Execution,
                          store: GoldenStore) -> tuple[Trajectory, NoiseBand]:
    """The float64 trajectory and the noise band stored for ``subject`` in ``execution``'s
    dtype, cut to ``recipe.steps`` (the first steps of a longer golden are a golden of their
    own: a factory's recipe does not know how long it is trained).

    Raises the store's one-line errors and :class:`~torchparity.golden.GoldenStale` naming the
    first step whose batch changed, or a :class:`UsageError` for more steps than it holds.
    """
    golden = store.read(subject.name, output_name(execution.dtype))
    stored = golden.summary.get("steps", 0)
    if recipe.steps > stored:
        raise UsageError(f"{golden.path} holds {stored} steps, fewer than --steps "
                         f"{recipe.steps}; run `{store.update_command}` for more")
    checksums = golden.summary.get("data_checksums", [])
    for step, (old, new) in enumerate(zip(checksums, data_checksums(subject, recipe.steps),
                                          strict=False), start=1):
        if old != new:
            raise GoldenStale(f"the batch of step {step} is not the one {golden.path} was "
                              f"made with; if the data changed on purpose, run "
                              f"`{store.update_command}`")
    t, n = golden.tensors, recipe.steps
    quantities = [q for q in t if q != "lr" and not q.startswith(_BAND)]
    groups = [q for q in quantities if "[" in q]
    records = [StepRecord(i + 1, t["loss"][i].item(), t["grad_norm"][i].item(),
                          t["update_norm"][i].item(), t["lr"][i].item(), 0, 0, 0, math.nan,
                          groups={q: t[q][i].item() for q in groups})
               for i in range(n)]
    reference = Trajectory(recipe, reference_execution(execution), records, math.nan,
                           notes=[f"golden read from {golden.path}"])
    band = NoiseBand({q: t[_BAND + q][:n] for q in quantities},
                     list(golden.summary.get("members", [])), execution.dtype)
    return reference, band


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
