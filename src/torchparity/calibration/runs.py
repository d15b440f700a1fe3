"""The calibration studies as ``calibrate`` runs them: a progress bar, tables printed, the
report and JSON written (another study's section kept)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

from torchparity import machine
from torchparity.calibration import capabilities, sketched, training_report
from torchparity.calibration.report import print_tables, render_markdown
from torchparity.calibration.study import calibrate
from torchparity.calibration.training import TrainingSettings, study_training
from torchparity.comparison.tensor import json_safe


@dataclass(frozen=True)
class StudySettings:
    """What the main study draws and judges (see :func:`~.study.calibrate`).

    Args:
        draws: problems of each family.
        seed: the seed of the first draw.
        dtypes: the candidate dtypes.
        backend_names: the legitimate backends judged.
        flex_every: flex runs on every ``flex_every``-th draw only.
        families: the families of problems.
    """

    draws: int
    seed: int
    dtypes: list[str]
    backend_names: list[str]
    flex_every: int
    families: tuple[str, ...]


@dataclass(frozen=True)
class Destination:
    """Where a study's results go: the Markdown report, the JSON, and the command it quotes."""

    out: str | None = None
    json: str | None = None
    command: str = "torchparity calibrate"


def run_study(settings: StudySettings, destination: Destination) -> bool:
    """The main study printed and written; True without false alarms and with the detection
    goal met."""
    console = Console(stderr=True)
    with Progress(
        "calibrating", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=console
    ) as progress:
        task = progress.add_task("draws", total=settings.draws * len(settings.families))
        results = calibrate(
            settings.draws,
            seed=settings.seed,
            dtypes=settings.dtypes,
            backend_names=settings.backend_names,
            flex_every=settings.flex_every,
            families=settings.families,
            on_draw=lambda: progress.advance(task),
        )
    print_tables(results, Console())
    if destination.out:
        text = render_markdown(results, command=destination.command)
        path = Path(destination.out)
        document = path.read_text() if path.exists() else ""
        # the sections of the studies that write their own, kept
        for section in (sketched.SECTION, capabilities.SECTION, training_report.SECTION):
            if (kept := section.of(document)) is not None:
                text = section.merged(text, kept)
        _write(path, text)
    if destination.json:
        _write(Path(destination.json), json.dumps(json_safe(results.to_dict()), indent=2) + "\n")
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
    """The study per instruction set, each in its own process, merged into ``out``; True without
    false alarms."""
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


def run_training(settings: TrainingSettings, destination: Destination) -> bool:
    """The training study: its section printed and merged into the destination's report;
    True without false alarms."""
    with Progress(
        "training study", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=Console(stderr=True),
    ) as progress:
        task = progress.add_task("seeds", total=sum(settings.seeds.values()))
        results = study_training(settings, on_seed=lambda _: progress.advance(task))
    section = training_report.training_section(results, command=destination.command)
    print(section)
    if destination.out:
        path = Path(destination.out)
        _write(path, training_report.SECTION.merged(
            path.read_text() if path.exists() else "", section))
    if destination.json:
        _write(Path(destination.json), json.dumps(json_safe(results.to_dict()), indent=2) + "\n")
    return all(not v.diverged for v in results.verdicts if v.eps is None)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    tmp.replace(path)
