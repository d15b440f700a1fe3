"""The report of a decoding diagnosis: terminal, JSON (under ``decode``) and HTML.

It answers, in order: did the prompt pass change; which step's logits first leave the noise
budget (error, budget); which module first leaves its budget at that step and how the change
gets in (an argument, or state the module reads such as a cache holding other positions); and
per sequence the first token flip, with the verdict ``near tie`` (regenerating the golden is
safe) or ``real change`` (B computes something else); in a beam search, per step the first beam
swap (B would keep other hypotheses) and the final n-best, with the same verdicts.
"""

from __future__ import annotations

import html
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from torchparity.comparison.tensor import json_safe
from torchparity.diagnosis.core.results import Result, Row, headroom, shape_difference, share_cell
from torchparity.diagnosis.pipelines.decoding.beams import BeamSwap
from torchparity.diagnosis.pipelines.decoding.judging import (
    Flip,
    first_module,
    step_budget,
    step_error,
)
from torchparity.diagnosis.reports.columns import Line, layout, print_lines
from torchparity.diagnosis.reports.diagnosis import Report, not_compared_legend
from torchparity.diagnosis.reports.html import html_cell, settings_details, svg_plot
from torchparity.diagnosis.reports.meta import DecodeMeta
from torchparity.diagnosis.reports.sentence import entered_by_reorder, entered_through
from torchparity.pages import page
from torchparity.text import print_trimmed

__all__ = ["BeamSwap", "DecodeReport", "Flip"]

_NOWRAP = "td.share { white-space: nowrap; }\n"
_LEGEND = "of the budget used (=: bit-identical to A, X: diverged{})"


