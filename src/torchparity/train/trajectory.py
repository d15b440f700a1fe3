"""Trajectory comparison: do two training runs of one recipe follow the same path?

Per step and per quantity (loss, gradient norm, update norm) the candidate may differ from the
reference by the trajectory budget of :mod:`torchparity.tolerance`:

    |candidate(n) - reference(n)| <= (fudge * noise(n) + floor) * (1 + per_step_growth * (n-1))

``noise(n)`` is the running maximum over steps 1..n of a difference that rounding alone makes:

- three-way (``baseline`` is one run): ``|baseline - reference|``, with the reference the float64
  golden and the baseline the plain manual-attention run in the candidate's dtype and device;
- two-run calibration (``baseline`` is a pair): ``|baseline_1 - baseline_2|``, two runs that
  differ only in reduction order (see :func:`reduction_twin`).

The running maximum is used because rounding differences compound and do not heal: a step at
which the baseline happens to land close to the reference says nothing about the next one.
``n - 1`` (the number of updates before the step) drives the growth, so step 1 is judged like a
single forward and backward pass.
"""

from __future__ import annotations

import contextlib
import copy
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from torchparity import tolerance
from torchparity.golden.store import GoldenStale, GoldenStore, checksum, default_golden_dir
from torchparity.reference import build_model
from torchparity.train.data import token_losses
from torchparity.train.trainer import (
    GOLDEN_EXECUTION,
    QUANTITIES,
    Execution,
    StepRecord,
    TrainConfig,
    Trajectory,
    batch_at,
    model_before,
    train,
)

Verdict = Literal["identical", "within", "diverged"]


@dataclass
class Point:
    """One quantity at one step: values, error, budget and the share of it used."""

    step: int
    quantity: str
    candidate: float
    reference: float
    noise: float
    error: float
    budget: float
    headroom: float  # error / budget (inf for a non-finite fault)
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.headroom <= 1.0


@dataclass
class TrajectoryComparison:
    """The verdict on a candidate trajectory, step by step.

    ``first_divergence`` is the earliest step at which any quantity left its budget (the
    quantity listed first in :data:`~torchparity.train.trainer.QUANTITIES` wins ties), or None.
    """

    candidate: str
    reference: str
    calibration: str
    compute_dtype: str
    points: list[Point]
    identical: bool
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(p.ok for p in self.points)

    @property
    def verdict(self) -> Verdict:
        if not self.ok:
            return "diverged"
        return "identical" if self.identical else "within"

    @property
    def first_divergence(self) -> Point | None:
        return next((p for p in self.points if not p.ok), None)

    @property
    def worst(self) -> Point | None:
        return max(self.points, key=lambda p: p.headroom, default=None)

    @property
    def max_headroom(self) -> float:
        worst = self.worst
        return worst.headroom if worst else 0.0

    def headroom_by_quantity(self) -> dict[str, float]:
        """The largest share of the budget each quantity used over the run."""
        return {q: max((p.headroom for p in self.points if p.quantity == q), default=0.0)
                for q in QUANTITIES}

    def budget_share(self) -> str:
        """``within, 12% of the budget used (loss 3%, grad_norm 12%, update_norm 5%)``."""
        parts = ", ".join(f"{q} {_percent(h)}" for q, h in self.headroom_by_quantity().items())
        return f"{self.verdict}, {_percent(self.max_headroom)} of the budget used ({parts})"

    def explain(self) -> str:
        """One paragraph: verdict, the step and quantity that decided it, error vs budget."""
        head = f"{self.candidate} vs {self.reference} ({self.calibration}, {self.compute_dtype})"
        steps = max((p.step for p in self.points), default=0)
        if self.verdict == "identical":
            return f"identical: {head}: all {steps} steps bit-equal to the baseline."
        point = self.first_divergence or self.worst
        if point is None:
            return f"identical: {head}: no steps to compare."
        detail = (f"{point.quantity} at step {point.step}: candidate {point.candidate:.8g}, "
                  f"reference {point.reference:.8g}, error {point.error:.3g} "
                  f"{'exceeds' if not point.ok else 'is within'} the budget {point.budget:.3g} "
                  f"(rounding noise so far {point.noise:.3g}), using {_share(point.headroom)}")
        if point.note:
            detail += f"; {point.note}"
        if self.ok:
            return f"within: {head}: all {steps} steps within budget; closest: {detail}."
        return (f"diverged: {head}: the runs part at step {point.step}; {detail}. "
                f"Inspect that step with train.diagnose_step(..., step={point.step}).")

    def to_dict(self) -> dict[str, Any]:
        first = self.first_divergence
        return {
            "verdict": self.verdict,
            "ok": self.ok,
            "candidate": self.candidate,
            "reference": self.reference,
            "calibration": self.calibration,
            "compute_dtype": self.compute_dtype,
            "first_divergence": None if first is None else {"step": first.step,
                                                            "quantity": first.quantity},
            "max_headroom": _finite(self.max_headroom),
            "headroom_by_quantity": {q: _finite(h)
                                     for q, h in self.headroom_by_quantity().items()},
            "notes": self.notes,
            "points": [{**vars(p), "headroom": _finite(p.headroom)} for p in self.points],
        }


