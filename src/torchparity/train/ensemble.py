"""The noise band of a recipe: an ensemble of runs that differ from the plain run in rounding alone.

Its members, in the dtype judged: the plain run; ``BAND_REROUNDINGS`` runs whose initial weights
moved by one rounding (every later rounding falls another way, as a refactor's would); on the
CPU, the plain run under every other instruction set it offers (another machine's kernels).
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any, Protocol

import torch

from torchparity import machine, tolerance
from torchparity.errors import UserCodeError
from torchparity.train.trainer import (
    CaseRuns,
    Execution,
    StepDone,
    StepRecord,
    TrainConfig,
    Trajectory,
)
from torchparity.train.trajectory import NoiseBand
from torchparity.train.user_model import ModelRuns


class Runs(Protocol):
    """A recipe the ensemble trains: a user's model's ``ModelRuns`` or a zoo case's ``CaseRuns``."""

    recipe: Any  # has ``steps`` and ``replace(rounding=...)``

    def train(self, execution: Execution, *, perturb_seed: int | None = None,
              rounding: str | None = None, advance: StepDone = ...) -> Trajectory: ...

    def spec(self) -> dict[str, Any]: ...


def members_count(execution: Execution) -> int:
    """How many runs :func:`measure_band` makes under ``execution`` (for progress bars)."""
    return 1 + tolerance.BAND_REROUNDINGS + len(_other_capabilities(execution))


def measure_band(recipe: Runs, execution: Execution, reference: Trajectory, *,
                 advance: StepDone = lambda: None, plain: Trajectory | None = None) -> NoiseBand:
    """Train the ensemble of ``recipe`` and measure its band around ``reference``."""
    runs = [plain or recipe.train(execution, advance=advance)]
    for seed in range(1, tolerance.BAND_REROUNDINGS + 1):
        runs.append(recipe.train(execution, perturb_seed=seed, advance=advance,
                                 rounding=f"weights moved by one rounding, seed {seed}"))
    for capability in _other_capabilities(execution):
        runs.append(_in_capability(recipe, execution, capability))
        for _ in range(recipe.recipe.steps):
            advance()
    return NoiseBand.measure(reference, runs, execution.dtype)


def _other_capabilities(execution: Execution) -> list[str]:
    if torch.device(execution.device).type != "cpu":
        return []
    native = machine.native_capability()
    return [c for c in machine.capabilities() if c != native]


def _in_capability(recipe: Runs, execution: Execution, capability: str) -> Trajectory:
    """The plain run in a process of its own that dispatches ``capability``."""
    code = ("import sys; from torchparity.train.ensemble import member_main; "
            "member_main(sys.argv[1:])")
    argv = [sys.executable, "-c", code, json.dumps(recipe.spec()), execution.backend,
            execution.dtype]
    done = subprocess.run(argv, env=machine.environment(capability), capture_output=True,
                          text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserCodeError(f"the run of {recipe.recipe.case} under {capability} failed: "
                            f"{last}")
    records = [StepRecord(**r) for r in json.loads(done.stdout.strip().splitlines()[-1])]
    label = recipe.recipe.replace(rounding=f"instruction set {capability}")
    return Trajectory(label, Execution(execution.backend, execution.dtype, "cpu"), records,
                      records[0].seconds if records else float("nan"),
                      notes=[f"ATEN_CPU_CAPABILITY={capability}"])


def member_main(argv: list[str]) -> None:
    """A member run in this process (``SPEC BACKEND DTYPE``); prints its records as JSON."""
    import dataclasses

    spec, backend, dtype = json.loads(argv[0]), argv[1], argv[2]
    recipe = (CaseRuns(TrainConfig.from_dict(spec["case"])) if "case" in spec else
              ModelRuns.from_spec(spec))
    run = recipe.train(Execution(backend, dtype))
    print(json.dumps([dataclasses.asdict(r) for r in run.records]))