@dataclass
class DecodeReport(Report):
    """Result of :func:`torchparity.diagnose_decode` and
    :func:`torchparity.diagnose_decode_against`.

    ``steps[s]`` judges B's next-token logits at step ``s`` (0 is the prompt) against the
    golden's, with A's as the baseline; ``first_step`` is the first that breaks its budget
    (None when none does). ``rows`` judge every aligned module's output (and inputs) at that
    step; :attr:`first_module` is the first whose output breaks its budget while its inputs do
    not, and its ``entry`` says how the change gets in. ``flips`` holds each sequence's first
    token flip. ``tokens`` (batch, steps) are the tokens every side was fed. In a beam search
    (``meta.beams``) ``swaps`` holds each step's first beam swap and ``nbest`` each
    prompt's first difference of the final n-best, ``parents`` (batch, steps) the rows the
    tokens of each step continue, and ``flips`` is empty.
    """

    steps: list[Result]
    first_step: int | None
    rows: list[Row]
    flips: list[Flip]
    tokens: torch.Tensor
    meta: DecodeMeta
    swaps: list[BeamSwap] = field(default_factory=list)
    nbest: list[BeamSwap] = field(default_factory=list)
    parents: torch.Tensor | None = None

    @property
    def first_module(self) -> Row | None:
        return first_module(self.rows)

    @property
    def first_module_label(self) -> str | None:
        """``decoder.layers.0.self_attn @ step 1``, or None."""
        row = self.first_module
        return None if row is None else f"{_label(row.module)} @ step {self.first_step}"

    @property
    def ok(self) -> bool:
        """True when no step leaves its budget and no flip or beam swap is a real change."""
        return self.first_step is None and all(
            f.verdict == "near tie" for f in [*self.flips, *self.swaps, *self.nbest])

    def summary(self) -> str:
        """A few sentences: the prompt, the first step and module that leave the budget and
        where the change enters, the flips, the mode."""
        return " ".join(self.findings())

    def findings(self) -> list[str]:
        """The sentences of :meth:`summary`, one finding each."""
        parts = [f"Prompt (step 0): {self.steps[0].verdict}."]
        if self.first_step is None:
            parts.append(f"No step's logits leave the budget ({len(self.steps) - 1} step(s) "
                         "after the prompt).")
        else:
            result = self.steps[self.first_step]
            parts.append(f"First step whose logits leave the budget: step {self.first_step} "
                         f"(error {_number(step_error(result))}, budget "
                         f"{_number(step_budget(result))}).")
            row = self.first_module
            if row is not None:
                parts.append(f"First module leaving its budget there: "
                             f"{self.first_module_label} ({row.module_type}).")
                if row.entry is not None and row.entry.via == "reorder":
                    parts.append(entered_by_reorder(row.entry, self.first_step))
                elif row.entry is not None and (row.ops is None or row.ops.answer is None
                                                or row.entry.via == "code"):
                    parts.append(entered_through(row.entry))
                if row.ops is not None:
                    parts.append(row.ops.sentence(row.entry, self.first_module_label))
            elif self.rows:
                parts.append("No module's output leaves its budget at that step.")
        real = sum(f.verdict == "real change" for f in self.flips)
        if self.meta.beams:
            parts.append(self._beam_summary())
        elif self.flips:
            safe = not real and self.first_step is None
            parts.append(f"First {self._flipped} in {len(self.flips)} of "
                         f"{self.tokens.shape[0]} sequence(s): {real} real change, "
                         f"{len(self.flips) - real} near tie"
                         f"{' (regenerating the golden is safe)' if safe else ''}.")
        else:
            parts.append(f"No {self._flipped}.")
        if self.meta.mode:
            parts.append(f"Mode: {self.meta.mode}.")
        return parts

    @property
    def _flipped(self) -> str:
        return "changed draws" if self.meta.sample else "token flips"

    @property
    def _flip_title(self) -> str:
        return "First changed draw" if self.meta.sample else "First token flip"

    def _beam_summary(self) -> str:
        beams = self.meta.beams
        text = (f"Beam search of {beams['beams']} beam(s) (length penalty "
                f"{beams['length_penalty']:g}, end of sequence "
                f"{'none' if beams['eos'] is None else beams['eos']}): ")
        if not self.swaps:
            text += "B would keep A's hypotheses at every step"
        else:
            real = sum(s.verdict == "real change" for s in self.swaps)
            text += (f"B would keep other hypotheses at {len(self.swaps)} step(s), first at step "
                     f"{self.swaps[0].step}: {real} real change, {len(self.swaps) - real} near "
                     "tie")
        if not self.nbest:
            return text + "; the final n-best is the same."
        real = sum(s.verdict == "real change" for s in self.nbest)
        safe = not real and self.first_step is None and all(
            s.verdict == "near tie" for s in self.swaps)
        return (text + f"; the final n-best differs for {len(self.nbest)} prompt(s): {real} real "
                f"change, {len(self.nbest) - real} near tie"
                f"{' (regenerating the golden is safe)' if safe else ''}.")

    # -- JSON ---------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        row = self.first_module
        return json_safe({
            "summary": self.summary(),
            "decode": {
                "first_step": self.first_step,
                "first_module": self.first_module_label,
                "entry": None if row is None or row.entry is None else {
                    "argument": row.entry.argument, "detail": row.entry.detail,
                    "via": row.entry.via},
                "first_op": None if row is None or row.ops is None else row.ops.to_dict(),
                "prompt": self.steps[0].verdict,
                "flips": [f.to_dict() for f in self.flips],
                "beams": self.meta.beams,
                "sample": self.meta.sample,
                "swaps": [w.to_dict() for w in self.swaps],
                "nbest": [w.to_dict() for w in self.nbest],
                "steps": [{"step": s, "verdict": r.verdict, "error": step_error(r),
                           "budget": step_budget(r), "share": headroom(r)}
                          for s, r in enumerate(self.steps)],
                "rows": [r.to_dict() for r in self.rows],
                "tokens": self.tokens.tolist(),
                "parents": None if self.parents is None else self.parents.tolist(),
            },
            "meta": self.meta.to_json(),
        })

    # -- terminal -----------------------------------------------------------------------------

    def print(self, console: Any = None) -> None:
        """Print the report to a ``rich.console.Console`` (default: stdout)."""
        from rich.console import Console

        console = console or Console()
        say = lambda what: print_trimmed(console, what)  # noqa: E731
        say(self.summary())
        if self.flips:
            say(self._flips_table())
        if self.swaps:
            say(self._swaps_table())
        if self.nbest:
            say(self._nbest_table())
        say(self._steps_table())
        if self.rows:
            say(f"Modules at step {self.first_step}, B against the golden (A as baseline)")
            print_lines(console, self._rows_lines(console.width))
        for line in self._footer():
            say(line)

    def _table(self, title: str, heads: list[str], right: int) -> Any:
        from rich import box
        from rich.table import Table

        table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                      collapse_padding=True)
        for index, head in enumerate(heads):
            last = index == len(heads) - 1
            table.add_column(head, justify="right" if index < right else "left",
                             no_wrap=not last, overflow="fold" if last else "ellipsis")
        return table

    def _flips_table(self) -> Any:
        table = self._table(f"{self._flip_title} per sequence",
                            ["seq", "step", "A", "B", "margin", "change", "budget", "verdict"], 7)
        for f in self.flips:
            table.add_row(str(f.sequence), str(f.step), str(f.a_token), str(f.b_token),
                          _number(f.margin), _number(f.change), _number(f.budget), f.verdict,
                          style="bold red" if f.verdict == "real change" else None)
        return table

    def _swaps_table(self) -> Any:
        table = self._table("First beam swap per step", ["step", "prompt", "A keeps", "B keeps",
                                                         "margin", "change", "budget",
                                                         "verdict"], 7)
        for w in self.swaps:
            table.add_row(str(w.step), str(w.prompt), w.a_keeps, w.b_keeps, _number(w.margin),
                          _number(w.change), _number(w.budget), w.verdict,
                          style="bold red" if w.verdict == "real change" else None)
        return table

    def _nbest_table(self) -> Any:
        table = self._table("Final n-best, first difference per prompt",
                            ["rank", "prompt", "margin", "change", "budget", "verdict",
                             "A keeps / B keeps"], 5)
        for w in self.nbest:
            table.add_row(str(w.rank), str(w.prompt), _number(w.margin), _number(w.change),
                          _number(w.budget), w.verdict, f"{w.a_keeps} / {w.b_keeps}",
                          style="bold red" if w.verdict == "real change" else None)
        return table

    def _steps_table(self) -> Any:
        table = self._table("Logits per step", ["step", "share", "error", "budget", "verdict"],
                            4)
        for step, result in enumerate(self.steps):
            table.add_row(str(step), share_cell(result), _number(step_error(result)),
                          _number(step_budget(result)), result.verdict,
                          style="bold red" if step == self.first_step else None)
        return table

    def _rows_lines(self, width: int) -> list[tuple[str, str | None]]:
        """The modules at the first failing step, names never cut (see :mod:`.columns`)."""
        first = self.first_module
        lines = [Line([str(index), share_cell(r.inputs), share_cell(r.propagated)],
                      _label(r.module) + (" (shape differs)" if r.shapes else ""), r.depth,
                      "bold red" if r is first else None)
                 for index, r in enumerate(self.rows)]
        return layout(["#", "inputs", "output", "module (B)"], lines, width, right=3)

    def _footer(self) -> list[str]:
        lines = [f"share: {_LEGEND.format(not_compared_legend(self.rows))}"]
        if self.flips and self.meta.sample:
            lines.append("margin: the uniform's distance from the boundary of A's cumulative "
                         "distribution that moved; change: how far B moved it; budget: the "
                         "step's, carried to probabilities")
        elif self.flips:
            lines.append("margin: A's top-1 minus top-2 logit; change: the largest error of B's "
                         "logits there against the golden; budget: the step's")
        if self.swaps or self.nbest:
            lines.append("A keeps / B keeps: the candidate (beam:token) or hypothesis (tokens) "
                         "each side keeps and the other drops; margin: A's score of the first "
                         "minus the second; change: B's largest score error there against the "
                         "golden; budget: the scores'")
        first = self.first_module
        if first is not None:
            lines += [f"{_label(first.module)} @ step {self.first_step}: {shape_difference(d)}"
                      for d in first.shapes]
        lines += [f"note: {note}" for note in self.meta.notes]
        return lines

    def __str__(self) -> str:
        return self.render(80)

    # -- HTML ---------------------------------------------------------------------------------

    def to_html(self, path: str | os.PathLike | None = None) -> str:
        """A self-contained HTML page (inline SVG plots, no scripts): the error per step, the
        flips, then the error per module at the first failing step; written to ``path`` if
        given."""
        steps = [Row(module=f"step {s}", a_module="", how="name", module_type="step",
                     depth=0, start=s, propagated=r) for s, r in enumerate(self.steps)]
        parts = [f"<p class='summary'>{html.escape(self.summary())}</p>",
                 svg_plot(steps, {"logits": "propagated"}, "Logits per step: error / budget")]
        if self.flips:
            parts.append(_html_table(
                f"{self._flip_title} per sequence",
                ["seq", "step", "A token", "B token", "margin", "change", "budget", "verdict"],
                [([str(f.sequence), str(f.step), str(f.a_token), str(f.b_token),
                   _number(f.margin), _number(f.change), _number(f.budget), f.verdict],
                  "first" if f.verdict == "real change" else "") for f in self.flips]))
        for title, swaps, where in (("First beam swap per step", self.swaps, "step"),
                                    ("Final n-best, first difference per prompt", self.nbest,
                                     "rank")):
            if swaps:
                parts.append(_html_table(
                    title, [where, "prompt", "A keeps", "B keeps", "margin", "change",
                            "budget", "verdict"],
                    [([str(w.step if where == "step" else w.rank), str(w.prompt), w.a_keeps,
                       w.b_keeps, _number(w.margin), _number(w.change), _number(w.budget),
                       w.verdict], "first" if w.verdict == "real change" else "")
                     for w in swaps]))
        if self.rows:
            first = self.first_module
            parts.append(svg_plot(self.rows, {"output": "propagated", "inputs": "inputs"},
                                  f"Modules at step {self.first_step}: error / budget"))
            parts.append(_html_table(
                f"Modules at step {self.first_step} (B against the golden, A as baseline)",
                ["#", "module (B)", "type", "inputs", "output"],
                [([str(i), _html_name(r), html.escape(r.module_type), html_cell(r.inputs),
                   html_cell(r.propagated)],
                  "first" if r is first else ("diverged" if r.propagated is not None
                                              and not r.propagated.ok else ""))
                 for i, r in enumerate(self.rows)], escape=False, wraps=1))
        parts += [f"<p class='note'>{html.escape(line)}</p>" for line in self._footer()]
        parts.append(settings_details(self.meta.to_json()))
        text = page("torchparity decoding diagnosis", "".join(parts), _NOWRAP)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text