def _percent(headroom: float) -> str:
    if headroom >= 10:
        return f"{headroom:.3g}x"
    return f"{headroom:.0%}" if headroom >= 0.1 else f"{100 * headroom:.2g}%"


def compare_trajectories(
    candidate: Trajectory,
    reference: Trajectory,
    baseline: Trajectory | tuple[Trajectory, Trajectory],
    *,
    compute_dtype: str | None = None,
) -> TrajectoryComparison:
    """Judge ``candidate`` against ``reference`` step by step (see the module docstring).

    ``baseline`` is one run (three-way rule, ``reference`` being the golden) or a pair of runs
    that differ only in reduction order (two-run calibration). All runs must share the recipe
    and have at least the candidate's number of steps. ``compute_dtype`` (default: the
    candidate's dtype mode) sets the unit roundoff of the floor.

    Guarantees: a candidate bit-equal to the baseline is ``identical``; NaN or inf where the
    reference is finite diverges, except a gradient overflow at a step the baseline skipped too
    (fp16 loss scaling), which is excused and noted.
    """
    pair = isinstance(baseline, tuple)
    runs = [candidate, reference, *(baseline if pair else (baseline,))]
    _check_compatible(runs)
    steps = len(candidate.records)
    dtype = compute_dtype or candidate.execution.mode.compute_dtype
    if pair:
        noise_a, noise_b = baseline
        calibration = f"noise of {noise_a.label()} vs its reduction-order twin"
    else:
        noise_a, noise_b = baseline, reference
        calibration = f"baseline {baseline.label()}"
    series = [run.series() for run in (candidate, reference, noise_a, noise_b)]
    points = []
    for q in QUANTITIES:
        cand, ref, a, b = (s[q][:steps] for s in series)
        envelope = _running_max((a - b).abs().nan_to_num(nan=math.inf))
        points += [_point(q, n, cand[n - 1].item(), ref[n - 1].item(), envelope[n - 1].item(),
                          dtype, _skipped_by_both(candidate, noise_a, n))
                   for n in range(1, steps + 1)]
    points.sort(key=lambda p: (p.step, QUANTITIES.index(p.quantity)))
    identical = not pair and _bit_equal(series[0], series[2], steps)
    return TrajectoryComparison(candidate.label(), reference.label(),
                                calibration, dtype, points, identical, list(candidate.notes))


def reduction_twin(config: TrainConfig) -> TrainConfig:
    """The same recipe with each step's batch split into twice the micro-batches (or, when
    rows do not allow that, merged into one): identical mathematics, a different summation
    order of every gradient. Two runs of a config and its twin measure rounding noise."""
    doubled = config.accum_steps * 2
    if config.batch_size % doubled == 0:
        return config.replace(accum_steps=doubled)
    if config.accum_steps > 1:
        return config.replace(accum_steps=1)
    raise ValueError(f"batch_size={config.batch_size} has no second micro-batch split; "
                     "use an even batch size for two-run calibration")


