"""Compiled cells of the check: a zoo case or a user's model run by ``torch.compile``.

``torchparity check --compile`` adds, beside every backend x dtype cell, the same cell run
compiled (Inductor; ``dynamic``: ``dynamic=True`` as users run it, and ``static``), judged by
the same tolerance model against the same baseline as the eager cells: the ``manual`` backend
run eagerly in that dtype. Forward outputs, the loss and every gradient come from one compiled
training call; decoding runs the compiled model step by step as the eager cells do (the
zoo's forced decoding; for a user's model the step protocol of
:mod:`torchparity.subject.decoding`: the prompt, then one token at a time through the cache,
each step fed the golden's token), so every step is a call of the compiled model at a new
length: each step is judged on its own, and what recompiles there is counted per step.

A compiled cell's rows carry its :class:`~torchparity.subject.compiling.CompileLog`
(``compiled``: graphs, graph breaks with their reasons, recompiles with dynamo's reasons,
seconds compiling and running, each call's record) and its decode row each decoding step's
verdict and recompiles (``compiled["steps"]``). A backend that cannot run the cell eagerly is
``n/a`` here for the same reason, without compiling; a model that does not compile is ``n/a``
with the compiler's reason.

The zoo's and a user model's checks call it; it knows the check only by its vocabulary
(:mod:`torchparity.golden.cells`).
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Callable, Iterable
from typing import Any

import torch

from torchparity import backends
from torchparity.comparison import compare
from torchparity.dtypes import DTYPES
from torchparity.golden.cells import Cell, CheckResult
from torchparity.subject.compiling import CompileLog


def unavailable_reason(cell: Cell) -> str | None:
    """Why the cell's backend cannot run eagerly on its device and dtype: compiling is not tried.

    Args:
        cell: a compiled cell.

    Returns:
        The reason, or None. ``hf-eager`` and other backends of no registry are never
        refused.
    """
    if cell.backend not in backends.names():
        return None
    return backends.available(cell.device, DTYPES[cell.dtype])[cell.backend]


def decode_phases(log: CompileLog | None, label: str
                  ) -> Callable[[int], contextlib.AbstractContextManager] | None:
    """What a decoding loop runs step ``s`` in, so ``log`` records its calls as that step's.

    Args:
        log: the compiled cell's log, or None for an eager run.
        label: the decoding's name (``cached``), the phases being ``"{label} step {s}"``.

    Returns:
        ``during(step)``, a context manager per step; None without a log.
    """
    if log is None:
        return None
    return lambda step: log.phase(f"{label} step {step}")


def logprobs_by_step(tensors: dict[str, torch.Tensor] | None) -> list[dict[str, torch.Tensor]]:
    """A zoo decoding's ``logprobs`` (batch, steps) as one ``{path: tensor}`` per step.

    Args:
        tensors: a zoo case's ``decode`` output, or None.

    Returns:
        One dict per step; empty without a decoding.
    """
    if not tensors or "logprobs" not in tensors:
        return []
    logprobs = tensors["logprobs"]
    return [{"logprobs": logprobs[:, step]} for step in range(logprobs.shape[1])]


def stepped_logits(tensors: dict[str, torch.Tensor] | None) -> list[dict[str, torch.Tensor]]:
    """A step-protocol decoding's cached logits as one ``{path: tensor}`` per step.

    Args:
        tensors: a user model's ``decode`` output (``cached.logits.<step>``, see
            :mod:`torchparity.golden.user_models`), or None.

    Returns:
        One dict per step, in step order; empty without a decoding.
    """
    steps = {}
    for path, tensor in (tensors or {}).items():
        found = re.fullmatch(r"cached\.logits\.(\d+)", path)
        if found:
            steps[int(found.group(1))] = {path: tensor}
    return [steps[step] for step in sorted(steps)]


def step_verdicts(candidate: list[dict[str, torch.Tensor]],
                  golden: list[dict[str, torch.Tensor]],
                  baseline: list[dict[str, torch.Tensor]], dtype: str) -> list[dict[str, Any]]:
    """Each decoding step judged on its own, so a report says at which step a compiled cell parts.

    Args:
        candidate: the compiled cell's tensors per step.
        golden: the golden's per step.
        baseline: the eager run's in the same dtype, per step: the budget.
        dtype: the cell's dtype.

    Returns:
        One ``{"step", "verdict", "headroom"}`` per step (step 0 is the prompt's prediction);
        none when the candidate did not decode or the golden has other steps.
    """
    if not candidate or len(candidate) != len(golden):
        return []
    steps = []
    for step, (ours, reference) in enumerate(zip(candidate, golden, strict=True)):
        budget = baseline[step] if len(baseline) == len(golden) else None
        comparison = compare(ours, reference, budget, "forward", compute_dtype=dtype)
        worst = comparison.worst
        steps.append({"step": step, "verdict": comparison.verdict,
                      "headroom": worst.headroom if worst else 0.0})
    return steps


def annotate(results: Iterable[CheckResult], log: CompileLog | None,
             steps: list[dict[str, Any]]) -> None:
    """Put the cell's compile log on each of its rows, and each step's verdict on its decode row.

    Each step's verdict sits beside what the step's calls compiled (those the log recorded as
    ``cached step <s>``, see :func:`decode_phases`).

    Args:
        results: the cell's rows, changed in place.
        log: the cell's compile log, or None.
        steps: :func:`step_verdicts` of its decoding.
    """
    if log is None:
        return
    summary = log.to_dict()
    for step in steps:
        calls = log.in_phase(f"cached step {step['step']}")
        if calls:
            step.update(length=max((_length(call.shapes) or 0) for call in calls),
                        seconds=sum(call.seconds for call in calls),
                        compile_seconds=sum(call.compile_seconds for call in calls),
                        recompiles=[reason for call in calls for reason in call.recompiles])
    for result in results:
        result.compiled = {**summary, "steps": steps} if result.output == "decode" else summary


def _length(shapes: dict[str, list[int]]) -> int | None:
    """The sequence length a decoding call saw: the longest last dimension of its inputs (the
    attention mask spans the cached tokens and the new one)."""
    return max((shape[-1] for shape in shapes.values() if shape), default=None)


# --- the report -----------------------------------------------------------------------------

EVERY_CALL_NOTE = "recompiles at every call of the model"
NEW_SHAPES = " (each new length compiles anew; --json has dynamo's reason for every recompile)"


def cell_counts(compiled: dict[str, Any]) -> tuple[str, list[str]]:
    """A compiled cell's ``graphs/breaks/recompiles`` and the footnotes it needs.

    Args:
        compiled: a row's compile log, as its JSON holds it.

    Returns:
        The counts' text, and the footnotes: that it recompiles at every call, and the first
        reason of each graph break.
    """
    counts = f"{compiled['graphs']}/{compiled['graph_breaks']}/{compiled['recompiles']}"
    notes = []
    if compiled["recompiles_every_call"]:
        later = [reason for call in compiled["calls"][1:] for reason in call["recompiles"]]
        shapes = "mismatch" in later[-1]
        notes.append(EVERY_CALL_NOTE + (NEW_SHAPES if shapes else
                                        " (--json has dynamo's reason for every recompile)"))
    notes += [f"graph break: {reason}" for reason in compiled["break_reasons"]]
    return counts, list(dict.fromkeys(notes))


def compiled_lines(results: list[CheckResult]) -> list[str]:
    """The lines under the table when there are compiled cells.

    Args:
        results: every row.

    Returns:
        What the counts are, decoding step by step (recompiles and the worst share of the
        budget at each step, grouped by form and pattern), and where the time went; empty
        without compiled cells.
    """
    cells = {r.cell: r for r in results if r.compiled}
    if not cells:
        return []
    compilers = ", ".join(sorted({r.compiled["compiler"] for r in cells.values()}))
    lines = [f"Compiled cells ({compilers}; dynamic: torch.compile(dynamic=True), static: "
             "dynamic=False) end with their graphs/graph breaks/recompiles."]
    lines += _decoding_lines([r for r in results if r.compiled and r.output == "decode"])
    compiling = sum(r.compiled["compile_seconds"] for r in cells.values())
    running = sum(r.compiled["run_seconds"] for r in cells.values())
    slowest = max(cells.values(), key=lambda r: r.compiled["seconds"])
    lines.append(
        f"Compiled cells: {len(cells)}, {compiling:.1f} s compiling and {running:.1f} s the "
        f"rest; slowest {slowest.case} {slowest.cell.label} {slowest.compiled['seconds']:.1f} s "
        f"({slowest.compiled['compile_seconds']:.1f} s compiling).")
    return lines


def _decoding_lines(rows: list[CheckResult]) -> list[str]:
    patterns: dict[tuple[str, tuple[int, ...]], list[CheckResult]] = {}
    for row in rows:
        steps = row.compiled.get("steps") or []
        if steps and all("recompiles" in step for step in steps):
            pattern = tuple(len(step["recompiles"]) for step in steps)
            patterns.setdefault((row.compile, pattern), []).append(row)
    if not patterns:
        return []
    lines = ["Compiled decoding, step by step (step 0 reads the prompt, each later step one "
             "more token through the KV cache): recompiles at each step, and the largest share "
             "of the budget any cell used at it"]
    for (form, pattern), group in sorted(patterns.items()):
        worst = [max(row.compiled["steps"][i]["headroom"] for row in group)
                 for i in range(len(pattern))]
        failed = [any(row.compiled["steps"][i]["verdict"] == "diverged" for row in group)
                  for i in range(len(pattern))]
        shares = " ".join(("✗" if bad else "") + _share(share)
                          for share, bad in zip(worst, failed, strict=True))
        every = ", every step" if len(pattern) > 1 and all(pattern[1:]) else ""
        lines.append(f"  {form}: {' '.join(map(str, pattern))} recompile(s){every} in "
                     f"{len(group)} cell(s); budget used {shares}")
    return lines


def _share(headroom: float) -> str:
    return "inf" if headroom == float("inf") else f"{headroom:.0%}"
