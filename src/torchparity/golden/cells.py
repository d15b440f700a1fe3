"""The check's vocabulary: a cell, the reference cell, a run in a cell, a row of results.

A *cell* is one (backend, dtype, device), eager or compiled. The **reference cell** (manual,
fp64, cpu) recomputes the goldens with today's code: it notices a changed component. Every other
cell is judged against ``manual`` in its dtype and device: it notices a backend or precision that
misbehaves.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from torchparity.subject.compiling import CompileLog


@dataclass(frozen=True)
class Cell:
    """One way of running the reference models: backend, dtype, device, compile form or None."""

    backend: str
    dtype: str
    device: str = "cpu"
    compile: str | None = None

    @property
    def label(self) -> str:
        """``sdpa bf16 cpu``; the reference cell (manual) is ``reference fp64 cpu`` everywhere."""
        compiled = f" compiled {self.compile}" if self.compile else ""
        backend = "reference" if self == REFERENCE else self.backend
        return f"{backend} {self.dtype} {self.device}{compiled}"

    def __str__(self) -> str:  # a pytest id
        return f"{self.backend}-{self.dtype}-{self.device}" + (f"-{self.compile}"
                                                               if self.compile else "")


#: The cell that recomputes the goldens themselves.
REFERENCE = Cell("manual", "fp64", "cpu")


@dataclass
class CheckResult:
    """The verdict of one output of one case in one cell (one row of ``check --json``).

    ``verdict``: ``identical``, ``within`` or ``diverged``; ``baseline degraded`` (the baseline
    erred more than its dtype allows: a failure); ``n/a`` (the cell cannot compute it, ``reason``
    says why: no failure); ``init changed`` / ``inputs changed`` (not comparable).
    """

    case: str
    backend: str
    dtype: str
    device: str
    output: str
    kind: str
    verdict: str
    headroom: float | None  # share of the budget used by the worst tensor; None when not compared
    ok: bool
    reason: str | None = None
    explain: str | None = None
    worst: str | None = None  # path of the worst tensor
    structure: list[str] | None = None  # outputs present on one side only, with what each has
    # The smallest change, relative to the golden's scale, the verdict would have flagged in
    # every tensor of the output (the largest over them); None when not compared.
    sensitivity: float | None = None
    # Positions left out of the judgement (padding) and why; None when every one was judged.
    left_out: str | None = None
    compile: str | None = None  # the torch.compile form of a compiled cell
    # A baseline that erred more than its dtype allows, and what that means for the budgets
    # (see :func:`torchparity.golden.check_loop.degraded_baseline`); None when none did.
    baseline: str | None = None
    # A compiled cell's graphs, breaks, recompiles and seconds, with each call's and (on the
    # decode output) each decoding step's; see torchparity.golden.compiled_cells.
    compiled: dict[str, Any] | None = None
    # The goldens the row was judged against: the stored ones, or, once the reference cell
    # diverged (the model changed), this revision's own float64 outputs as well.
    judged_against: str = "stored goldens"
    # Then its verdict, headroom and sensitivity against the stored goldens.
    stored_goldens: dict[str, Any] | None = None
    # The modules the goldens name otherwise, whose gradients were judged by meaning
    # (``attn.qkv <- attn.q+attn.k+attn.v [fused]``); None where the names are the goldens'.
    renamed: str | None = None

    @property
    def cell(self) -> Cell:
        """The cell of the row, rebuilt from its fields (JSON keeps them flat)."""
        return Cell(self.backend, self.dtype, self.device, self.compile)

    @property
    def plain_verdict(self) -> str:
        """The verdict in the words every report shares (:data:`PLAIN_VERDICTS`)."""
        return plain_verdict(self.verdict)

    def to_dict(self) -> dict[str, object]:
        """The row as ``check --json`` writes it: infinite headroom "inf", a plain verdict too."""
        data = asdict(self)
        for judged in filter(None, (data, data["stored_goldens"])):
            if judged["headroom"] is not None and judged["headroom"] == float("inf"):
                judged["headroom"] = "inf"
        data["plain_verdict"] = self.plain_verdict
        return data


#: What a cell is judged against as well once the reference cell diverged.
OWN_FLOAT64 = "this revision's own float64"
#: The ``judged_against`` of such a cell.
BOTH_GOLDENS = f"{OWN_FLOAT64} and the stored goldens"


#: The verdicts every report (terminal, JSON, Markdown, JUnit, HTML) names, check and diagnose.
PLAIN_VERDICTS = ("identical", "within", "diverged", "structure differs", "not compared",
                  "could not run")
#: A check's own verdicts that say something more specific, in those words: a cell that cannot
#: run here, and goldens made from other weights or inputs (the outputs are not comparable).
_PLAIN = {"n/a": "could not run", "init changed": "not compared",
          "inputs changed": "not compared"}


def plain_verdict(verdict: str) -> str:
    """``verdict`` in the words every report shares (:data:`PLAIN_VERDICTS`)."""
    return _PLAIN.get(verdict, verdict)


@dataclass
class CellRun:
    """One run of a subject in a cell: output name -> what it computed; why others are absent."""

    outputs: dict[str, Any]
    missing: dict[str, str]  # the cell cannot compute them (n/a)
    # the loss's gradient by each floating output (tolerance.propagated_noise)
    sensitivity: dict[str, torch.Tensor] = field(default_factory=dict)
    compile_log: CompileLog | None = None
    # the run no longer holds what the golden was made from: a failure
    not_compared: dict[str, str] = field(default_factory=dict)
    # dtype name -> modules a float64 run computed narrower in
    islands: dict[str, list[str]] = field(default_factory=dict)
    sdpa_calls: int | None = None  # None where nothing intercepts them


@contextlib.contextmanager
def matmul_precision(dtype_name: str) -> Iterator[None]:
    # fp32 cells must not pick up TF32 from a global setting; tf32 cells ask for it.
    """The matmul precision a cell's dtype asks for, inside the block: no stray TF32 in fp32."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high" if dtype_name == "tf32" else "highest")
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(previous)
