"""What each numbered application of an Inductor subsystem did, and on which graph.

The bisector numbers a subsystem's applications in a run (each pass through
``GraphTransformObserver``, each aten node lowered) and answers a subsystem and a number.
:class:`Recorder` keeps, by the same numbering, the graph and the FX nodes rewritten with
their ``original_aten`` and ``stack_trace``, so the number is named:
``post_grad_custom_post_pass (forward graph) rewrote aten.gelu at model.py:43``."""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import fx

#: Subsystems whose applications each run on one graph of AOTAutograd's split: forward
#: (an inference graph is a forward graph too) or backward.
SPLIT_SUBSYSTEMS = ("post_grad_passes", "lowerings")
#: Where the other numbered subsystems run: before autograd traces the backward, or on the
#: joint graph of both.
GRAPH_OF = {"pre_grad_passes": "pre-grad", "joint_graph_passes": "joint",
            "decomposition": "joint"}


@dataclass
class Application:
    """One application: its subsystem, number, name (pass or op), graph, and the first node it
    rewrote with the user's file and line where kept."""

    subsystem: str
    number: int
    name: str
    graph: str | None = None
    op: str | None = None
    original_aten: str | None = None
    file: str | None = None
    line: int | None = None
    code: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def graph_kind(graph: fx.Graph) -> str:
    """``backward`` for a graph AOTAutograd partitioned as the backward (``tangents_N``
    placeholders), else ``forward``."""
    backward = any(node.op == "placeholder" and str(node.target).startswith("tangents")
                   for node in graph.nodes)
    return "backward" if backward else "forward"


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')
_TORCHPARITY = Path(__file__).parents[3]  # .../torchparity/diagnosis/pipelines/bisect
#: Frames of torch and of torchparity (the attention backend that runs a model's SDPA, say)
#: are not the user's line; those of the zoo's models (torchparity/reference) are.
LIBRARIES = tuple(str(root.resolve()) + os.sep for root in (Path(torch.__file__).parent,
                                                           _TORCHPARITY))
MODELS = str((_TORCHPARITY / "reference").resolve()) + os.sep


def is_library(path: str) -> bool:
    """Whether ``path`` is torch's or torchparity's code rather than a model's."""
    resolved = str(Path(path).resolve())
    return resolved.startswith(LIBRARIES) and not resolved.startswith(MODELS)


def source_line(stack_trace: str | None) -> tuple[str, int, str] | None:
    """The innermost frame of a node's ``stack_trace`` outside torch and torchparity (file, line,
    code), or None."""
    if not stack_trace:
        return None
    lines = stack_trace.strip().splitlines()
    for index in range(len(lines) - 1, -1, -1):
        found = _FRAME.search(lines[index])
        if found and not is_library(found["file"]):
            code = lines[index + 1].strip() if index + 1 < len(lines) else ""
            return found["file"], int(found["line"]), code
    return None


#: A node as a pass may change it: its target, its arguments, and its metadata.
Snapshot = dict[str, tuple[str, str, fx.Node]]


def graph_snapshot(graph: fx.Graph) -> Snapshot:
    """Each call node of ``graph`` by name, with its target and arguments as text."""
    return {node.name: (str(node.target), repr((node.args, node.kwargs)), node)
            for node in graph.nodes if node.op == "call_function"}


def rewritten(before: Snapshot, after: Snapshot) -> list[fx.Node]:
    """The nodes of ``before`` a pass erased or changed, in graph order; else those it added."""
    changed = [node for name, (target, args, node) in before.items()
               if name not in after or after[name][:2] != (target, args)]
    return changed or [node for name, (_, _, node) in after.items() if name not in before]


def describe_application(subsystem: str, number: int, name: str, graph: str | None,
             node: fx.Node | None) -> Application:
    """The :class:`Application` of ``node`` (None: the application rewrote nothing)."""
    application = Application(subsystem, number, name, graph)
    if node is None:
        return application
    application.op = str(node.target)
    original = node.meta.get("original_aten")
    application.original_aten = str(original) if original is not None else None
    frame = source_line(node.meta.get("stack_trace"))
    if frame:
        application.file, application.line, application.code = frame
    return application


class Recorder:
    """Every numbered application of the runs inside :meth:`watching`, numbered as the bisector
    does (call :meth:`new_run` before each run); the last run applying a number is kept."""

    def __init__(self) -> None:
        self.applications: dict[tuple[str, int], Application] = {}
        self.counts: dict[str, int] = {}
        self._pending: tuple[str, int, bool] | None = None

    def new_run(self) -> None:
        self.counts = {}

    def most(self) -> int:
        """The most applications any subsystem had in the last run."""
        return max(self.counts.values(), default=0)

    def _number(self, subsystem: str, disabled: bool) -> int:
        number = self.counts.get(subsystem, 0)
        self.counts[subsystem] = number + 1
        self._pending = (subsystem, number, disabled)
        return number

    @contextlib.contextmanager
    def watching(self) -> Iterator[Recorder]:
        """The bisector's decision and Inductor's pass runner wrapped for the block: each decision
        numbered, each pass's graph compared before and after."""
        from torch._inductor.compiler_bisector import CompilerBisector
        from torch.fx.passes.graph_transform_observer import GraphTransformObserver

        decision = vars(CompilerBisector)["disable_subsystem"]  # the classmethod itself
        decide = CompilerBisector.disable_subsystem
        apply_graph, apply_gm = (GraphTransformObserver.apply_graph_pass,
                                 GraphTransformObserver.apply_gm_pass)
        recorder = self

        def disable_subsystem(cls, backend, subsystem, debug_info=None):
            disabled = decide(backend, subsystem, debug_info)
            number = recorder._number(subsystem, disabled)
            if subsystem == "lowerings" and not disabled:
                recorder._lowered(number)
            return disabled

        def observed(apply):
            def run(observer, pass_fn):
                recorder._pending = None
                before = graph_snapshot(observer.gm.graph)
                result = apply(observer, pass_fn)
                if recorder._pending and recorder._pending[0] == observer.subsystem:
                    subsystem, number, disabled = recorder._pending
                    if not disabled:
                        graph = GRAPH_OF.get(subsystem) or graph_kind(observer.gm.graph)
                        nodes = rewritten(before, graph_snapshot(observer.gm.graph))
                        recorder.applications[subsystem, number] = describe_application(
                            subsystem, number, observer.passname, graph,
                            nodes[0] if nodes else None)
                return result
            return run

        CompilerBisector.disable_subsystem = classmethod(disable_subsystem)
        GraphTransformObserver.apply_graph_pass = observed(apply_graph)
        GraphTransformObserver.apply_gm_pass = observed(apply_gm)
        try:
            yield self
        finally:
            CompilerBisector.disable_subsystem = decision
            GraphTransformObserver.apply_graph_pass = apply_graph
            GraphTransformObserver.apply_gm_pass = apply_gm

    def _lowered(self, number: int) -> None:
        """The node Inductor is lowering now (its graph sets it current around the call)."""
        from torch._inductor.virtualized import V

        node = V.graph.current_node
        graph = "backward" if V.graph.is_backward else "forward"
        self.applications["lowerings", number] = describe_application(
            "lowerings", number, str(node.target), graph, node)
