"""A user's model's golden trajectory and noise band per dtype and device, and a run judged."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from torchparity.golden.store import Golden, GoldenStale, GoldenStore, checksum
from torchparity.golden.user_models import user_golden_dir
from torchparity.subject.model import Subject
from torchparity.subject.trees import flatten_tensors
from torchparity.train.ensemble import measure_band, members_count
from torchparity.train.golden_trajectories import trajectory_of, trajectory_output, write_trajectory
from torchparity.train.optimizer_groups import OptimizerGroups
from torchparity.train.trainer import OWN_ATTENTION, Execution, StepDone, Trajectory
from torchparity.train.trajectory import NoiseBand, TrajectoryComparison, compare_trajectories
from torchparity.train.user_model import ModelRuns, UserRecipe, check_hooks, train_user_model


def trajectory_store(subject: Subject, root: str | Path | None, execution: Execution, steps: int
                     ) -> GoldenStore:
    """The store under ``root`` whose messages name this model's update command."""
    root = user_golden_dir(root)
    command = f"torchparity train --model {subject.entry} --steps {steps} --update-golden"
    if execution.dtype != "fp32":
        command += f" --dtype {execution.dtype}"
    if torch.device(execution.device).type != "cpu":
        command += f" --device {execution.device}"
    if root.resolve() != user_golden_dir().resolve():
        command += f" --golden-dir {root}"
    return GoldenStore(root, update_command=command)


def reference_execution(execution: Execution) -> Execution:
    """The float64 run of the recipe on the execution's device."""
    # a backend that replaces the model's attention: torchparity's manual one (no fused float64)
    backend = OWN_ATTENTION if execution.backend == OWN_ATTENTION else "manual"
    return Execution(backend, "fp64", execution.device)


def band_output(execution: Execution) -> str:
    """The golden of a band in ``execution``'s dtype on its device."""
    # trajectory_<dtype> on the CPU, trajectory_<dtype>_<device type> elsewhere: a GPU rounds
    # another way; the float64 trajectory is the truth for every dtype and device
    device = torch.device(execution.device).type
    output = trajectory_output(execution.dtype)
    return output if device == "cpu" else f"{output}_{device}"


def write_model_trajectory(subject: Subject, recipe: UserRecipe, execution: Execution,
                           store: GoldenStore, *, advance: StepDone = lambda: None
                           ) -> list[Path]:
    """Train and store the float64 trajectory and the noise band of ``execution``."""
    # nothing is written unless every run trained to the end with finite losses
    check_hooks(subject)
    reference = train_user_model(subject, recipe, reference_execution(execution),
                                 advance=advance)
    band = measure_band(ModelRuns(subject, recipe), execution, reference, advance=advance)
    meta = {"execution": execution.to_dict(),
            "data_checksums": data_checksums(subject, recipe.steps)}
    if reference.optimizer is not None:
        meta["optimizer"] = reference.optimizer.to_dict()
    return write_trajectory(store, subject.name, reference, band, meta,
                            output=band_output(execution))


@dataclass
class ModelGolden:
    """The float64 trajectory a run is judged against, and its band where one is stored."""

    reference: Trajectory
    band: NoiseBand | None
    golden: Golden

    def optimizer_groups(self) -> OptimizerGroups | None:
        """The optimizer's groups the golden run had (None: a golden written without them)."""
        stored = self.golden.summary.get("optimizer")
        return None if stored is None else OptimizerGroups.from_dict(stored)

    def band_origin(self) -> str:
        """Where the golden's band comes from, one sentence."""
        members = len(self.golden.summary.get("members", []))
        execution = self.golden.summary.get("execution", {})
        measured = ""
        if execution:
            measured = (f" of {execution['backend']} {execution['dtype']} "
                        f"{execution['device']}")
        return (f"band: stored with the golden {self.golden.path} ({members} rounding-only "
                f"runs{measured})")


