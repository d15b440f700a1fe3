"""The study: legitimate backends must pass (a failure is a false alarm), planted bugs must
diverge whenever their float64 effect exceeds the fp32 noise. Attention blocks
(``.problems``) and the property suite's tiny models (``.models``) are judged as the suite
judges them: against the golden, with the baseline's budget and a rerun's rounding."""

from __future__ import annotations

import math
import os
import platform
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from torchparity import backends, tolerance
from torchparity.calibration.draws import Calibration, baseline_ratio
from torchparity.calibration.models import ModelProblem, draw_model_problems
from torchparity.calibration.problems import (
    BUGS,
    CALIBRATED,
    DETECTION_GOAL,
    GOAL_MULTIPLE,
    MEASURED_KINDS,
    MULTIPLES,
    SIZED_BUG,
    Problem,
    ProblemVariant,
    draw_problem,
)
from torchparity.comparison import Comparison, compare
from torchparity.errors import BackendUnavailable


@dataclass
class FalseAlarmStats:
    """Legitimate backend × dtype × kind: how its error relates to the baseline's."""

    ratios: list[float] = field(default_factory=list)
    headrooms: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)  # the draws, as "family seed"
    unavailable: str | None = None

    def summary(self) -> dict[str, Any]:
        calibration = Calibration(
            "", len(self.headrooms), tuple(self.ratios), tuple(self.headrooms), tuple(self.failures)
        )
        return {
            "draws": len(self.headrooms),
            "failures": self.failures,
            "median_ratio": calibration.quantile(0.5),
            "p99_ratio": calibration.quantile(0.99),
            "max_ratio": calibration.max_ratio,
            "max_headroom": calibration.max_headroom,
            "unavailable": self.unavailable,
        }


@dataclass
class DetectionStats:
    """Planted bug × dtype × kind: how often it is visible and how often it is caught."""

    applicable: int = 0
    above_fp32_noise: int = 0  # the bug's effect on the float64 output exceeds fp32's error
    visible: int = 0  # ... exceeds the fp32 band: the budget a legitimate fp32 result may use
    caught_visible: int = 0  # ... and the candidate diverged
    above_own: int = 0  # the effect exceeds this dtype's own band
    caught_above_own: int = 0
    caught: int = 0  # diverged, visible or not
    missed_seeds: list[str] = field(default_factory=list)  # visible, not caught
    missed_below_own: int = 0  # ... with an effect inside this dtype's own band

    @property
    def goal_met(self) -> bool:
        """At least 99% of the visible draws were caught."""
        return self.caught_visible >= DETECTION_GOAL * self.visible

    def summary(self) -> dict[str, Any]:
        return {
            "applicable": self.applicable,
            "above_fp32_noise": self.above_fp32_noise,
            "visible": self.visible,
            "caught_visible": self.caught_visible,
            "rate_visible": _rate(self.caught_visible, self.visible),
            "above_own_band": self.above_own,
            "caught_above_own_band": self.caught_above_own,
            "rate_above_own_band": _rate(self.caught_above_own, self.above_own),
            "caught": self.caught,
            "missed_seeds": self.missed_seeds,
            "missed_below_own_band": self.missed_below_own,
        }


@dataclass
class CurveStats:
    """Detection against the size of a change's effect, per dtype, kind and family: ``counts[m]``
    is ``[changes, caught]`` of those whose float64 effect is at least ``m`` times the baseline's
    error; ``missed`` the seeds at or above the goal multiple not caught."""

    counts: dict[int, list[int]] = field(default_factory=lambda: {m: [0, 0] for m in MULTIPLES})
    missed: list[str] = field(default_factory=list)

    def rate(self, multiple: int) -> float | None:
        changes, caught = self.counts[multiple]
        return _rate(caught, changes)

    def add(self, multiple: float, caught: bool, draw: str, goal: int) -> None:
        for m in MULTIPLES:
            if multiple >= m:
                self.counts[m][0] += 1
                self.counts[m][1] += caught
        if multiple >= goal and not caught:
            self.missed.append(draw)

    def summary(self) -> dict[str, Any]:
        return {
            "counts": {str(m): {"changes": n, "caught": c} for m, (n, c) in self.counts.items()},
            "missed_at_goal": self.missed,
        }


