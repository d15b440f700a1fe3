"""The signs tell the truth: every option the README and docs/ name exists, every default a
``--help`` states is the parser's, and the README's exit-status table has every status the
command line returns."""

from __future__ import annotations

import argparse
import ast
import functools
import io
import math
import re
from pathlib import Path

import pytest
import torch
from rich.console import Console
from torch import nn

import torchparity as tp
from torchparity import cli

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "src" / "torchparity"
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

#: ``torchparity COMMAND [ACTION]`` (not ``torchparity COMMAND:``, the start of a message).
_INVOCATION = re.compile(r"(?:^|(?<=[\s(/|;&`]))torchparity\s+([a-z]+)\b(?!:)(?:\s+([a-z]+)\b)?")
#: A span that starts with a command's bare name and goes on with an option, a placeholder
#: (``ENTRY``, ``A B``) or an action: ``train --check --base REV``, ``golden update --model``.
_BARE = re.compile(r"^([a-z]+)\s+(?=--|[A-Z]+\b|([a-z]+)\b)")
_FLAG = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*)")
#: Where a shell line stops being the command: a pipe, a next command, a comment.
_END = re.compile(r"\s(?:\||&&|;|#)\s|\s#")
_DEFAULT = re.compile(r"\bdefault:?\s+([^\s;,)]+)")


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((action.choices for action in parser._actions
                 if isinstance(action, argparse._SubParsersAction)), {})


@functools.cache
def _parsers(name: str) -> dict[str, argparse.ArgumentParser]:
    """The parser ``torchparity NAME --help`` prints, and each of its actions' (``golden
    update``), by the words that run them."""
    parser = _subparsers(cli.build_parser([name]))[name]
    return {name: parser, **{f"{name} {action}": sub
                             for action, sub in _subparsers(parser).items()}}


def _parser(command: str) -> argparse.ArgumentParser | None:
    """The parser of ``command`` (``check``, ``golden update``); None for no command."""
    name = command.split()[0]
    return _parsers(name).get(command) if name in cli.COMMANDS else None


#: Options taken anywhere on the line.
GLOBAL = {"--debug", "--help", "--version"}


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {flag for action in parser._actions for flag in action.option_strings}


