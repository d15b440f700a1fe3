"""Golden training trajectories in the check: one ``trajectory`` row per case and cell.

Each cell trains the case's golden recipe (:func:`~torchparity.train.trajectory.golden_config`)
with its backend and dtype and judges the run with
:func:`~torchparity.train.trajectory.check_against_golden`: the stored float64 golden as
reference, the manual backend in the cell's dtype as baseline (for fp32 on the CPU the baseline
stored with the golden, so a change of the training code itself cannot earn its own budget).
The reference cell trains nothing: a float64 run would be its own baseline.
"""

from __future__ import annotations

from collections.abc import Callable

from torchparity import backends
from torchparity.dtypes import DTYPES
from torchparity.errors import BackendUnavailable
from torchparity.golden.cells import REFERENCE, Cell, CheckResult
from torchparity.golden.store import GoldenStore
from torchparity.train import trajectory as tj
from torchparity.train.trainer import Execution, TrainConfig, Trajectory, train

OUTPUT = tj.GOLDEN_OUTPUT


def load_trajectories(root: GoldenStore | str, cases: list[str]) -> GoldenStore:
    """The store of the golden trajectories under ``root``, every case's golden validated.

    Raises the golden store's one-line errors (missing, damaged, stale) before any training.
    """
    store = tj.golden_store(root.root if isinstance(root, GoldenStore) else root)
    for case in cases:
        tj.read_golden_trajectory(case, store)
    return store


def check_trajectories(store: GoldenStore, cases: list[str], cells: list[Cell],
                       advance: Callable[[str], None] = lambda label: None,
                       ) -> list[CheckResult]:
    """Train and judge every case in every cell but the reference one; one row per pair.

    A backend that cannot train here (flex without a CPU backward, a CUDA-only kernel) gives
    an ``n/a`` row with the reason. ``advance(label)`` is called after each cell.
    """
    results = []
    for case in cases:
        config = tj.golden_config(case)
        baselines: dict[tuple[str, str], Trajectory] = {}
        for cell in cells:
            if cell == REFERENCE:
                continue
            results.append(_check_cell(store, config, cell, baselines))
            advance(f"{case} {cell.label} trajectory")
    return results


def _check_cell(store: GoldenStore, config: TrainConfig, cell: Cell,
                baselines: dict[tuple[str, str], Trajectory]) -> CheckResult:
    def row(verdict: str, ok: bool, **details) -> CheckResult:
        return CheckResult(case=config.case, backend=cell.backend, dtype=cell.dtype,
                           device=cell.device, output=OUTPUT, kind="trajectory",
                           verdict=verdict, headroom=details.pop("headroom", None), ok=ok,
                           **details)

    reason = backends.available(cell.device, DTYPES[cell.dtype])[cell.backend]
    if reason is not None:
        return row("n/a", True, reason=reason)
    key = (cell.dtype, cell.device)
    try:
        if key not in baselines:
            baselines[key] = train(config, Execution("manual", *key))
        candidate = baselines[key] if cell.backend == "manual" else train(
            config, Execution(cell.backend, cell.dtype, cell.device))
    except BackendUnavailable as exc:
        return row("n/a", True, reason=str(exc))
    stored = Execution("manual", *key) == tj.STORED_BASELINE
    comparison = tj.check_against_golden(candidate, store=store,
                                         baseline=None if stored else baselines[key])
    worst = comparison.first_divergence or comparison.worst
    return row(comparison.verdict, comparison.ok, headroom=comparison.max_headroom,
               explain=comparison.explain(),
               worst=f"{worst.quantity} at step {worst.step}" if worst else None)