#: The families of planted changes on the detection curve.
CURVE_FAMILIES = ("all bugs", "sized scale")


@dataclass
class Results:
    """Everything one calibration run measured."""

    draws: int
    seed: int
    dtypes: list[str]
    backends: list[str]
    false_alarms: dict[tuple[str, str, str], FalseAlarmStats]
    detection: dict[tuple[str, str, str], DetectionStats]
    problems: list[tuple[str, str]]  # (family, description) of every draw
    curve: dict[tuple[str, str, str], CurveStats] = field(
        default_factory=lambda: defaultdict(CurveStats)
    )
    flex_every: int = 1
    seconds: float = 0.0

    @property
    def n_false_alarms(self) -> int:
        return sum(len(s.failures) for s in self.false_alarms.values())

    def detection_goal_met(self) -> bool:
        """Whether >= 99% of the fp32 planted changes were caught whose float64 effect is at
        least the kind's goal multiple (8 forward, 16 grad) of the baseline's error."""
        return all(
            (rate := stats.rate(GOAL_MULTIPLE[kind])) is None or rate >= DETECTION_GOAL
            for (dtype, kind, _), stats in self.curve.items()
            if dtype == "fp32"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "draws": self.draws,
            "seed": self.seed,
            "dtypes": self.dtypes,
            "backends": self.backends,
            "seconds": self.seconds,
            "machine": machine(),
            "kinds": {k: vars(t) for k, t in tolerance.KINDS.items()},
            "false_alarms": [
                {"backend": b, "dtype": d, "kind": k, **s.summary()}
                for (b, d, k), s in self.false_alarms.items()
            ],
            "detection": [
                {"bug": b, "dtype": d, "kind": k, **s.summary()}
                for (b, d, k), s in self.detection.items()
            ],
            "detection_curve": [
                {"dtype": d, "kind": k, "changes": f, **s.summary()}
                for (d, k, f), s in self.curve.items()
            ],
            "problems": [f"{family}: {description}" for family, description in self.problems],
        }


#: The families of problems, in the order they are measured.
FAMILIES = ("blocks", "models")

AnyProblem = Problem | ModelProblem


def calibrate(
    draws: int,
    *,
    seed: int = 0,
    dtypes: list[str] | None = None,
    backend_names: list[str] | None = None,
    flex_every: int = 1,
    families: tuple[str, ...] = FAMILIES,
    on_draw: Callable[[], None] | None = None,
) -> Results:
    """Measure ``draws`` problems of each of ``families`` from ``seed`` and return the statistics.

    ``dtypes`` default to :data:`CALIBRATED`, ``backend_names`` to every CPU backend but manual;
    flex (recompiled per CPU call) runs every ``flex_every``-th draw; ``on_draw`` after each."""
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        raise ValueError(f"unknown problem families {unknown}; choose from {FAMILIES}")
    results = Results(
        draws=draws,
        seed=seed,
        dtypes=dtypes or list(CALIBRATED),
        backends=backend_names or cpu_backends(),
        false_alarms=defaultdict(FalseAlarmStats),
        detection=defaultdict(DetectionStats),
        problems=[],
        flex_every=flex_every,
    )
    start = time.perf_counter()
    problems: list[AnyProblem] = []
    if "blocks" in families:
        problems += [draw_problem(draw_seed) for draw_seed in range(seed, seed + draws)]
    if "models" in families:
        problems += draw_model_problems(draws, seed)
    for index, problem in enumerate(problems):
        results.problems.append((problem.family, problem.description))
        _measure(problem, index % draws, results)
        if on_draw is not None:
            on_draw()
    results.seconds = time.perf_counter() - start
    return results


def _label(problem: AnyProblem) -> str:
    return f"{problem.family} {problem.seed}"