def _html_name(row: Row) -> str:
    name = "&nbsp;" * 2 * row.depth + html.escape(_label(row.module))
    if row.entry is not None:
        name += f"<br><span class='entry'>{html.escape(entered_through(row.entry))}</span>"
    for d in row.shapes:
        name += f"<br><span class='entry'>{html.escape(shape_difference(d))}</span>"
    return name


def _html_table(title: str, heads: list[str], rows: list[tuple[list[str], str]],
                escape: bool = True, wraps: int | None = None) -> str:
    """A table whose cells stay on one line, but for column ``wraps`` (module names)."""
    head = "".join(f"<th>{h}</th>" for h in heads)
    body = "".join(
        f"<tr class='{css}'>" + "".join(
            f"<td{'' if i == wraps else ' class=share'}>{html.escape(c) if escape else c}</td>"
            for i, c in enumerate(cells)) + "</tr>"
        for cells, css in rows)
    return f"<h2>{html.escape(title)}</h2><table><thead><tr>{head}</tr></thead>" \
           f"<tbody>{body}</tbody></table>"


def _label(module: str) -> str:
    return module or "(model)"


def _number(value: float | None) -> str:
    if value is None:
        return "-"
    if math.isinf(value) or math.isnan(value):
        return str(value)
    return f"{value:.2g}" if value and (abs(value) < 1e-3 or abs(value) >= 1e4) else \
        f"{value:.3g}"