def _code(text: str) -> list[str]:
    """The shell lines of fenced blocks (continuations joined) and the inline code spans of
    the text around them (a span may run over a line break)."""
    pieces, prose = [], []
    for number, part in enumerate(re.split(r"^```[^\n]*$", text, flags=re.MULTILINE)):
        if number % 2:
            pieces += part.replace("\\\n", " ").splitlines()
        else:
            prose.append(part)
    spans = re.findall(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", "\n".join(prose), re.DOTALL)
    pieces += [" ".join(span.split()) for _, span in spans]
    return pieces


def _invocations(piece: str) -> list[tuple[str, str]]:
    """``(command, what follows it)`` for each command the piece runs, the command with its
    action where it has actions."""
    found = [(m.start(), m.end(), m.group(1), m.group(2)) for m in _INVOCATION.finditer(piece)]
    bare = _BARE.match(piece)
    if not found and bare and bare.group(1) in cli.COMMANDS:
        action = bare.group(2)
        if action is None or _parser(f"{bare.group(1)} {action}"):
            found = [(0, bare.end(), bare.group(1), action)]
    invocations = []
    for i, (_, end, command, action) in enumerate(found):
        if command not in cli.COMMANDS:
            continue
        rest = piece[end:found[i + 1][0]] if i + 1 < len(found) else piece[end:]
        rest = _END.split(rest)[0]
        if _parser(f"{command} {action}"):
            command = f"{command} {action}"
        invocations.append((command, rest))
    return invocations


def _documented_options() -> list[tuple[str, str, str]]:
    """``(file, command, option)`` for each option a doc gives a command."""
    named = []
    for path in DOCS:
        for piece in _code(path.read_text(encoding="utf-8")):
            for command, rest in _invocations(piece):
                named += [(path.name, command, flag) for flag in _FLAG.findall(rest)]
    return named


def test_the_docs_name_options_the_commands_have():
    named = _documented_options()
    assert len({command for _, command, _ in named}) >= 8  # the scan reads the docs at all
    missing = sorted({f"{doc}: torchparity {command} {flag}" for doc, command, flag in named
                      if flag not in _options(_parser(command)) | GLOBAL})
    assert not missing, "options the docs name that the command does not take:\n" + "\n".join(
        missing)


def _same(stated: str, default: object) -> bool:
    if isinstance(default, bool | int | float):
        try:
            return math.isclose(float(stated), float(default))
        except ValueError:
            return False
    return stated == str(default)


@pytest.mark.parametrize("name", cli.COMMANDS)
def test_every_help_prints_and_states_the_parsers_defaults(name, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")  # a CI log
    wrong = []
    for command, parser in _parsers(name).items():
        lines = parser.format_help().splitlines()
        assert lines[0].startswith(f"usage: torchparity {command}")
        assert [line for line in lines if len(line) > 80 and " " in line.strip()] == []
        for action in parser._actions:
            if action.default is None or action.default is False or not action.help:
                continue  # decided when the command runs, or a flag
            wrong += [f"torchparity {command} {'/'.join(action.option_strings)}: the help says "
                      f"default {stated}, the parser's is {action.default!r}"
                      for stated in _DEFAULT.findall(action.help)
                      if not _same(stated, action.default)]
    assert not wrong, "\n".join(wrong)


def _statuses_returned() -> set[int]:
    """The exit statuses the code gives: the integers ``main`` and each command's ``run``
    return, the ``EXIT_*`` constants of the command line and the errors' ``exit_status``."""
    statuses = set()
    sources = [PACKAGE / "cli.py", PACKAGE / "errors.py",
               *(PACKAGE / "commands").rglob("*.py")]
    for path in sources:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in ("main", "run"):
                statuses |= {c.value for ret in ast.walk(node) if isinstance(ret, ast.Return)
                             for c in ast.walk(ret) if isinstance(c, ast.Constant)
                             and type(c.value) is int}
            elif isinstance(node, ast.Assign):
                names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                names += [e.id for t in node.targets if isinstance(t, ast.Tuple)
                          for e in t.elts if isinstance(e, ast.Name)]
                if any(n.startswith("EXIT_") or n == "exit_status" for n in names):
                    statuses |= {c.value for c in ast.walk(node.value)
                                 if isinstance(c, ast.Constant) and type(c.value) is int}
    return statuses


def test_the_exit_status_table_has_every_status_the_code_returns():
    returned = _statuses_returned()
    assert {0, 1, 2, 3, 130} <= returned  # the scan finds the statuses it knows of
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    table = re.search(r"^\| exit status \|.*?(?=^[^|])", readme, re.MULTILINE | re.DOTALL)
    assert table, "README.md has no table headed '| exit status |'"
    listed = {int(code) for code in re.findall(r"^\| (\d+) \|", table.group(0), re.MULTILINE)}
    assert listed == returned
    assert {int(code) for code in re.findall(r"\b(\d+) ", cli.EXIT_STATUSES)} == returned


def test_a_diagnosis_prints_no_line_that_ends_in_a_space():
    # A CI log keeps the space rich leaves where it wraps a line or pads a table's row.
    def model(scale: float) -> nn.Module:
        layers = tp.init_weights(nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4)), 0)
        with torch.no_grad():
            layers[2].weight.mul_(scale)
        return layers

    report = tp.diagnose(model(1.0), model(1.01), (tp.random_tensor((2, 8), 1),))
    out = io.StringIO()
    report.print(Console(file=out, width=80))
    lines = out.getvalue().splitlines()
    assert len(" ".join(report.findings(ops=False))) > 80  # the summary is wrapped
    assert [line for line in lines if line != line.rstrip()] == []