def _measure(problem: AnyProblem, index: int, results: Results) -> None:
    golden = problem.run("fp64")
    bugged = {
        name: problem.run("fp64", variant)
        for name, variant in BUGS.items()
        if problem.applies(variant)
    }
    # A float64 baseline is the golden itself: exact, so budgets use the analytic bound.
    baselines = {"fp64": golden, "fp32": problem.run("fp32")}
    fp32_noise = _noise(golden, baselines["fp32"], "fp32")
    for dtype in problem.dtypes(results.dtypes):
        if dtype not in baselines:
            baselines[dtype] = problem.run(dtype)
        baseline = baselines[dtype]
        for backend in results.backends:
            if backend == "flex" and index % results.flex_every:
                continue
            _measure_backend(problem, dtype, backend, golden, baseline, results)
        own_noise = _noise(golden, baseline, dtype)
        for name, bugged64 in bugged.items():
            variant = BUGS[name]
            candidate, reruns = _candidate(problem, dtype, variant, bugged64)
            for kind in MEASURED_KINDS:
                stats = results.detection[(name, dtype, kind)]
                result = compare(candidate[kind], golden[kind], baseline[kind], kind,
                                 reruns=[r[kind] for r in reruns])
                effect = _effects(bugged64[kind], golden[kind], kind)
                _record_detection(stats, result, effect, fp32_noise[kind], own_noise[kind],
                                  problem)
                if dtype != "fp64":  # a float64 baseline is exact: no multiples
                    results.curve[(dtype, kind, CURVE_FAMILIES[0])].add(
                        _multiple(effect, own_noise[kind]), not result.ok, _label(problem),
                        GOAL_MULTIPLE[kind],
                    )
        if dtype != "fp64":
            _measure_sized(problem, dtype, golden, baseline, own_noise, bugged[SIZED_BUG],
                           results)


def _candidate(
    problem: AnyProblem,
    dtype: str,
    variant: ProblemVariant,
    in_fp64: dict[str, dict[str, torch.Tensor]] | None = None,
    *,
    grad: bool = True,
) -> tuple[dict[str, dict[str, torch.Tensor]], list[dict[str, dict[str, torch.Tensor]]]]:
    """A candidate's outputs in ``dtype`` and its rerun one rounding away (none in float64)."""
    if dtype == "fp64" and in_fp64 is not None:
        return in_fp64, []
    candidate = problem.run(dtype, variant, grad=grad)
    if dtype == "fp64":
        return candidate, []
    return candidate, [problem.run(dtype, variant, grad=grad, rerun=True)]


def _measure_sized(
    problem: AnyProblem,
    dtype: str,
    golden: dict[str, dict[str, torch.Tensor]],
    baseline: dict[str, dict[str, torch.Tensor]],
    noise: dict[str, dict[str, Noise]],
    reference_bug: dict[str, dict[str, torch.Tensor]],
    results: Results,
) -> None:
    """Plant the softmax-scale change sized to each of :data:`MULTIPLES`, and record detection by
    the effect each really had."""
    reference = _multiple(_effects(reference_bug["forward"], golden["forward"], "forward"),
                          noise["forward"])
    if reference == 0:  # every row sees one key: the softmax's scale changes nothing
        return
    delta = BUGS[SIZED_BUG].scale_factor - 1
    for target in MULTIPLES:
        variant = ProblemVariant(scale_factor=1 + delta * target / reference)
        bugged64 = problem.run("fp64", variant)
        candidate, reruns = _candidate(problem, dtype, variant)
        for kind in MEASURED_KINDS:
            result = compare(candidate[kind], golden[kind], baseline[kind], kind,
                             reruns=[r[kind] for r in reruns])
            effect = _multiple(_effects(bugged64[kind], golden[kind], kind), noise[kind])
            results.curve[(dtype, kind, CURVE_FAMILIES[1])].add(
                effect, not result.ok, _label(problem), GOAL_MULTIPLE[kind]
            )


def _multiple(effect: dict[str, float], noise: dict[str, Noise]) -> float:
    """A change's effect in multiples of the baseline's error: the largest over the tensors."""
    return max(effect[name] / noise[name].level for name in effect)


