"""The import rule of docs/architecture.md, read from the package's own source with ``ast``.

Every module of ``src/torchparity`` sits on a floor (:data:`FLOORS`, drawn as the page draws
them); a module imports only from its own floor or the floors below, and no modules import each
other in a circle. Every ``import`` statement counts, at any depth: inside a function (an import
deferred for speed is still a dependency) and under ``if TYPE_CHECKING:``, because a module
annotated with a type of a higher floor is written against that floor's interface, and two
modules that name each other's types cannot be read, moved or tested apart, whether or not
Python executes the import. The package's root ``torchparity/__init__.py`` is the public face:
it re-exports lazily through ``importlib`` and imports no module of its own (asserted below),
so ``import torchparity`` (for ``__version__``) adds no edge.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "torchparity"

#: Each floor's name and its top-level modules and sub-packages of torchparity, top first.
#: The wings stand on floors of their own: training imports diagnosis and the goldens, a
#: diagnosis imports the goldens (a check cell's verdict as a bisection's oracle), never back.
FLOORS = (
    ("top", ("commands", "cli", "pytest_plugin", "__main__")),
    ("studies", ("calibration", "bench", "ci")),
    ("training", ("train",)),
    ("diagnosis", ("diagnosis", "revisions")),
    ("goldens", ("golden", "twins")),
    ("shared", ("comparison", "subject", "distributed", "strategies")),
    ("bottom", ("backends", "tolerance", "sketching", "digests", "memory", "machine", "dtypes",
                "errors", "collector", "reference", "text", "threads", "pages")),
)

#: Circles that remain, each deleted with the change that removes it (the test fails until it
#: is), and the set with the last one.
KNOWN_CYCLES: set[frozenset[str]] = set()


@dataclasses.dataclass(frozen=True)
class Import:
    """One module importing another, where it says so."""

    importer: str
    imported: str
    path: Path
    line: int

    def __str__(self) -> str:
        return f"{self.path.relative_to(PACKAGE.parents[1])}:{self.line}: {self.importer} " \
               f"imports {self.imported}"


def module_names() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its ``__init__``)."""
    names = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def imports_of(name: str, path: Path, modules: dict[str, Path],
               source: str | None = None) -> list[Import]:
    """The torchparity modules ``name`` (at ``path``, or written as ``source``) imports, in
    line order: ``from pkg import sub`` names the module ``pkg.sub`` where there is one, else
    the package ``pkg``."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.rsplit(".", node.level - 1)[0]  # level 1: the package
                base = f"{anchor}.{base}".rstrip(".")
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]  # import a.b.c names the module a.b
            if target.split(".")[0] == "torchparity" and target != name:
                found.add(Import(name, target, path, node.lineno))
    return sorted(found, key=lambda edge: (edge.line, edge.imported))


def floor_of(name: str) -> int | None:
    """The floor of a module (0 is the top); None for the package's root."""
    parts = name.split(".")
    if len(parts) == 1:
        return None
    for index, (_, members) in enumerate(FLOORS):
        if parts[1] in members:
            return index
    raise AssertionError(f"{name} is on no floor: add torchparity.{parts[1]} to FLOORS in "
                         "tests/test_architecture.py and to docs/architecture.md")


@pytest.fixture(scope="module")
def edges() -> list[Import]:
    modules = module_names()
    return [edge for name, path in modules.items() for edge in imports_of(name, path, modules)]


