"""The calibration studies as ``torchparity calibrate`` runs them: with a progress bar, their
tables or sections printed, and the Markdown report and JSON written where asked (a section
written by another study is kept)."""

from __future__ import annotations

import json
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from torchparity import machine
from torchparity.calibration import capabilities, sketched
from torchparity.calibration.report import print_tables, render_markdown
from torchparity.calibration.study import calibrate
from torchparity.comparison.tensor import json_safe


def run_study(draws: int, *, seed: int, dtypes: list[str], backend_names: list[str],
              flex_every: int, families: tuple[str, ...], out: str | None,
              json_path: str | None, command: str) -> bool:
    """The main study: false alarms of every backend and detections of planted bugs, its
    tables printed and written to ``out`` (made by ``command``) and ``json_path``; True
    without false alarms and with the detection goal met."""
    console = Console(stderr=True)
    with Progress(
        "calibrating", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("draws", total=draws * len(families))
        results = calibrate(
            draws,
            seed=seed,
            dtypes=dtypes,
            backend_names=backend_names,
            flex_every=flex_every,
            families=families,
            on_draw=lambda: progress.advance(task),
        )
    print_tables(results, Console())
    if out:
        text = render_markdown(results, command=command)
        path = Path(out)
        document = path.read_text() if path.exists() else ""
        for section in (sketched.SECTION, capabilities.SECTION):  # written by their own runs
            if (kept := section.of(document)) is not None:
                text = section.merged(text, kept)
        _write(path, text)
    if json_path:
        _write(Path(json_path), json.dumps(json_safe(results.to_dict()), indent=2) + "\n")
    return results.n_false_alarms == 0 and results.detection_goal_met()


def run_sketched(draws: int, seed: int, dtypes: list[str] | None, out: str | None,
                 json_path: str | None) -> bool:
    """The sketched study: its section printed, merged into ``out``; True without false
    alarms."""
    with Progress(
        "sketched study", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True),
    ) as progress:
        task = progress.add_task("draws", total=draws)
        studied = tuple(d for d in dtypes or sketched.SKETCHED_DTYPES if d != "fp64")
        results = sketched.calibrate_sketched(draws, seed=seed, dtypes=studied,
                                              on_draw=lambda: progress.advance(task))
    command = f"torchparity calibrate --sketched --draws {draws} --seed {seed}"
    command += "".join(f" --dtype {d}" for d in dtypes or [])
    section = sketched.sketched_section(
        results, command=command + (f" --out {out}" if out else ""))
    print(section)
    if out:
        path = Path(out)
        _write(path, sketched.merged(path.read_text() if path.exists() else "", section))
    if json_path:
        _write(Path(json_path), json.dumps(json_safe(results.to_dict()), indent=2) + "\n")
    return results.false_alarms == 0


def run_per_capability(study_arguments: list[str], out: str | None) -> bool:
    """The study once per instruction set this machine offers, each in a process of its own
    (``study_arguments`` choose the draws): its section printed, merged into ``out``; True
    without false alarms."""
    offered = machine.capabilities()
    with Progress(
        "per instruction set", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True),
    ) as progress:
        task = progress.add_task("capabilities", total=len(offered))
        rows = capabilities.calibrate_each(study_arguments, offered,
                                           on_done=lambda _: progress.advance(task))
    command = "torchparity calibrate --capabilities " + " ".join(study_arguments)
    section = capabilities.capabilities_section(
        rows, command=command + (f" --out {out}" if out else ""))
    print(section)
    if out:
        path = Path(out)
        _write(path, capabilities.SECTION.merged(path.read_text() if path.exists() else "",
                                                 section))
    return all(row.false_alarms == 0 for row in rows)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