def _measure_backend(
    problem: AnyProblem,
    dtype: str,
    backend: str,
    golden: dict[str, dict[str, torch.Tensor]],
    baseline: dict[str, dict[str, torch.Tensor]],
    results: Results,
) -> None:
    # flex has no CPU backward pass: its gradients cannot be measured there.
    grad = backend != "flex" and problem.compares_gradients(backend, dtype)
    try:
        candidate, reruns = _candidate(problem, dtype, ProblemVariant(backend=backend), grad=grad)
    except BackendUnavailable as exc:
        for kind in MEASURED_KINDS:
            results.false_alarms[(backend, dtype, kind)].unavailable = str(exc)
        return
    for kind in MEASURED_KINDS:
        stats = results.false_alarms[(backend, dtype, kind)]
        if kind not in candidate:
            stats.unavailable = (f"{backend} has no backward pass on the CPU" if backend == "flex"
                                 else "the property suite compares these gradients in fp32 only")
            continue
        result = compare(candidate[kind], golden[kind], baseline[kind], kind,
                         reruns=[r[kind] for r in reruns if kind in r])
        ratio = baseline_ratio(result)
        stats.ratios.append(ratio if ratio is not None else _needed_factor(result))
        stats.headrooms.append(result.worst.headroom)
        if not result.ok:
            stats.failures.append(_label(problem))


def _needed_factor(result: Comparison) -> float:
    """For an exact baseline, the largest factor a tensor needed, err / (sqrt(K) * u * scale); the
    budget grants analytic_factor + reorder_factor."""
    return max(
        t.error / (math.sqrt(t.budget.reduction_length) * t.budget.unit_roundoff
                   * (t.budget.group_scale if t.budget.residue else t.budget.scale))
        for t in result.tensors
        if t.budget is not None and t.budget.baseline_error is None
    )


@dataclass(frozen=True)
class Noise:
    """What rounding alone does to one tensor in one dtype: its error and the budget it earns."""

    level: float  # err(baseline, golden), or the analytic budget when the baseline is exact
    budget: float


def _noise(
    golden: dict[str, dict[str, torch.Tensor]],
    baseline: dict[str, dict[str, torch.Tensor]],
    dtype_name: str,
) -> dict[str, dict[str, Noise]]:
    """The noise of ``dtype_name`` per kind and tensor."""
    noise: dict[str, dict[str, Noise]] = {}
    for kind in MEASURED_KINDS:
        metric = tolerance.KINDS[kind].metric
        noise[kind] = {}
        for name, g in golden[kind].items():
            error = tolerance.error(baseline[kind][name], g, metric)
            budget = tolerance.budget(tolerance.Measurement(
                g, baseline_error=error, compute_dtype=dtype_name, kind=kind
            )).value
            noise[kind][name] = Noise(level=error or budget, budget=budget)
    return noise


def _effects(
    bugged: dict[str, torch.Tensor], golden: dict[str, torch.Tensor], kind: str
) -> dict[str, float]:
    metric = tolerance.KINDS[kind].metric
    return {name: tolerance.error(bugged[name], golden[name], metric) for name in golden}


def _record_detection(
    stats: DetectionStats,
    result: Comparison,
    effect: dict[str, float],
    fp32_noise: dict[str, Noise],
    own_noise: dict[str, Noise],
    problem: AnyProblem,
) -> None:
    caught = not result.ok
    visible = any(effect[n] > fp32_noise[n].budget for n in effect)
    above_own = any(effect[n] > own_noise[n].budget for n in effect)
    stats.applicable += 1
    stats.above_fp32_noise += any(effect[n] > fp32_noise[n].level for n in effect)
    stats.caught += caught
    stats.visible += visible
    stats.caught_visible += visible and caught
    stats.above_own += above_own
    stats.caught_above_own += above_own and caught
    if visible and not caught:
        stats.missed_seeds.append(_label(problem))
        stats.missed_below_own += not above_own


def _rate(caught: int, visible: int) -> float | None:
    return caught / visible if visible else None


def cpu_backends() -> list[str]:
    """Every backend that runs on the CPU, except manual: the baseline itself."""
    available = backends.available("cpu", torch.float32)
    return [name for name, reason in available.items() if reason is None and name != "manual"]


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability().lower(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"
