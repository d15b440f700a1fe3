"""The op drill-down as a maintainer reads it: the op table, one sentence, and the JSON."""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from typing import Any

from torchparity.diagnosis.core.results import Entry, Result, headroom, share_cell
from torchparity.diagnosis.reports import sentence as say
from torchparity.diagnosis.reports.columns import Line, layout
from torchparity.diagnosis.reports.html import html_cell
from torchparity.diagnosis.stages.ops.capture import Frame, Step
from torchparity.diagnosis.stages.ops.judge import OpLine

__all__ = ["ForwardCause", "NoOps", "OpReport"]

#: Steps shown on each side of one that matters; the others fold into one line per run.
_NEIGHBOURS = 1


@dataclass(frozen=True)
class NoOps:
    """A module call not drilled down to its ops, and why; the reason joins the row's notes."""

    reason: str


@dataclass(frozen=True)
class ForwardCause:
    """The forward divergence a gradient divergence follows from: B's module, op and line."""

    module: str
    op: str | None = None
    line: Frame | None = None

    @classmethod
    def of(cls, module: str, ops: OpReport | None) -> ForwardCause:
        answer = None if ops is None else ops.answer
        if answer is None:
            return cls(module)
        a, b = answer.pair.a or answer.replaces, answer.pair.b
        step, other = (b, a) if b is not None else (a, b)
        return cls(module, answer.pair.name, _telling_frame(step, other))

    def to_dict(self) -> dict[str, Any]:
        return {"module": self.module, "op": self.op,
                "line": None if self.line is None else str(self.line),
                "code": None if self.line is None else self.line.text}


