"""Golden trajectories: each zoo case's recipe trained in float64, stored with the fp32 run
that sizes its budgets, read back only while recipe, model, weights and corpus are unchanged,
and the verdict of a run against them (compared by :mod:`torchparity.train.trajectory`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from torchparity.golden.store import GoldenStale, GoldenStore, checksum, default_golden_dir
from torchparity.reference import build_model
from torchparity.train.trainer import (
    GOLDEN_EXECUTION,
    QUANTITIES,
    Execution,
    StepRecord,
    TrainConfig,
    Trajectory,
    train,
)
from torchparity.train.trajectory import (
    TrajectoryComparison,
    compare_trajectories,
    reduction_twin,
)

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


def judge_parallel(candidate: Trajectory, config: TrainConfig, execution: Execution,
                   store: GoldenStore) -> dict[str, TrajectoryComparison]:
    """Judge a distributed run twice: against one process training the same recipe (noise from
    that run and its reduction-order twin) and against the float64 golden (baseline: the
    one-process run). Returns ``{"one process": ..., "float64 golden": ...}`` comparisons."""
    single, twin = train(config, execution), train(reduction_twin(config), execution)
    return {"one process": compare_trajectories(candidate, single, (single, twin)),
            "float64 golden": check_against_golden(candidate, baseline=single, store=store)}