def judge_against(candidate: Trajectory, config: TrainConfig,
                  reference: Execution) -> TrajectoryComparison:
    """Compare ``candidate`` with the same recipe trained under ``reference`` (another backend,
    say), the noise measured from that run and its :func:`reduction_twin`."""
    baseline, twin = train(config, reference), train(reduction_twin(config), reference)
    return compare_trajectories(candidate, baseline, (baseline, twin))


def _point(quantity: str, step: int, candidate: float, reference: float, noise: float,
           dtype: str, excused: bool) -> Point:
    if excused and quantity != "loss":
        return Point(step, quantity, candidate, reference, noise, 0.0, math.inf, 0.0,
                     "step skipped by fp16 loss scaling in candidate and baseline alike")
    value = torch.tensor(reference, dtype=torch.float64)
    budget = tolerance.budget(value, baseline_error=noise if math.isfinite(noise) else None,
                              compute_dtype=dtype, kind="trajectory", step=step - 1).value
    if not math.isfinite(noise):
        budget = math.inf
    if not math.isfinite(candidate) and math.isfinite(reference):
        return Point(step, quantity, candidate, reference, noise, math.inf, budget, math.inf,
                     f"candidate {quantity} is {candidate} where the reference is finite")
    error = abs(candidate - reference)
    headroom = error / budget if math.isfinite(budget) else 0.0
    return Point(step, quantity, candidate, reference, noise, error, budget, headroom)


def _running_max(x: torch.Tensor) -> torch.Tensor:
    return torch.cummax(x, dim=0).values if x.numel() else x


def _skipped_by_both(candidate: Trajectory, baseline: Trajectory, step: int) -> bool:
    return candidate.records[step - 1].skipped and baseline.records[step - 1].skipped


def _bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], steps: int) -> bool:
    return all(torch.equal(a[q][:steps], b[q][:steps]) for q in QUANTITIES)


def _check_compatible(runs: list[Trajectory]) -> None:
    recipe = runs[0].config
    for run in runs[1:]:
        if run.config.replace(accum_steps=1) != recipe.replace(accum_steps=1):
            raise ValueError(f"trajectories of different recipes cannot be compared: "
                             f"{run.config} vs {recipe}")
        if len(run.records) < len(runs[0].records):
            raise ValueError(f"a reference or baseline run has {len(run.records)} steps, fewer "
                             f"than the candidate's {len(runs[0].records)}")


def _share(headroom: float) -> str:
    if math.isinf(headroom):
        return "all of it (a non-finite value)"
    return f"{headroom:.0%} of it" if headroom < 10 else f"{headroom:.3g} times it"


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else ("nan" if math.isnan(x) else "inf")


# --- golden trajectories --------------------------------------------------------------------

GOLDEN_OUTPUT = "trajectory"
GOLDEN_STEPS = 20
UPDATE_COMMAND = "torchparity train --case {case} --update-golden"
_GOLDEN_SERIES = ("loss", "grad_norm", "update_norm", "lr")
_GOLDEN_COUNTS = ("tokens", "correct", "input_tokens")


def golden_config(case: str) -> TrainConfig:
    """The recipe the shipped golden trajectories are made with: defaults, GOLDEN_STEPS steps."""
    return TrainConfig(case=case, steps=GOLDEN_STEPS)


def golden_store(root: str | Path | None = None) -> GoldenStore:
    return GoldenStore(default_golden_dir(root), update_command=UPDATE_COMMAND)


#: The baseline stored with each golden: it was produced by the code that made the golden, so
#: a later bug in the training code cannot inflate the budget it earns (a baseline trained by
#: the code under test shares that code's bugs with the candidate).
STORED_BASELINE = Execution("manual", "fp32", "cpu")
_BASELINE_PREFIX = "baseline_fp32."