def read_model_golden(subject: Subject, recipe: UserRecipe, execution: Execution,
                      store: GoldenStore) -> ModelGolden:
    """The golden a run under ``execution`` is judged against, cut to ``recipe.steps``.

    Raises:
        GoldenError: no golden of the model; ``GoldenStale`` naming the first step whose batch
            changed; ``UsageError`` for more steps than it holds.
    """
    def fresh(golden: Golden) -> None:
        checksums = golden.summary.get("data_checksums", [])
        for step, (old, new) in enumerate(zip(checksums, data_checksums(subject, recipe.steps),
                                              strict=False), start=1):
            if old != new:
                raise GoldenStale(f"the batch of step {step} is not the one {golden.path} was "
                                  f"made with; if the data changed on purpose, run "
                                  f"`{store.update_command}`")

    output = band_output(execution)
    others = [o for o in store.outputs(subject.name) if o.startswith(trajectory_output(""))]
    stored = output in others
    if not stored and others:  # the float64 trajectory of another golden, fp32 CPU's first
        output = min(others, key=lambda o: (o != trajectory_output("fp32"), o))
    golden = store.read(subject.name, output)
    dtype = output.removeprefix(trajectory_output("")).split("_")[0]
    reference, band = trajectory_of(golden, store, dtype, recipe,
                                    reference_execution(execution), recipe.steps, fresh)
    return ModelGolden(reference, band if stored else None, golden)


def read_model_trajectory(subject: Subject, recipe: UserRecipe, execution: Execution,
                          store: GoldenStore) -> tuple[Trajectory, NoiseBand]:
    """The float64 trajectory and band stored for ``execution``, cut to ``recipe.steps``."""
    # the first steps of a longer golden are a golden of their own: a recipe has no length
    golden = read_model_golden(subject, recipe, execution, store)
    if golden.band is None:
        store.read(subject.name, band_output(execution))  # raises: no such golden
    return golden.reference, golden.band


def measure_model_band(subject: Subject, recipe: UserRecipe, execution: Execution,
                       plain: Trajectory, *, advance: StepDone = lambda: None) -> NoiseBand:
    """The band of ``execution`` measured now, around this code's own float64 run."""
    # a change of the code is then in neither, and the band holds rounding alone
    reference = train_user_model(subject, recipe, reference_execution(execution),
                                 advance=advance)
    return measure_band(ModelRuns(subject, recipe), execution, reference, advance=advance,
                        plain=plain)


def check_model_trajectory(subject: Subject, recipe: UserRecipe, execution: Execution,
                           store: GoldenStore, *, advance: StepDone = lambda: None,
                           say: Callable[[str], None] = lambda line: None,
                           ) -> tuple[Trajectory, TrajectoryComparison]:
    """Train ``subject`` once and judge it against its golden and band (stored or measured)."""
    check_hooks(subject)
    golden = read_model_golden(subject, recipe, execution, store)
    started = time.perf_counter()
    candidate = train_user_model(subject, recipe, execution, advance=advance)
    band = golden.band
    if band is not None:
        origin = golden.band_origin()
    else:
        seconds = time.perf_counter() - started
        runs = members_count(execution)
        where = execution.dtype if torch.device(execution.device).type == "cpu" else \
            f"{execution.dtype} on {execution.device}"
        say(f"no stored band for {where}: measuring one now ({runs} runs, about "
            f"{math.ceil(runs * seconds)} s); `{store.update_command}` stores it")
        band = measure_model_band(subject, recipe, execution, candidate, advance=advance)
        origin = (f"band: measured here, not stored ({len(band.members)} rounding-only runs "
                  f"of {execution.label()} around this code's float64 run); the float64 "
                  f"trajectory judged against: {golden.golden.path}")
    comparison = compare_trajectories(candidate, golden.reference, band,
                                      compute_dtype=execution.dtype)
    comparison.notes.append(origin)
    return candidate, comparison


def data_checksums(subject: Subject, steps: int) -> list[str]:
    """A checksum of the batch of every step 1..``steps`` (floating tensors in float64)."""
    sums = []
    for step in range(1, steps + 1):
        batch = subject.guarded(lambda step=step: subject.batches(step), f"batches({step})")
        sums.append(checksum(flatten_tensors(batch, "batch"), dtype=torch.float64))
    return sums
