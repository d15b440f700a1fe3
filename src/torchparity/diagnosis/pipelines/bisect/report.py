"""A bisection's outcome in words (80 columns, nothing cut) and as the JSON ``bisect`` object.

    inductor, post_grad_passes: post_grad_custom_post_pass (forward graph) rewrote
      aten.gelu at model.py:43
"""

from __future__ import annotations

import os
from typing import Any

from torchparity.diagnosis.pipelines.bisect.engine import BisectOutcome
from torchparity.text import wrap

NOTHING = "nothing to bisect"


def _op(name: str | None) -> str | None:
    """``aten.gelu`` for ``aten.gelu.default``: the op as the user's code calls it."""
    return name.removesuffix(".default") if name else None


def _where(application: dict[str, Any]) -> str | None:
    """``path:line`` of the user's source line, the path relative to the working folder
    when it is under it."""
    if not application.get("file"):
        return None
    path = application["file"]
    relative = os.path.relpath(path)
    return f"{path if relative.startswith('..') else relative}:{application['line']}"


def finding(outcome: BisectOutcome) -> str:
    """The one sentence of the answer: what, on which graph, rewrote which op, where."""
    if outcome.subsystem is None:
        if outcome.backend == "eager":
            return ("dynamo alone (backend eager) already diverges: what is traced differs "
                    "from what runs eagerly (a branch on torch.compiler.is_compiling(), a "
                    "graph break); diagnose A B --compile-b names the module")
        return (f"backend {outcome.backend} diverges and disabling none of its subsystems "
                "alone makes the cell pass")
    head = f"{outcome.backend}, {outcome.subsystem}: "
    application = outcome.application or {}
    if outcome.number is None:  # a config setting made the cell pass
        return head + f"setting {outcome.name} makes the cell pass"
    graph = f" ({application['graph']} graph)" if application.get("graph") else ""
    op = _op(application.get("original_aten") or application.get("op"))
    where = _where(application)
    at = f" at {where}" if where else ""
    if outcome.subsystem == "lowerings":  # the op lowered, and the op it was decomposed from
        lowered = _op(application.get("op")) or outcome.name
        origin = f" from {op}" if op and op != lowered else ""
        return head + f"the lowering of {lowered}{origin}{graph}{at}"
    rewrote = f" rewrote {op}{at}" if op else ""
    return head + f"{outcome.name}{graph}{rewrote}"


def compile_cost(outcome: BisectOutcome) -> str:
    """What the runs compiled: ``1 compiled run of the cell: 1 graph, 0 recompiles, 9 s
    compiling``."""
    runs = "run" if outcome.compiles == 1 else "runs"
    graphs = "graph" if outcome.graphs == 1 else "graphs"
    return (f"{outcome.compiles} compiled {runs} of the cell: {outcome.graphs} {graphs}, "
            f"{outcome.recompiles} recompiles, {outcome.compile_seconds:.0f} s compiling")


def lines(outcome: BisectOutcome | None, cell_label: str) -> list[str]:
    """What the terminal shows: the finding, the node and its code, the cost."""
    if outcome is None or (outcome.backend is None and outcome.bound == 0):
        cost = f" ({compile_cost(outcome)})" if outcome else ""
        return wrap(f"{cell_label}: within its budget compiled: {NOTHING}{cost}")
    if outcome.backend is None:
        return wrap(f"{cell_label}: diverged in its first run, yet every backend passed "
                    "while bisecting: its verdict changes between runs, so the compiler "
                    "cannot be bisected")
    shown = wrap(f"{cell_label} diverges compiled; {finding(outcome)}")
    application = outcome.application or {}
    if outcome.number is not None:
        node = application.get("op")
        original = application.get("original_aten")
        origin = f" (from {_op(original)})" if original and original != node else ""
        detail = f"application {outcome.number} of {outcome.subsystem}"
        if node:
            detail += f"; node {_op(node)}{origin}"
        shown += wrap(f"  {detail}")
    if application.get("code"):
        shown += wrap(f"  {_where(application)}: {application['code']}")
    shown += wrap(f"{compile_cost(outcome)} (at most {outcome.bound} runs) in "
                  f"{outcome.seconds:.0f} s; caches off: {', '.join(outcome.caches_off)}")
    return shown


def cost_json(outcome: BisectOutcome) -> dict[str, Any]:
    """The ``compiled`` object of ``--json``: what every run of the cell compiled, in all."""
    return {"runs": outcome.compiles, "graphs": outcome.graphs,
            "recompiles": outcome.recompiles, "compile_seconds": outcome.compile_seconds,
            "seconds": outcome.seconds}


def to_json(outcome: BisectOutcome | None) -> dict[str, Any] | None:
    """The ``bisect`` object of ``--json``: None when nothing was bisected."""
    if outcome is None or outcome.backend is None:
        return None
    application = outcome.application or {}
    return {"backend": outcome.backend, "subsystem": outcome.subsystem,
            "pass": outcome.name, "number": outcome.number,
            "graph": application.get("graph"), "node": application.get("op"),
            "original_aten": application.get("original_aten"),
            "source": _where(application), "code": application.get("code"),
            "finding": finding(outcome), "compiles": outcome.compiles,
            "bound": outcome.bound, "seconds": outcome.seconds,
            "caches_off": outcome.caches_off}