def write_golden_trajectory(case: str, store: GoldenStore | None = None) -> list[Path]:
    """Train ``case``'s golden recipe in float64 on the CPU (manual attention) and store it,
    together with the fp32 CPU manual run of the same recipe as the stored baseline.

    The JSON records the recipe, the model config and version-independent checksums of the
    float64 initial weights and of every step's batch, so a later read can tell a changed
    recipe, init or corpus from a changed model. The fp32 baseline's values depend on the
    machine and torch version; they only size budgets and are never compared with.
    """
    config = golden_config(case)
    tensors = _series_tensors(train(config, GOLDEN_EXECUTION))
    baseline = _series_tensors(train(config, STORED_BASELINE))
    tensors.update({_BASELINE_PREFIX + q: baseline[q] for q in QUANTITIES})
    meta = {**_golden_meta(config), "stored_baseline": STORED_BASELINE.to_dict()}
    return (store or golden_store()).write(case, GOLDEN_OUTPUT, tensors, meta)


def read_golden_trajectory(case: str, store: GoldenStore | None = None) -> Trajectory:
    """The stored golden trajectory of ``case``.

    Raises the golden store's errors (missing, corrupt, foreign schema) and
    :class:`~torchparity.golden.GoldenStale` naming what changed (recipe, model config, initial
    weights or corpus) with the command that regenerates it.
    """
    return _read_golden(case, store)[0]


def read_stored_baseline(case: str, store: GoldenStore | None = None) -> Trajectory:
    """The fp32 CPU manual-attention run stored with ``case``'s golden (see
    :data:`STORED_BASELINE`)."""
    return _read_golden(case, store)[1]


def _read_golden(case: str, store: GoldenStore | None) -> tuple[Trajectory, Trajectory]:
    store = store or golden_store()
    golden = store.read(case, GOLDEN_OUTPUT)
    config = golden_config(case)
    _check_fresh(golden.summary, _golden_meta(config), store.update_command.format(case=case),
                 golden.path)
    t = golden.tensors
    expected = {*_GOLDEN_SERIES, *_GOLDEN_COUNTS, *(_BASELINE_PREFIX + q for q in QUANTITIES)}
    if not expected <= set(t):
        raise GoldenStale(f"{golden.path} lacks {', '.join(sorted(expected - set(t)))}; "
                          f"regenerate it with `{store.update_command.format(case=case)}`")
    counts = [tuple(int(t[c][n]) for c in _GOLDEN_COUNTS) for n in range(len(t["loss"]))]

    def trajectory(prefix: str, execution: Execution, note: str) -> Trajectory:
        records = [StepRecord(n + 1, *(t[prefix + q][n].item() for q in QUANTITIES),
                              t["lr"][n].item(), *counts[n], math.nan)
                   for n in range(len(counts))]
        return Trajectory(config, execution, records, math.nan, notes=[note])

    return (trajectory("", GOLDEN_EXECUTION, f"golden read from {golden.path}"),
            trajectory(_BASELINE_PREFIX, STORED_BASELINE,
                       f"baseline recorded with the golden in {golden.path}"))


def _series_tensors(run: Trajectory) -> dict[str, torch.Tensor]:
    tensors = {name: torch.tensor([getattr(r, name) for r in run.records], dtype=torch.float64)
               for name in _GOLDEN_SERIES}
    tensors.update({name: torch.tensor([getattr(r, name) for r in run.records])
                    for name in _GOLDEN_COUNTS})
    return tensors


def golden_trajectory(config: TrainConfig, store: GoldenStore | None = None) -> Trajectory:
    """The float64 reference trajectory of ``config``: the stored golden when ``config`` is the
    golden recipe, else trained here in float64 on the CPU (a shorter run is not a prefix of
    the golden: the learning-rate schedule spans the run)."""
    if config == golden_config(config.case):
        return read_golden_trajectory(config.case, store)
    return train(config, GOLDEN_EXECUTION)


