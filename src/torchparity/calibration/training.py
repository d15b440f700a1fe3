"""The training study (``calibrate --training``): how far the noise band of a user's model
can be trusted.

The model is the user-style LM of ``calibration.training_models``, drawn per seed. Per dtype
and seed the golden trajectory and band are stored once for the longest horizon, as
``train --model ... --update-golden`` does; each horizon judges a run exactly as ``--check
--steps HORIZON`` does. *False alarms*: each rounding-only refactor is trained once and
judged at every horizon. *Detection*: each scaled bug is planted at :data:`STRENGTHS`,
largest first, until one passes everywhere; per horizon, the smallest strength caught with
every larger one caught too. A run stops once it diverged at every open horizon."""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torchparity.bench.host import load_average, machine_info
from torchparity.calibration.rates import Rate
from torchparity.calibration.training_models import (
    ENTRY,
    ENVIRONMENT,
    REFACTORS,
    SCALED_BUGS,
    UserLM,
)
from torchparity.errors import UsageError, UserCodeError
from torchparity.subject.model import Subject
from torchparity.threads import single_thread
from torchparity.train import model_trajectories as mt
from torchparity.train.trainer import OWN_ATTENTION, Execution, Trajectory
from torchparity.train.trajectory import NoiseBand, compare_trajectories
from torchparity.train.user_model import UserRecipe, UserTrainer

#: The strengths a scaled bug is planted at, largest first: 1, 3e-1, 1e-1, ... 1e-8.
STRENGTHS = (1.0, *(float(f"{m}e-{k}") for k in range(1, 9) for m in (3, 1)))
#: A run still training is judged every this many steps, to stop it once it diverged.
CHECK_EVERY = 10
#: The dtypes a user's model is trained in by the study (autocast bf16 keeps fp32 weights).
TRAINING_DTYPES = ("fp32", "bf16")


@dataclass(frozen=True)
class TrainingSettings:
    """What the study runs.

    Args:
        seeds: per dtype, how many seeds (``first_seed``, ``first_seed + 1``, ...).
        horizons: the numbers of steps each check is judged over.
        first_seed: the first seed of every dtype.
        refactors: the legitimate refactors checked for false alarms.
        bugs: the scaled bugs planted for detection.
        strengths: the strengths planted, largest first.
    """

    seeds: dict[str, int]
    horizons: tuple[int, ...] = (20, 200)
    first_seed: int = 0
    refactors: tuple[str, ...] = tuple(REFACTORS)
    bugs: tuple[str, ...] = tuple(SCALED_BUGS)
    strengths: tuple[float, ...] = STRENGTHS

    @classmethod
    def parse(cls, seeds: list[str], horizons: list[int], dtypes: list[str], *,
              first_seed: int = 0) -> TrainingSettings:
        """The settings the command's options give (``seeds`` as ``N`` or ``DTYPE=N``, default
        10; ``horizons`` 20 and 200); a one-line :class:`UsageError` for a bad one."""
        dtypes = dtypes or list(TRAINING_DTYPES)
        if unknown := [d for d in dtypes if d not in TRAINING_DTYPES]:
            raise UsageError(f"--training trains in {' or '.join(TRAINING_DTYPES)}, not "
                             f"{', '.join(unknown)}")
        counts = dict.fromkeys(dtypes, 10)
        for given in seeds:
            dtype, _, count = given.rpartition("=")
            if not count.isdigit() or int(count) < 1 or dtype not in ("", *dtypes):
                raise UsageError(f"--seeds {given}: give N or DTYPE=N, N at least 1 and DTYPE "
                                 f"one of {', '.join(dtypes)}")
            counts.update(dict.fromkeys([dtype] if dtype else dtypes, int(count)))
        steps = tuple(sorted(set(horizons or (20, 200))))
        if steps[0] < 1:
            raise UsageError(f"--horizon must be at least 1 step, got {steps[0]}")
        return cls(counts, steps, first_seed)

    def seed_range(self, dtype: str) -> range:
        return range(self.first_seed, self.first_seed + self.seeds[dtype])

    @property
    def steps(self) -> int:
        """The steps every golden is trained for: the longest horizon."""
        return max(self.horizons)


