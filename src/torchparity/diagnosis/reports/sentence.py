"""Where a divergence enters, in the one wording every report prints."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from torchparity.diagnosis.core.results import Entry, module_label

__all__ = ["SourceLine", "backward_sentence", "dropped_sentence", "entered_at",
           "entered_by_reorder", "entered_through", "entry_mark", "entry_note", "follows_sentence",
           "forward_clause", "inherited_from", "no_op_sentence", "op_sentence", "source",
           "source_run"]

#: Said of a step with no frame outside torch and torchparity.
NO_SOURCE = "no source line"


class SourceLine(Protocol):
    """A line of source code: its file, number and text."""

    path: str
    line: int
    text: str


def source(frame: SourceLine | None) -> str:
    """``path:line "code"``, or ``no source line``."""
    return NO_SOURCE if frame is None else f'{frame.path}:{frame.line} "{frame.text}"'


def source_run(frames: Sequence[SourceLine]) -> str:
    """``path:51..53 "first line"`` for one stretch of one file, else each ``path:line``."""
    if not frames:
        return NO_SOURCE
    numbers = sorted({f.line for f in frames})
    if len({f.path for f in frames}) == 1:
        span = str(numbers[0]) if len(numbers) == 1 else f"{numbers[0]}..{numbers[-1]}"
        first = min(frames, key=lambda f: f.line)
        return f'{first.path}:{span} "{first.text}"'
    return ", ".join(dict.fromkeys(f"{f.path}:{f.line}" for f in frames))


def _through(entry: Entry) -> str:
    return f"its {entry.via} {entry.argument} ({entry.detail})"


def _place(entry: Entry) -> str:
    return f"{module_label(entry.module)} {entry.via} {entry.argument} ({entry.detail})"


def entered_at(entry: Entry) -> str:
    """``It enters at attn argument mask (detail).``: the entry of a call not drilled to an op."""
    return f"It enters at {_place(entry)}."


def entry_note(module: str, entry: Entry) -> str:
    """``block: the divergence enters at attn argument mask (detail)``: a row's note."""
    return f"{module_label(module)}: the divergence enters at {_place(entry)}"


def entry_mark(entry: Entry) -> str:
    """``enters at attn argument mask (detail)``: under a row's module in the HTML table."""
    return f"enters at {_place(entry)}"


def entered_through(entry: Entry) -> str:
    """``It enters through its state k_cache (detail).``, or that the module's own code changed."""
    if entry.via == "code":
        return f"The change is in the module's own code: {entry.detail}."
    return f"It enters through {_through(entry)}."


def entered_by_reorder(entry: Entry, step: int) -> str:
    """``It enters through the reorder before step 2: ARGUMENT DETAIL.`` (a beam search's)."""
    return f"It enters through the reorder before step {step}: {entry.argument} {entry.detail}."


def inherited_from(module: str) -> str:
    """``it enters at MODULE``: where the divergence a passing module carries came in."""
    return f"it enters at {module_label(module)}"


def _where(module: str, entry: Entry | None, label: str | None) -> tuple[str, str]:
    """The module the sentence opens on, and the module inside the op's output reaches, if any."""
    where = label or module_label(module)
    if entry is None or entry.via not in ("argument", "state"):
        return where, ""
    if entry.module in (module, where):
        return f"{where} through {_through(entry)}", ""
    return where, f", and reaches {module_label(entry.module)} through {_through(entry)}"


def op_sentence(module: str, op: str, sources: Sequence[tuple[str, SourceLine | None]],
                differences: Sequence[str], kind: str = "paired", replaces: str | None = None,
                entry: Entry | None = None, label: str | None = None) -> str:
    """``It enters at attn, in aten::mul (B: path:line "code"; A: ...): other 2 (A) vs 3 (B).``"""
    where, reaches = _where(module, entry, label)
    sides = "; ".join(f"{side}: {source(frame)}" for side, frame in sources)
    shown = "" if kind == "paired" else f", {kind}"
    if replaces is not None:
        shown += f" for {replaces}"
    args = f": {', '.join(differences)}" if differences else ""
    return f"It enters at {where}, in {op}{shown} ({sides}){args}{reaches}."


def dropped_sentence(module: str, side: str, ops: Sequence[str], frames: Sequence[SourceLine],
                     entry: Entry | None = None, label: str | None = None) -> str:
    """``It enters at attn, in 2 ops only in A (OPS; A: LINES): B has no counterpart.``"""
    where, _ = _where(module, entry, label)
    other = "B" if side == "A" else "A"
    return (f"It enters at {where}, in {len(ops)} ops only in {side} ({', '.join(ops)}; "
            f"{side}: {source_run(frames)}): {other} has no counterpart.")


def no_op_sentence(module: str, steps: int) -> str:
    """``No op of attn's own code leaves its budget (12 steps aligned).``"""
    return (f"No op of {module_label(module)}'s own code leaves its budget ({steps} steps "
            "aligned).")


def forward_clause(module: str, op: str | None = None, frame: SourceLine | None = None) -> str:
    """``the forward divergence of MODULE, which enters at OP (path:line "code")``."""
    if op is None:
        return f"the forward divergence of {module}"
    return f"the forward divergence of {module}, which enters at {op} ({source(frame)})"


def follows_sentence(clause: str, steps: int) -> str:
    """That a gradient follows from ``clause``, after ``steps`` backward steps aligned (or none)."""
    if not steps:  # its backward was not drilled down
        return f"Its gradient follows from {clause}."
    return (f"No backward op leaves its budget on its own inputs ({steps} steps aligned): the "
            f"gradient follows from {clause}.")


def backward_sentence(sentence: str) -> str:
    """``In its backward pass: SENTENCE``: a backward drill-down's sentence among the findings."""
    return f"In its backward pass: {sentence}"
