"""The zoo's golden trajectories in ``check --train``: one ``trajectory`` row per case and cell."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torchparity import backends
from torchparity.dtypes import DTYPES
from torchparity.errors import BackendUnavailable
from torchparity.golden import check_loop
from torchparity.golden.cells import Cell, CellRun, CheckResult
from torchparity.golden.store import GoldenStore
from torchparity.train import golden_trajectories as tj
from torchparity.train.trainer import Execution, Trajectory, train

OUTPUT = "trajectory"  # the row's output: one per case and cell, whatever its dtype


def trajectory_feeds(root: GoldenStore, cases: list[str]) -> Callable[[str], TrajectoryFeed]:
    """Each case's feed of the check loop, every golden validated before any training.

    Raises:
        GoldenError: a golden is missing, damaged or stale.
    """
    store = tj.golden_store(root.root)
    for case in cases:
        for dtype in tj.STORED_DTYPES:
            tj.read_golden_trajectory(case, dtype, store)
    return lambda case: TrajectoryFeed(store, case)


class TrajectoryFeed:
    """A case's golden recipe as the check loop trains and judges it (a ``check_loop.Feed``)."""

    kinds = {OUTPUT: "trajectory"}
    outputs = (OUTPUT,)
    unjudged: dict[str, str] = {}
    noise_from = OUTPUT  # a trajectory has no loss output to carry noise into

    def __init__(self, store: GoldenStore, case: str) -> None:
        self.store, self.name, self.config = store, case, tj.golden_config(case)
        self._untrained: dict[tuple[str, str], str] = {}  # baselines that cannot train here

    def changed(self) -> dict[str, tuple[str, str]]:
        return {}  # a trajectory's golden records no weights: its recipe trains them

    def refused(self, cell: Cell) -> str | None:
        return backends.available(cell.device, DTYPES[cell.dtype])[cell.backend]

    def run(self, cell: Cell, *, perturb: bool = False) -> CellRun:
        # a baseline that cannot train is noted for the judge
        try:
            return CellRun({OUTPUT: train(self.config, Execution(cell.backend, cell.dtype,
                                                             cell.device))}, {})
        except BackendUnavailable as exc:
            if cell.backend == "manual":
                self._untrained[cell.dtype, cell.device] = str(exc)
            return CellRun({}, {OUTPUT: str(exc)})

    def golden(self, output: str) -> None:
        return None  # read by check_against_golden from the store

    def judge(self, cell: Cell, output: str, candidate: Trajectory, golden: None,
              baseline: Trajectory | None, noise: float | None = None) -> CheckResult:
        """The trajectory's row: n/a where the baseline could not train."""
        if baseline is None:
            return check_loop.row(self, cell, output, "n/a", ok=True,
                                  reason=self._untrained[cell.dtype, cell.device])
        comparison = tj.check_against_golden(candidate, self.store)
        worst = comparison.first_divergence or comparison.worst
        return check_loop.row(self, cell, output, comparison.verdict, ok=comparison.ok,
                              headroom=comparison.max_headroom, explain=comparison.explain(),
                              worst=f"{worst.quantity} at step {worst.step}" if worst else None)

    def self_checks(self, fresh: CellRun) -> list[CheckResult]:
        return []  # the reference cell trains nothing

    def steps(self, decoded: Any) -> list[dict[str, Any]]:
        return []  # a trajectory decodes nothing
