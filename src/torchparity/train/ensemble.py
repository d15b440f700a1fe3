"""The noise band of a user's model: an ensemble of runs that differ from the plain run only in
rounding, and their spread from the float64 trajectory at every step.

The members, all in the dtype judged:

- the plain run;
- :data:`~torchparity.tolerance.BAND_REROUNDINGS` runs whose initial weights moved by one
  rounding of their dtype (:func:`~torchparity.subject.rounding.perturb_weights`): every
  later rounding of the run falls another way, as a refactor's would;
- on the CPU, the plain run under every other instruction set the CPU offers
  (``ATEN_CPU_CAPABILITY``, a process each): the kernels' own reduction orders, as another
  machine has them.

:class:`~torchparity.train.trajectory.NoiseBand` keeps the spread; the judge pools it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable

import torch

from torchparity import machine, tolerance
from torchparity.errors import UsageError, UserCodeError
from torchparity.subject.model import Subject
from torchparity.train.trainer import Execution, StepRecord, Trajectory
from torchparity.train.trajectory import NoiseBand
from torchparity.train.user_model import UserRecipe, train_user_model

Advance = Callable[[], None]


def members_count(execution: Execution) -> int:
    """How many runs :func:`measure_band` makes under ``execution`` (for progress bars)."""
    return 1 + tolerance.BAND_REROUNDINGS + len(_other_capabilities(execution))


def measure_band(subject: Subject, recipe: UserRecipe, execution: Execution,
                 reference: Trajectory, *, advance: Advance = lambda: None,
                 plain: Trajectory | None = None) -> NoiseBand:
    """Train the ensemble of ``subject`` under ``execution`` and measure its band around
    ``reference`` (the float64 trajectory of the recipe). ``plain`` is the plain run when
    the caller trained it already. ``advance()`` is called after every step of every run.
    """
    runs = [plain or train_user_model(subject, recipe, execution, advance=advance)]
    for seed in range(1, tolerance.BAND_REROUNDINGS + 1):
        member = recipe.replace(rounding=f"weights moved by one rounding, seed {seed}")
        runs.append(train_user_model(subject, member, execution, perturb_seed=seed,
                                     advance=advance))
    for capability in _other_capabilities(execution):
        runs.append(_in_capability(subject, recipe, execution, capability))
        for _ in range(recipe.steps):
            advance()
    return NoiseBand.measure(reference, runs, execution.dtype)


def _other_capabilities(execution: Execution) -> list[str]:
    if torch.device(execution.device).type != "cpu":
        return []
    native = machine.native_capability()
    return [c for c in machine.capabilities() if c != native]


def _in_capability(subject: Subject, recipe: UserRecipe, execution: Execution,
                   capability: str) -> Trajectory:
    """The plain run in a process of its own that dispatches ``capability``."""
    if ":" not in subject.entry or subject.entry.startswith("<"):
        raise UsageError(f"the noise band reruns {subject.entry} under another instruction "
                         "set in a process of its own: load it from an entry file.py:name")
    code = ("import sys; from torchparity.train.ensemble import member_main; "
            "member_main(sys.argv[1:])")
    argv = [sys.executable, "-c", code, subject.entry, str(recipe.steps), execution.backend,
            execution.dtype]
    done = subprocess.run(argv, env=machine.environment(capability), capture_output=True,
                          text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise UserCodeError(f"the run of {subject.entry} under {capability} failed: {last}")
    records = [StepRecord(**r) for r in json.loads(done.stdout.strip().splitlines()[-1])]
    label = recipe.replace(rounding=f"instruction set {capability}")
    return Trajectory(label, Execution(execution.backend, execution.dtype, "cpu"), records,
                      records[0].seconds if records else float("nan"),
                      notes=[f"ATEN_CPU_CAPABILITY={capability}"])


def member_main(argv: list[str]) -> None:
    """A member run in this process: ``ENTRY STEPS BACKEND DTYPE``; prints its records as one
    JSON line (what :func:`_in_capability` reads)."""
    import dataclasses

    entry, steps, backend, dtype = argv
    subject = Subject.load(entry)
    run = train_user_model(subject, UserRecipe(entry, int(steps)), Execution(backend, dtype))
    print(json.dumps([dataclasses.asdict(r) for r in run.records]))
