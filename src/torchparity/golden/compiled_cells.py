"""Compiled cells of the check: a zoo case or a user's model run by ``torch.compile``.

``check --compile`` adds beside every eager cell the same cell compiled (``dynamic`` and
``static``), judged against the same eager ``manual`` baseline. Forward, loss and gradients come
from one compiled training call; decoding runs the compiled model step by step, fed the golden's
tokens, each step a call at a new length, judged on its own with its recompiles counted. Rows
carry the cell's :class:`~torchparity.subject.compiling.CompileLog`; a backend that cannot run
eagerly, or a model that does not compile, is ``n/a`` with the reason.
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
    """Why the cell's backend cannot run eagerly here (compiling is not tried), or None."""
    if cell.backend not in backends.names():  # hf-eager and others of no registry: never refused
        return None
    return backends.available(cell.device, DTYPES[cell.dtype])[cell.backend]


def decode_phases(log: CompileLog | None, label: str
                  ) -> Callable[[int], contextlib.AbstractContextManager] | None:
    """``during(step)``: ``log`` records a decoding's calls as ``"{label} step {s}"``."""
    if log is None:
        return None
    return lambda step: log.phase(f"{label} step {step}")


def logprobs_by_step(tensors: dict[str, torch.Tensor] | None) -> list[dict[str, torch.Tensor]]:
    """A zoo decoding's ``logprobs`` (batch, steps) as one ``{path: tensor}`` per step."""
    if not tensors or "logprobs" not in tensors:
        return []
    logprobs = tensors["logprobs"]
    return [{"logprobs": logprobs[:, step]} for step in range(logprobs.shape[1])]


def stepped_logits(tensors: dict[str, torch.Tensor] | None) -> list[dict[str, torch.Tensor]]:
    """A step-protocol decoding's cached logits (``cached.logits.<step>``) as one dict per step."""
    steps = {}
    for path, tensor in (tensors or {}).items():
        found = re.fullmatch(r"cached\.logits\.(\d+)", path)
        if found:
            steps[int(found.group(1))] = {path: tensor}
    return [steps[step] for step in sorted(steps)]


def step_verdicts(candidate: list[dict[str, torch.Tensor]],
                  golden: list[dict[str, torch.Tensor]],
                  baseline: list[dict[str, torch.Tensor]], dtype: str) -> list[dict[str, object]]:
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
             steps: list[dict[str, object]]) -> None:
    """Put the cell's compile log on each of its rows, and each step's verdict on its decode row."""
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
    """The sequence length a decoding call saw: its inputs' longest last dimension (the mask's)."""
    return max((shape[-1] for shape in shapes.values() if shape), default=None)


# --- the report -----------------------------------------------------------------------------

EVERY_CALL_NOTE = "recompiles at every call of the model"
NEW_SHAPES = " (each new length compiles anew; --json has dynamo's reason for every recompile)"


def cell_counts(compiled: dict[str, Any]) -> tuple[str, list[str]]:
    """A compiled cell's ``graphs/breaks/recompiles`` and footnotes (recompiling, break reasons)."""
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
    """The lines under the table for compiled cells: counts, decoding by step, where time went."""
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