def check_against_golden(
    candidate: Trajectory, *, golden: Trajectory | None = None,
    baseline: Trajectory | None = None, store: GoldenStore | None = None,
) -> TrajectoryComparison:
    """The three-way verdict on ``candidate``: the float64 golden as reference and, as baseline,
    the plain manual-attention run of the recipe in the candidate's dtype on its device.

    For the golden recipe of a case, the golden is read from the store, and an fp32 CPU
    candidate gets the baseline stored with it, so changes to the training code itself are
    judged against what the old code's rounding earned. Otherwise the golden is trained here in
    float64 and the baseline trained here too: that judges backends, dtypes, devices and
    distribution, but a bug in the training code would be shared by all three runs.
    """
    config, execution = candidate.config, candidate.execution
    stored = config == golden_config(config.case)
    golden = golden if golden is not None else golden_trajectory(config, store)
    plain = Execution("manual", execution.dtype, execution.device)
    if baseline is None and stored and plain == STORED_BASELINE:
        baseline = read_stored_baseline(config.case, store)
    elif baseline is None:
        baseline = candidate if (execution == plain and candidate.world_size == 1) else \
            train(config, plain)
    return compare_trajectories(candidate, golden, baseline)


def _golden_meta(config: TrainConfig) -> dict[str, Any]:
    model = config.model_config
    weights = build_model(model, config.seed, dtype=torch.float64)
    corpus = config.corpus()
    data = {}
    for n in range(1, config.steps + 1):
        batch = corpus.batch(n)
        data.update({f"{n}.{key}": value
                     for key, value in {**batch.inputs, "labels": batch.labels}.items()})
    return {
        "kind": "trajectory",
        "train_config": config.to_dict(),
        "execution": GOLDEN_EXECUTION.to_dict(),
        "model_config": model.to_dict(),
        "weights_checksum": checksum(dict(weights.named_parameters())),
        "data_checksum": checksum(data),
    }


def _check_fresh(summary: dict[str, Any], expected: dict[str, Any], command: str,
                 path: Path) -> None:
    what = {"train_config": "training recipe", "model_config": "model config",
            "weights_checksum": "initial weights", "data_checksum": "training corpus"}
    for key, label in what.items():
        if summary.get(key) != expected[key]:
            raise GoldenStale(f"{path} was made with another {label} than the code has now; "
                              f"if the change is intended, regenerate it with `{command}`")


# --- handing a diverging step to diagnose ---------------------------------------------------

def diagnose_step(config: TrainConfig, reference: Execution, candidate: Execution, step: int,
                  **diagnose_kwargs: Any) -> Any:
    """Run :func:`torchparity.diagnose` on step ``step`` of ``config``.

    Both sides get the same weights, the reference's as they enter the step, and the step's
    global batch with the training loss; A runs under the reference execution's backend and
    dtype mode, B under the candidate's. A module that diverges here is where the step's
    forward or backward pass differs; a clean report points at the optimizer, clipping or
    loss scaling instead. Returns the :class:`~torchparity.diagnosis.report.DiagnosisReport`.
    """
    from torchparity.diagnosis.api import diagnose

    if torch.device(candidate.device) != torch.device(reference.device):
        raise ValueError("diagnose_step compares executions on one device; got "
                         f"{reference.device} and {candidate.device}")
    model_a = model_before(config, reference, step)
    model_b = copy.deepcopy(model_a).to(candidate.device, candidate.mode.param_dtype)
    batch = batch_at(config, step)

    def loss_fn(output: torch.Tensor, inputs: Any) -> torch.Tensor:
        return token_losses(output, batch.labels.to(output.device)).sum() / batch.n_tokens

    return diagnose(model_a, model_b, batch.to(candidate.device).inputs, loss_fn=loss_fn,
                    backends=(_runs_as(reference), _runs_as(candidate)), **diagnose_kwargs)


def _runs_as(execution: Execution) -> Any:
    """A context factory that selects the execution's backend, autocast and TF32 setting."""
    @contextlib.contextmanager
    def select() -> Iterator[None]:
        from torchparity import backends
        from torchparity.train.trainer import deterministic

        mode = execution.mode
        with contextlib.ExitStack() as stack:
            stack.enter_context(backends.use(execution.backend))
            stack.enter_context(deterministic(tf32=mode.tf32))
            if mode.autocast_dtype is not None:
                device_type = torch.device(execution.device).type
                stack.enter_context(torch.autocast(device_type, dtype=mode.autocast_dtype))
            yield
    return select