def cycles(edges: list[Import]) -> list[set[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    graph: dict[str, set[str]] = {}
    for edge in edges:
        graph.setdefault(edge.importer, set()).add(edge.imported)
        graph.setdefault(edge.imported, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for successor in sorted(graph[node]):
            if successor not in index:
                visit(successor)
                low[node] = min(low[node], low[successor])
            elif successor in stack:
                low[node] = min(low[node], index[successor])
        if low[node] == index[node]:
            component = {stack.pop()}
            while node not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(component)

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_module_is_on_a_floor() -> None:
    for name in module_names():
        floor_of(name)


def test_the_root_imports_no_module_of_its_own() -> None:
    modules = module_names()
    assert imports_of("torchparity", modules["torchparity"], modules) == []


def test_no_module_imports_a_higher_floor(edges: list[Import]) -> None:
    upward = [edge for edge in edges if floor_of(edge.imported) is not None
              and floor_of(edge.imported) < floor_of(edge.importer)]
    assert not upward, "imports from a higher floor (docs/architecture.md):\n" + "\n".join(
        f"{edge}: the {FLOORS[floor_of(edge.imported)][0]} floor is above the "
        f"{FLOORS[floor_of(edge.importer)][0]} one" for edge in upward)


def test_no_modules_import_each_other_in_a_circle(edges: list[Import]) -> None:
    found = cycles(edges)
    unknown = [c for c in found if frozenset(c) not in KNOWN_CYCLES]
    assert not unknown, "modules that import each other in a circle:\n" + "\n\n".join(
        "\n".join(str(e) for e in edges if e.importer in c and e.imported in c)
        for c in unknown)
    gone = KNOWN_CYCLES - {frozenset(c) for c in found}
    assert not gone, ("circles gone: delete them from KNOWN_CYCLES in "
                      f"tests/test_architecture.py: {[sorted(c) for c in gone]}")


def test_the_reader_finds_what_python_imports() -> None:
    # The reader's own check on modules whose imports are known: relative, deferred,
    # TYPE_CHECKING and `from package import submodule` forms.
    source = ("from __future__ import annotations\nfrom typing import TYPE_CHECKING\n"
              "from . import settings\nfrom ..dtypes import torch_dtype\n"
              "if TYPE_CHECKING:\n    from torchparity.golden import store\n"
              "def f():\n    import torchparity.reference.zoo as zoo\n")
    modules = {"torchparity.bench.x": PACKAGE / "bench" / "x.py",
               "torchparity.bench.settings": Path(), "torchparity.dtypes": Path(),
               "torchparity.golden": Path(), "torchparity.golden.store": Path(),
               "torchparity.reference": Path(), "torchparity.reference.zoo": Path()}
    tree = PACKAGE / "bench" / "x.py"
    found = imports_of("torchparity.bench.x", tree, modules, source)
    assert [(e.imported, e.line) for e in found] == [
        ("torchparity.bench.settings", 3), ("torchparity.dtypes", 4),
        ("torchparity.golden.store", 6), ("torchparity.reference.zoo", 8)]
    graph = [Import("a", "b", tree, 1), Import("b", "c", tree, 1), Import("c", "a", tree, 1),
             Import("c", "d", tree, 1)]
    assert cycles(graph) == [{"a", "b", "c"}]


DIAGNOSIS = "torchparity.diagnosis"


def room_of(name: str) -> tuple[str, str] | None:
    """A diagnosis module's room (core, stages, reports, pipelines) and, in stages and
    pipelines, which stage or pipeline it belongs to; None outside diagnosis/."""
    parts = name.split(".")
    if parts[:2] != DIAGNOSIS.split(".") or len(parts) < 3:
        return None
    return parts[2], parts[3] if len(parts) > 3 else ""


#: Which rooms of diagnosis/ each room may import: the pipelines call the stages, the stages
#: use the core, the reports read the core's results; nothing points up.
DIAGNOSIS_ROOMS = {
    "pipelines": {"pipelines", "stages", "reports", "core"},
    "stages": {"stages", "reports", "core"},
    "reports": {"reports", "core"},
    "core": {"core"},
}


def test_diagnosis_rooms_point_one_way(edges: list[Import]) -> None:
    wrong = []
    for edge in edges:
        importer, imported = room_of(edge.importer), room_of(edge.imported)
        if importer is None or imported is None or importer[0] not in DIAGNOSIS_ROOMS:
            continue
        if imported[0] not in DIAGNOSIS_ROOMS[importer[0]]:
            wrong.append(f"{edge}: {importer[0]}/ may not import {imported[0]}/")
    assert not wrong, "diagnosis/ rooms imported against their order:\n" + "\n".join(wrong)


def test_no_stage_of_a_diagnosis_imports_another(edges: list[Import]) -> None:
    """A stage is called by the pipelines, never by another stage: what two stages share
    lives in core/."""
    reaching = [edge for edge in edges
                if (room_of(edge.importer) or ("",))[0] == "stages"
                and (room_of(edge.imported) or ("",))[0] == "stages"
                and room_of(edge.importer) != room_of(edge.imported)]
    assert not reaching, ("a stage of diagnosis imports another: move what they share into "
                          "diagnosis/core/:\n" + "\n".join(str(edge) for edge in reaching))


def test_the_diagnosis_rooms_hold_every_module() -> None:
    loose = [name for name in module_names()
             if name.startswith(f"{DIAGNOSIS}.") and room_of(name)[0] not in DIAGNOSIS_ROOMS]
    assert not loose, f"diagnosis modules outside core/, stages/, reports/, pipelines/: {loose}"


#: A module of commands/ parses its command's arguments and makes one call into a wing; it
#: stays under this many lines (what grows past it is a wing's work).
COMMAND_LINES = 150


def test_every_command_module_is_thin() -> None:
    lines = {str(path.relative_to(PACKAGE)): len(path.read_text().splitlines())
             for path in sorted((PACKAGE / "commands").rglob("*.py"))}
    long = {name: n for name, n in lines.items() if n >= COMMAND_LINES}
    assert not long, (f"command modules of {COMMAND_LINES} lines or more: move their work into "
                      f"a wing: {long}")


#: Names every command module defines, the protocol cli.py calls (as a pytest plugin's hooks).
COMMAND_PROTOCOL = {"add_arguments", "run"}
#: Public names still defined in two modules, each deleted with the change that renames it.
#: `get` and `names` are always called qualified, as catalogues: `zoo.get`, `variants.get`,
#: `backends.names()`; `dtypes` is a strategy of both public strategy modules (torch dtypes
#: in `torchparity.strategies`, their names in `torchparity.twins.strategies`).
#: `main` is the `python -m` entry of a module a worker process runs (cli.py, a bisection's
#: worker, a training rank).
TWICE_DEFINED: set[str] = {"get", "names", "dtypes", "main"}


def test_no_public_name_is_defined_twice() -> None:
    where: dict[str, list[str]] = {}
    for name, path in module_names().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and not node.name.startswith("_"):
                if name.startswith("torchparity.commands.") and node.name in COMMAND_PROTOCOL:
                    continue
                where.setdefault(node.name, []).append(name)
    twice = {n: m for n, m in where.items() if len(m) > 1 and n not in TWICE_DEFINED}
    assert not twice, "public names defined in two or more modules: rename one:\n" + "\n".join(
        f"{n}: {', '.join(m)}" for n, m in sorted(twice.items()))


#: torch.distributed's set-up, which only the distributed home calls: one backend choice, one
#: timeout (torchparity/distributed/group.py).
PROCESS_GROUP_CALLS = {"init_process_group", "destroy_process_group", "new_group"}


def test_only_the_distributed_home_sets_up_process_groups() -> None:
    calls = []
    for name, path in module_names().items():
        if name == "torchparity.distributed" or name.startswith("torchparity.distributed."):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in PROCESS_GROUP_CALLS:
                calls.append(f"{path.relative_to(PACKAGE.parents[1])}:{node.lineno}: {node.attr}")
    assert not calls, ("torch.distributed set up outside torchparity/distributed/: call "
                       "group.join() and group.leave():\n" + "\n".join(calls))
