"""Golden trajectories, one format for a zoo case and a user's model; a zoo case's goldens."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from torchparity.errors import UsageError
from torchparity.golden.store import Golden, GoldenStale, GoldenStore, checksum, default_golden_dir
from torchparity.reference import build_model
from torchparity.train.ensemble import measure_band, members_count
from torchparity.train.trainer import (
    GOLDEN_EXECUTION,
    CaseRuns,
    Execution,
    StepDone,
    StepRecord,
    TrainConfig,
    Trajectory,
    train,
)
from torchparity.train.trajectory import NoiseBand, TrajectoryComparison, compare_trajectories
from torchparity.train.user_model import UserRecipe

GOLDEN_STEPS = 20
#: The dtypes whose bands a zoo case's golden stores, measured on the CPU.
STORED_DTYPES = ("fp32", "bf16")
UPDATE_COMMAND = "torchparity train --case {case} --update-golden"
_BAND = "band."

Say = Callable[[str], None]


# --- the one format ---------------------------------------------------------------------------

def trajectory_output(dtype: str) -> str:
    """The golden's output name for a band in ``dtype``: ``trajectory_<dtype>``."""
    return f"trajectory_{dtype}"


def write_trajectory(store: GoldenStore, name: str, reference: Trajectory, band: NoiseBand,
                     meta: dict[str, Any], output: str | None = None) -> list[Path]:
    """Store ``reference`` (float64) and ``band`` as ``name``'s golden in the band's dtype.

    Args:
        store: where the golden goes.
        name: the case or model name (its folder).
        reference: the float64 trajectory of the recipe.
        band: the noise band measured around it.
        meta: what the JSON records beside steps and members (execution, checksums).
        output: the golden's name (default :func:`trajectory_output` of the band's dtype).

    Returns:
        The paths written.
    """
    tensors = dict(reference.series())
    tensors["lr"] = torch.tensor([r.lr for r in reference.records], dtype=torch.float64)
    tensors.update({_BAND + q: v for q, v in band.spread.items()})
    summary = {"kind": "trajectory", "steps": len(reference.records), **meta,
               "members": band.members}
    return store.write(name, output or trajectory_output(band.compute_dtype), tensors, summary)


def read_trajectory(store: GoldenStore, name: str, dtype: str, recipe: TrainConfig | UserRecipe,
                    reference_execution: Execution, steps: int,
                    fresh: Callable[[Golden], None] = lambda golden: None,
                    ) -> tuple[Trajectory, NoiseBand]:
    """The float64 trajectory and noise band stored for ``name`` in ``dtype``, cut to ``steps``.

    Args:
        store: where the golden is.
        name: the case or model name.
        dtype: the band's dtype.
        recipe: the recipe the trajectory is labelled with.
        reference_execution: how the float64 trajectory was trained.
        steps: how many steps to read (at most those stored).
        fresh: raises ``GoldenStale`` for a golden its recipe, model or data outgrew.

    Returns:
        ``(reference, band)``.
    """
    golden = store.read(name, trajectory_output(dtype))
    return trajectory_of(golden, store, dtype, recipe, reference_execution, steps, fresh)


def trajectory_of(golden: Golden, store: GoldenStore, dtype: str, recipe: TrainConfig | UserRecipe,
                  reference_execution: Execution, steps: int,
                  fresh: Callable[[Golden], None] = lambda golden: None,
                  ) -> tuple[Trajectory, NoiseBand]:
    """The float64 trajectory and noise band a golden holds, cut to ``steps``."""
    stored = golden.summary.get("steps", 0)
    command = store.update_command.format(case=golden.case, output=golden.output)
    if steps > stored:
        raise UsageError(f"{golden.path} holds {stored} steps, fewer than --steps {steps}; "
                         f"run `{command}` for more")
    fresh(golden)
    t = golden.tensors
    quantities = [q for q in t if q != "lr" and not q.startswith(_BAND)]
    if not quantities or any(_BAND + q not in t for q in quantities):
        raise GoldenStale(f"{golden.path} is not a trajectory with its noise band; regenerate "
                          f"it with `{command}`")
    groups = [q for q in quantities if "[" in q]
    records = [StepRecord(i + 1, t["loss"][i].item(), t["grad_norm"][i].item(),
                          t["update_norm"][i].item(), t["lr"][i].item(), 0, 0, 0, math.nan,
                          groups={q: t[q][i].item() for q in groups})
               for i in range(steps)]
    reference = Trajectory(recipe, reference_execution, records, math.nan,
                           notes=[f"golden read from {golden.path}"])
    band = NoiseBand({q: t[_BAND + q][:steps] for q in quantities},
                     list(golden.summary.get("members", [])), dtype)
    return reference, band