@dataclass
class OpReport:
    """The steps of one module call of A and B, aligned and judged."""

    module: str
    lines: list[OpLine]
    first: int | None  # the line where the divergence enters; None when no op explains it
    notes: list[str] = field(default_factory=list)
    built: dict[str, Frame] = field(default_factory=dict)  # a library module's, per side
    # on a backward pass whose own ops leave no budget, the forward divergence it follows from
    follows: ForwardCause | None = None

    @property
    def answer(self) -> OpLine | None:
        return None if self.first is None else self.lines[self.first]

    def sentence(self, entry: Entry | None = None, label: str | None = None) -> str:
        """Where the divergence enters, in one sentence; ``label`` names the module if given."""
        line = self.answer
        if line is None and self.follows is not None:
            cause = self.follows
            return say.follows_sentence(say.forward_clause(cause.module, cause.op, cause.line),
                                        len(self.lines))
        if line is None:
            return say.no_op_sentence(self.module, len(self.lines))
        if line.dropped:
            frames = [f for f in (_telling_frame(step, None) for step in line.dropped)
                      if f is not None]
            return say.dropped_sentence(self.module, line.pair.kind.removeprefix("only in "),
                                        [step.name for step in line.dropped], frames, entry,
                                        label)
        a, b = line.pair.a or line.replaces, line.pair.b
        sources = [(side, _telling_frame(step, other))
                   for side, step, other in (("B", b, a), ("A", a, b)) if step is not None]
        return say.op_sentence(self.module, line.pair.name, sources, line.pair.differences,
                               line.pair.kind,
                               None if line.replaces is None else line.replaces.name,
                               entry, label)

    def built_sentence(self) -> str:
        """``ln2 was built at B: path:line "code"; A: path:line "code".`` ("" when unknown)."""
        if not self.built:
            return ""
        frames = set(self.built.values())
        if len(frames) == 1 and len(self.built) == 2:
            (frame,) = frames
            return f'{self.module} was built at {frame} "{frame.text}" (A and B).'
        sides = "; ".join(f'{side}: {frame} "{frame.text}"'
                          for side, frame in sorted(self.built.items(), reverse=True))
        return f"{self.module} was built at {sides}."

    @property
    def has_source(self) -> bool:
        """Whether any step ran in user code (a library module's own ops have no line)."""
        return any(side is not None and side.stack for line in self.lines
                   for side in (line.pair.a, line.pair.b))

    def to_dict(self) -> dict[str, Any]:
        """``first_divergence.op`` of the JSON: the answer and every aligned step."""
        line = self.answer
        return {"module": self.module,
                **({} if line is None else _line_dict(line, answer=True)),
                "found": line is not None,
                "follows_forward": None if self.follows is None else self.follows.to_dict(),
                "steps": [_line_dict(x) for x in self.lines],
                "built": {side.lower(): {"at": str(frame), "code": frame.text}
                          for side, frame in self.built.items()},
                "notes": self.notes}

    def to_html(self, entry: Entry | None = None) -> str:
        """Every aligned step as an HTML table under :meth:`sentence`, both sides' lines."""
        heads = ["#", "op", "shape", "local", "prop.", "A's line", "B's line", "arguments"]
        rows = []
        for i, line in enumerate(self.lines):
            a, b = line.pair.a or line.replaces, line.pair.b
            step = b if b is not None else a
            shape = ", ".join(str(tuple(t.shape)) for t in step.outputs.values())
            cells = [str(i), html.escape(line.pair.name + ("" if line.pair.kind == "paired"
                                                           else f" [{line.pair.kind}]")),
                     html.escape(shape), html_cell(line.local), html_cell(line.propagated),
                     _html_source(line.pair.a), _html_source(b),
                     html.escape(", ".join(line.pair.differences))]
            style = " class='entry'" if i == self.first else ""
            rows.append(f"<tr{style}>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
        head = "".join(f"<th>{h}</th>" for h in heads)
        return (f"<h2>Ops of {html.escape(self.module or '(model)')}</h2>"
                f"<p class='summary'>{html.escape(self.sentence(entry))} "
                f"{html.escape(self.built_sentence())}</p>"
                f"<table class='ops'><thead><tr>{head}</tr></thead><tbody>" + "\n".join(rows)
                + "</tbody></table>")

    def table_lines(self, width: int) -> list[tuple[str, str | None]]:
        """The op table, ``width`` columns wide, folded to the steps that matter."""
        if not self.lines:
            return []
        # the answer, one side's steps, changed arguments, local errors out of budget and their
        # neighbours; each run of the others folds into one line of its worst cells
        keep = set()
        for i, line in enumerate(self.lines):
            if i == self.first or line.pair.kind != "paired" or line.pair.differences or \
                    _diverged(line.local) or (self.first is None and
                                              _diverged(line.propagated)):
                keep.update(range(i - _NEIGHBOURS, i + _NEIGHBOURS + 1))
        rows, run = [], []

        def fold() -> None:
            if run:
                steps = "1 step" if len(run) == 1 else f"{len(run)} steps"
                cells = [share_cell(_worst([self.lines[i].local for i in run])),
                         share_cell(_worst([self.lines[i].propagated for i in run]))]
                rows.append(Line(["…", *cells], f"({steps})", 0, "dim"))
                run.clear()

        for i, line in enumerate(self.lines):
            if i not in keep:
                run.append(i)
                continue
            fold()
            rows.append(Line([str(i), share_cell(line.local), share_cell(line.propagated)],
                             _describe(line), 0, "bold red" if i == self.first else None))
        fold()
        return layout(["#", "local", "prop.", f"op of {self.module or '(model)'}"], rows,
                      width)


def _html_source(step: Step | None) -> str:
    if step is None or not step.stack:
        return ""
    frame = step.stack[0]
    return f"{html.escape(str(frame))}<br><code>{html.escape(frame.text)}</code>"


def _diverged(result: Result | None) -> bool:
    return result is not None and not result.ok


def _worst(results: list[Result | None]) -> Result | None:
    """The result that used the largest share of its budget (a diverged one first)."""
    present = [r for r in results if r is not None]
    return max(present, key=lambda r: (not r.ok, headroom(r) or 0.0), default=None)


def _telling_frame(step: Step, other: Step | None) -> Frame | None:
    """The step's innermost frame whose text the other's stack lacks, else its innermost."""
    if not step.stack:
        return None
    theirs = {(f.path, f.text) for f in other.stack} if other is not None else set()
    return next((f for f in step.stack if (f.path, f.text) not in theirs), step.stack[0])


def _describe(line: OpLine) -> str:
    a, b = line.pair.a, line.pair.b
    step = b if b is not None else a
    shape = next(iter(step.outputs.values()), None)
    text = f"{line.pair.name}"
    if shape is not None:
        text += " (" + ", ".join(str(n) for n in shape.shape) + ")"
    if line.pair.kind != "paired":
        text += f" [{line.pair.kind}]"
    if line.pair.moved:
        text += " [moved]"
    text += "".join(f" {side}: {step.stack[0]}" for side, step in (("B", b), ("A", a))
                    if step is not None and step.stack)
    if line.pair.differences:
        text += " - " + ", ".join(line.pair.differences)
    return text


def _line_dict(line: OpLine, answer: bool = False) -> dict[str, Any]:
    a, b = line.pair.a or line.replaces, line.pair.b
    step = b if b is not None else a
    kind = {"paired": "differs" if answer else "paired"}.get(line.pair.kind, line.pair.kind)
    found = {
        "name": line.pair.name,
        "kind": kind,
        "a_stack": [str(f) for f in a.stack] if a is not None else [],
        "b_stack": [str(f) for f in b.stack] if b is not None else [],
        "code": {"a": a.code if a is not None else None, "b": b.code if b is not None else None},
        "arguments": line.pair.differences,
        "local": None if line.local is None else line.local.to_dict(),
        "propagated": None if line.propagated is None else line.propagated.to_dict(),
        "local_share": headroom(line.local),
        "propagated_share": headroom(line.propagated),
    }
    if answer:
        found["why"] = line.why
        found["replaces"] = None if line.replaces is None else line.replaces.name
        found["dropped"] = [{"name": step.name, "line": str(step.stack[0]) if step.stack
                             else None} for step in line.dropped]
        found["shape"] = [list(t.shape) for t in step.outputs.values()]
    return found