@dataclass(frozen=True)
class JudgedRun:
    """One run of a variant (a bug at ``eps``; None: a refactor) judged over ``horizon`` steps."""

    dtype: str
    seed: int
    variant: str
    eps: float | None
    horizon: int
    diverged: bool
    headroom: float  # the largest share of the budget used over the steps trained
    first_step: int | None  # where it first diverged
    first_quantity: str | None
    steps_trained: int


@dataclass
class TrainingResults:
    """Every verdict of a study, and what it ran on."""

    settings: TrainingSettings
    verdicts: list[JudgedRun] = field(default_factory=list)
    seconds: float = 0.0
    machine: dict[str, Any] = field(default_factory=dict)

    def false_alarms(self, dtype: str, horizon: int, refactor: str | None = None) -> Rate:
        """Refactors' checks at ``horizon`` in ``dtype`` that diverged, of those made."""
        checks = [v for v in self._refactor_checks(dtype, horizon)
                  if refactor in (None, v.variant)]
        return Rate(sum(v.diverged for v in checks), len(checks))

    def largest_share(self, dtype: str, horizon: int, refactor: str | None = None) -> float:
        """The largest share of its budget a refactor's check used (1: at the edge)."""
        return max((v.headroom for v in self._refactor_checks(dtype, horizon)
                    if refactor in (None, v.variant)), default=0.0)

    def thresholds(self, bug: str, dtype: str, horizon: int) -> list[float | None]:
        """Per seed, the smallest strength of ``bug`` caught at ``horizon`` with every larger one
        caught too; None where the largest was missed."""
        return [_threshold([v for v in self.verdicts if v.variant == bug and v.eps is not None
                            and v.dtype == dtype and v.seed == seed and v.horizon == horizon])
                for seed in self.settings.seed_range(dtype)]

    def _refactor_checks(self, dtype: str, horizon: int) -> list[JudgedRun]:
        return [v for v in self.verdicts
                if v.eps is None and v.dtype == dtype and v.horizon == horizon]

    def to_dict(self) -> dict[str, Any]:
        """Everything, as ``--json`` writes it."""
        return {"settings": asdict(self.settings), "seconds": self.seconds,
                "machine": self.machine, "verdicts": [asdict(v) for v in self.verdicts]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainingResults:
        """The results :meth:`to_dict` wrote (``--json``), to render them again."""
        settings = {k: tuple(v) if isinstance(v, list) else v
                    for k, v in data["settings"].items()}
        verdicts = [JudgedRun(**{**v, "headroom": float(v["headroom"])})
                    for v in data["verdicts"]]
        return cls(TrainingSettings(**settings), verdicts, data["seconds"], data["machine"])


def study_training(settings: TrainingSettings,
                   on_seed: Callable[[str], None] = lambda label: None) -> TrainingResults:
    """Run the study; ``on_seed(label)`` after each seed and dtype. Returns every verdict,
    the seconds taken, and the machine with its load at start and end."""
    started = time.perf_counter()
    results = TrainingResults(settings, machine={**machine_info("cpu", threads=1),
                                                 "niceness": os.nice(0)})
    with tempfile.TemporaryDirectory() as root:
        for dtype, seed in ((d, s) for d in settings.seeds for s in settings.seed_range(d)):
            execution = Execution(OWN_ATTENTION, dtype)
            golden = _golden(UserLM(seed), execution, settings, Path(root) / f"{dtype}-{seed}")
            for refactor in settings.refactors:
                results.verdicts += _judged(UserLM(seed, refactor), execution, golden, None)
            for bug in settings.bugs:
                results.verdicts += _searched(bug, seed, execution, golden, settings.strengths)
            on_seed(f"{dtype} seed {seed}")
    results.machine["load_average_end"] = load_average()
    results.seconds = time.perf_counter() - started
    return results


#: Per horizon, the golden's float64 trajectory and noise band cut to its steps.
ByHorizon = dict[int, tuple[Trajectory, NoiseBand]]


def _golden(original: UserLM, execution: Execution, settings: TrainingSettings,
            root: Path) -> ByHorizon:
    """Store ``original``'s golden and band for the longest horizon; read back per horizon."""
    with _selected(original):
        subject = Subject.load(ENTRY)
        store = mt.trajectory_store(subject, root, execution, settings.steps)
        mt.write_model_trajectory(subject, UserRecipe(ENTRY, settings.steps), execution, store)
        return {h: mt.read_model_trajectory(subject, UserRecipe(ENTRY, h), execution, store)
                for h in settings.horizons}


def _searched(bug: str, seed: int, execution: Execution, golden: ByHorizon,
              strengths: tuple[float, ...]) -> list[JudgedRun]:
    """``bug`` planted at each strength, largest first, until one passes at every horizon."""
    verdicts: list[JudgedRun] = []
    for eps in strengths:
        judged = _judged(UserLM(seed, bug, eps), execution, golden, eps)
        verdicts += judged
        if not any(v.diverged for v in judged):
            break
    return verdicts


def _judged(lm: UserLM, execution: Execution, golden: ByHorizon,
            eps: float | None) -> list[JudgedRun]:
    """Train ``lm`` and judge it at every horizon of ``golden`` (see the module docstring)."""
    with _selected(lm):
        subject = Subject.load(ENTRY)
    steps = max(golden)
    open_horizons = sorted(golden)
    verdicts = []

    def verdict(horizon: int, run: Trajectory, diverged: bool, headroom: float,
                first: tuple[int, str] | None) -> JudgedRun:
        return JudgedRun(execution.dtype, lm.seed, lm.variant, eps, horizon, diverged, headroom,
                       *(first or (None, None)), len(run.records))

    with single_thread():  # as a check trains: one thread on the CPU
        trainer = UserTrainer(subject, UserRecipe(ENTRY, steps), execution)
        for step in range(1, steps + 1):
            try:
                trainer.step(step)
            except UserCodeError:  # a loss that is not finite: the check stops there too
                run = trainer.trajectory()
                verdicts += [verdict(h, run, True, float("inf"), (step, "loss"))
                             for h in open_horizons]
                break
            if step % CHECK_EVERY and step not in golden:
                continue
            run = trainer.trajectory()
            for horizon in list(open_horizons):
                comparison = compare_trajectories(run, *golden[horizon],
                                                  compute_dtype=execution.dtype)
                if horizon == step or not comparison.ok:
                    first = comparison.first_divergence
                    verdicts.append(verdict(horizon, run, not comparison.ok,
                                            comparison.max_headroom,
                                            first and (first.step, first.quantity)))
                    open_horizons.remove(horizon)
            if not open_horizons:
                break
    return sorted(verdicts, key=lambda v: v.horizon)


@contextlib.contextmanager
def _selected(lm: UserLM) -> Iterator[None]:
    """:data:`ENVIRONMENT` names ``lm`` inside the block, here and in processes started there."""
    before = os.environ.get(ENVIRONMENT)
    os.environ[ENVIRONMENT] = lm.spec()
    try:
        yield
    finally:
        if before is None:
            del os.environ[ENVIRONMENT]
        else:
            os.environ[ENVIRONMENT] = before


def _threshold(verdicts: list[JudgedRun]) -> float | None:
    """The smallest strength caught with every larger one caught (None: the largest missed)."""
    caught = None
    for v in sorted(verdicts, key=lambda v: -v.eps):
        if not v.diverged:
            break
        caught = v.eps
    return caught