# --- a zoo case's goldens ---------------------------------------------------------------------

def golden_config(case: str) -> TrainConfig:
    """The recipe the shipped golden trajectories are made with: defaults, GOLDEN_STEPS steps."""
    return TrainConfig(case=case, steps=GOLDEN_STEPS)


def golden_store(root: str | Path | None = None) -> GoldenStore:
    """The zoo's goldens under ``root``, its messages naming ``train --update-golden``."""
    return GoldenStore(default_golden_dir(root), update_command=UPDATE_COMMAND)


def band_execution(dtype: str, device: str = "cpu") -> Execution:
    """The runs a zoo case's band is measured from: the manual backend in ``dtype``."""
    return Execution("manual", dtype, device)


def runs_per_golden(dtypes: tuple[str, ...] = STORED_DTYPES) -> int:
    """Training runs one case's golden update makes: float64, then each dtype's ensemble."""
    return 1 + sum(members_count(band_execution(d)) for d in dtypes)


def write_golden_trajectory(case: str, store: GoldenStore | None = None, *,
                            advance: StepDone = lambda: None) -> list[Path]:
    """Train and store ``case``'s float64 golden and the band of each stored dtype.

    Returns:
        The paths written.
    """
    config, store = golden_config(case), store or golden_store()
    reference = train(config, GOLDEN_EXECUTION, advance=advance)
    meta = _golden_meta(config)  # its checksums tell a changed recipe, init or corpus
    paths = []
    with store.replacing(case):  # every dtype's golden, or none if interrupted
        for dtype in STORED_DTYPES:
            execution = band_execution(dtype)
            band = measure_band(CaseRuns(config), execution, reference, advance=advance)
            paths += write_trajectory(store, case, reference, band,
                                      {**meta, "band_execution": execution.to_dict()})
    return paths


def read_golden_trajectory(case: str, dtype: str = "fp32", store: GoldenStore | None = None
                           ) -> tuple[Trajectory, NoiseBand]:
    """The stored float64 trajectory of ``case`` and its noise band in ``dtype``."""
    store = store or golden_store()
    config = golden_config(case)

    def fresh(golden: Golden) -> None:
        _check_fresh(golden.summary, _golden_meta(config),
                     store.update_command.format(case=case), golden.path)

    return read_trajectory(store, case, dtype, config, GOLDEN_EXECUTION, config.steps, fresh)


def is_stored(config: TrainConfig, execution: Execution) -> bool:
    """Whether the goldens hold the trajectory and band that judge ``config``'s run."""
    # a CUDA run's band is its device's: its kernels and its autocast are not the CPU's
    return (config.same_recipe() == golden_config(config.case)
            and execution.dtype in STORED_DTYPES and torch.device(execution.device).type == "cpu")


def golden_and_band(config: TrainConfig, execution: Execution,
                    store: GoldenStore | None = None, *, say: Say = lambda line: None
                    ) -> tuple[Trajectory, NoiseBand]:
    """The float64 trajectory of ``config`` and ``execution``'s band: stored, or trained here."""
    if is_stored(config, execution):
        return read_golden_trajectory(config.case, execution.dtype, store)
    plain = band_execution(execution.dtype, execution.device)
    why = ("the recipe is not the golden one" if config.same_recipe() !=
           golden_config(config.case) else f"no {execution.dtype} band is stored"
           if execution.dtype not in STORED_DTYPES else "the stored bands are the CPU's")
    say(f"training the float64 golden and the noise band ({members_count(plain)} "
        f"rounding-only runs of {plain.label()}) here: {why}")
    recipe = config.same_recipe()
    reference = train(recipe, Execution("manual", "fp64", execution.device))
    return reference, measure_band(CaseRuns(recipe), plain, reference)


def check_against_golden(candidate: Trajectory, store: GoldenStore | None = None, *,
                         say: Say = lambda line: None) -> TrajectoryComparison:
    """The verdict on a zoo case's run against its golden and the band of its dtype."""
    reference, band = golden_and_band(candidate.config, candidate.execution, store, say=say)
    return compare_trajectories(candidate, reference, band,
                                compute_dtype=candidate.execution.dtype)


def judge_against_run(candidate: Trajectory, config: TrainConfig, execution: Execution, *,
                      say: Say = lambda line: None) -> TrajectoryComparison:
    """The verdict on ``candidate`` against ``config`` run here under ``execution`` and its band."""
    say(f"training the same recipe on {execution.label()} in one process, and "
        f"{members_count(execution) - 1} rounding-only runs of it for the noise band")
    plain = train(config, execution)
    band = measure_band(CaseRuns(config), execution, plain, plain=plain)
    return compare_trajectories(candidate, plain, band, compute_dtype=execution.dtype)


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
