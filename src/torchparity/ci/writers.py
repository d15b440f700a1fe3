"""An :class:`~torchparity.ci.outcome.Outcome` as Markdown, JUnit XML and GitHub annotations.

The Markdown summary fits a screen (:data:`SUMMARY_LINES` lines at most: the table is cut,
with a line saying how many rows were left out and where to find them). The JUnit XML has one
``<testcase>`` per case, each with its verdict as a property; a failure carries its message,
an ``n/a`` cell is ``<skipped>`` with the reason. The suite's ``time`` is the command's wall
time; the cases are judged together, so each case's ``time`` is an even share of it (they add
up to the suite's, as CI viewers expect). Under GitHub Actions (``GITHUB_ACTIONS=true``)
each alert (a failed cell, a diagnosis's summary) is also a ``::error`` workflow command on
stdout, which GitHub shows on the run.
"""

from __future__ import annotations

import os
import xml.etree.ElementTree as ET
from pathlib import Path

from torchparity.ci.outcome import Outcome
from torchparity.errors import UsageError

#: The most lines a summary has: one screen of a pull-request comment.
SUMMARY_LINES = 40
#: GitHub shows at most ten error annotations of a step.
ANNOTATIONS = 10


def check_paths(summary: str | None, junit: str | None) -> None:
    """Refuse a ``--summary`` or ``--junit`` path whose folder does not exist, before any work.

    Args:
        summary: the ``--summary`` path, or None.
        junit: the ``--junit`` path, or None.

    Raises:
        UsageError: naming the option and the path.
    """
    for option, path in (("--summary", summary), ("--junit", junit)):
        if path and not Path(path).resolve().parent.is_dir():
            raise UsageError(f"{option} {path}: its folder does not exist")


def publish(outcome: Outcome, summary: str | None = None, junit: str | None = None) -> None:
    """Write the reports CI asked for, and the annotations of a failure under GitHub Actions.

    Args:
        outcome: what the command found.
        summary: the Markdown file, appended to when it has text already (as
            ``$GITHUB_STEP_SUMMARY`` wants), or None.
        junit: the JUnit XML file, overwritten, or None.
    """
    if summary:
        path = Path(summary)
        separator = "\n" if path.is_file() and path.stat().st_size else ""
        with path.open("a") as file:
            file.write(separator + summary_markdown(outcome))
    if junit:
        Path(junit).write_text(junit_xml(outcome))
    if os.environ.get("GITHUB_ACTIONS") == "true":
        for line in annotations(outcome):
            print(line, flush=True)


def summary_markdown(outcome: Outcome) -> str:
    """The Markdown summary, cut to :data:`SUMMARY_LINES` lines: one screen of a comment.

    Args:
        outcome: what the command found.

    Returns:
        A heading with the verdict, what was compared, the findings and the table; a line
        says how many rows were left out and where they are.
    """
    mark = "✅" if outcome.ok else "❌"
    lines = [f"### {mark} {outcome.command}", ""]
    if outcome.headline:
        lines += [_one_line(outcome.headline), ""]
    if outcome.next_step:
        lines += [f"Next: `{outcome.next_step}`", ""]
    elif outcome.full_report and not outcome.ok:
        lines += [f"Full report: `{outcome.full_report}`", ""]
    lines += [_one_line(outcome.verdict), "", f"Compared: {outcome.subject}", ""]
    lines += [f"- {_one_line(finding)}" for finding in outcome.findings]
    if outcome.findings:
        lines.append("")
    if outcome.rows:
        room = SUMMARY_LINES - len(lines) - 6  # head, rule, rows left out, legend
        shown = outcome.rows if len(outcome.rows) <= room + 1 else outcome.rows[:room]
        lines += [_row(outcome.heads), _row(["---"] * len(outcome.heads))]
        lines += [_row(row) for row in shown]
        if len(shown) < len(outcome.rows):
            lines += ["", f"{len(outcome.rows) - len(shown)} more rows: see --junit or --json"]
        if outcome.legend:
            lines += ["", _one_line(outcome.legend)]
    return "\n".join(lines).rstrip() + "\n"


def junit_xml(outcome: Outcome) -> str:
    """The JUnit XML: one ``<testsuite>`` of the command, a ``<testcase>`` per case.

    Args:
        outcome: what the command found.

    Returns:
        The XML text, each case's ``time`` an even share of the command's.
    """
    failures = sum(not c.ok for c in outcome.cases)
    skipped = sum(c.skipped is not None for c in outcome.cases)
    suites = ET.Element("testsuites", name=outcome.command, tests=str(len(outcome.cases)),
                        failures=str(failures))
    seconds = outcome.seconds or 0.0
    share = f"{seconds / max(len(outcome.cases), 1):.3f}"
    suite = ET.SubElement(suites, "testsuite", name=outcome.command,
                          tests=str(len(outcome.cases)), failures=str(failures),
                          errors="0", skipped=str(skipped), time=f"{seconds:.3f}")
    ET.SubElement(ET.SubElement(suite, "properties"), "property", name="compared",
                  value=outcome.subject)
    for case in outcome.cases:
        element = ET.SubElement(suite, "testcase", classname=case.suite, name=case.name,
                                time=share)
        properties = ET.SubElement(element, "properties")
        ET.SubElement(properties, "property", name="verdict", value=case.verdict)
        if case.judged_against is not None:
            ET.SubElement(properties, "property", name="judged against",
                          value=case.judged_against)
        if not case.ok:
            failure = ET.SubElement(element, "failure", message=_first_line(case.message),
                                    type=case.verdict)
            failure.text = case.message
        elif case.skipped is not None:
            ET.SubElement(element, "skipped", message=case.skipped)
        if case.note:
            ET.SubElement(properties, "property", name="note", value=case.note)
            ET.SubElement(element, "system-out").text = case.note
    ET.indent(suites)
    return ET.tostring(suites, encoding="unicode", xml_declaration=True) + "\n"


def annotations(outcome: Outcome) -> list[str]:
    """GitHub's ``::error`` workflow commands for the first :data:`ANNOTATIONS` alerts.

    Args:
        outcome: what the command found.

    Returns:
        ``::error title=...::message`` lines, and one counting the alerts left out.
    """
    title = _escape(outcome.command, True)
    lines = [f"::error title={title}::{_escape(alert)}"
             for alert in outcome.alerts[:ANNOTATIONS]]
    if len(outcome.alerts) > ANNOTATIONS:
        lines.append(f"::error title={title}::{len(outcome.alerts) - ANNOTATIONS} more "
                     "failures: see the job's log")
    return lines


def _row(cells: list[str]) -> str:
    return "| " + " | ".join(_one_line(cell).replace("|", "\\|") for cell in cells) + " |"


def _one_line(text: str) -> str:
    return " ".join(text.split())


def _first_line(text: str) -> str:
    return text.strip().splitlines()[0] if text.strip() else ""


def _escape(text: str, property_value: bool = False) -> str:
    """Escaped as GitHub's workflow commands read a message (and a property's value)."""
    text = text.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
    return text.replace(":", "%3A").replace(",", "%2C") if property_value else text
