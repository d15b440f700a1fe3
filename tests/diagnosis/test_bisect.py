"""``diagnose --compile --bisect`` without compiling: the flags, the mapping of an application
to its graph, node and source line on small FX graphs, the report, and the bisector's state
machine driven by a scripted oracle (it never compiles: only the oracle's answers matter to
it) down to a verdict that changes between runs. The bisections that compile are in
test_bisect_compiled.py (slow but for one clean block)."""

from __future__ import annotations

import pytest
import torch
from torch import fx

from torchparity.cli import main
from torchparity.diagnosis.pipelines.bisect import applications, engine
from torchparity.diagnosis.pipelines.bisect.engine import BisectOutcome, NotBisected
from torchparity.diagnosis.pipelines.bisect.report import finding, lines, to_json
from torchparity.text import WIDTH

aten = torch.ops.aten


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    return err


def test_bisect_without_compile_is_one_line_and_exit_2(capsys):
    assert main(["diagnose", "tiny.py:make", "--bisect"]) == 2
    assert "add --compile" in _one_line_error(capsys)
    assert main(["diagnose", "tiny.py:make", "--compile"]) == 2
    assert "--compile takes --bisect" in _one_line_error(capsys)
    assert main(["diagnose", "a.py:make", "b.py:make", "--compile", "--bisect"]) == 2
    assert "one ENTRY" in _one_line_error(capsys)


def _graph(backward: bool) -> fx.Graph:
    """mm(x, w) as AOTAutograd names a forward's (primals) or a backward's (tangents)
    placeholders, the mm carrying the metadata dynamo gives a node."""
    graph = fx.Graph()
    x = graph.placeholder("tangents_1" if backward else "primals_1")
    w = graph.placeholder("primals_2")
    mm = graph.call_function(aten.mm.default, (x, w))
    mm.meta.update(original_aten=aten.mm.default, stack_trace=(
        '  File "/home/me/model.py", line 43, in forward\n    return self.proj(x)\n'
        f'  File "{torch.nn.modules.linear.__file__}", line 134, in forward\n'
        '    return F.linear(input, self.weight, self.bias)\n'))
    graph.output(mm)
    return graph


def test_a_graph_with_tangents_is_the_backward():
    assert applications.graph_kind(_graph(backward=True)) == "backward"
    assert applications.graph_kind(_graph(backward=False)) == "forward"


def test_the_source_line_is_the_innermost_frame_outside_torch():
    mm = next(n for n in _graph(False).nodes if n.target is aten.mm.default)
    assert applications.source_line(mm.meta["stack_trace"]) == (
        "/home/me/model.py", 43, "return self.proj(x)")
    assert applications.source_line(None) is None


def test_a_rewrite_is_found_at_the_node_it_changed():
    graph = _graph(False)
    before = applications.graph_snapshot(graph)
    mm = next(n for n in graph.nodes if n.target is aten.mm.default)
    with graph.inserting_before(mm):
        scaled = graph.call_function(aten.mul.Tensor, (mm.args[0], 1.01))
    mm.args = (scaled, mm.args[1])
    nodes = applications.rewritten(before, applications.graph_snapshot(graph))
    assert nodes == [mm]  # the mm, not the mul it now reads
    found = applications.describe_application("post_grad_passes", 7, "my_pass", "forward", nodes[0])
    assert (found.op, found.original_aten, found.file, found.line) == (
        "aten.mm.default", "aten.mm.default", "/home/me/model.py", 43)


def _outcome(**changes) -> BisectOutcome:
    application = {"subsystem": "post_grad_passes", "number": 7,
                   "name": "post_grad_custom_post_pass", "graph": "forward",
                   "op": "aten.erf.default", "original_aten": "aten.gelu.default",
                   "file": "/home/me/a/folder/deep/enough/to/need/wrapping/model.py",
                   "line": 43, "code": "h = F.gelu(self.up(x))"}
    fields = {"backend": "inductor", "subsystem": "post_grad_passes",
              "name": "post_grad_custom_post_pass", "number": 7, "application": application,
              "compiles": 15, "bound": 24, "seconds": 33.0, **changes}
    return BisectOutcome(**fields)


def test_the_finding_names_the_pass_graph_op_and_line():
    assert finding(_outcome()) == (
        "inductor, post_grad_passes: post_grad_custom_post_pass (forward graph) rewrote "
        "aten.gelu at /home/me/a/folder/deep/enough/to/need/wrapping/model.py:43")
    shown = lines(_outcome(), "model.py:make manual fp32 cpu compiled static")
    assert all(len(line) <= WIDTH for line in shown)
    assert "/home/me/a/folder/deep/enough/to/need/wrapping/model.py:43" in "\n".join(shown)
    found = to_json(_outcome())
    assert (found["pass"], found["graph"], found["compiles"]) == (
        "post_grad_custom_post_pass", "forward", 15)


def test_the_finding_of_a_lowering_names_the_op_lowered_and_its_origin():
    application = {"subsystem": "lowerings", "number": 33, "name": "aten.exp.default",
                   "graph": "forward", "op": "aten.exp.default",
                   "original_aten": "aten._softmax.default", "file": "/home/me/model.py",
                   "line": 62, "code": "weights = scores.softmax(-1)"}
    outcome = _outcome(subsystem="lowerings", name="aten.exp.default", number=33,
                       application=application)
    assert finding(outcome) == ("inductor, lowerings: the lowering of aten.exp from "
                                "aten._softmax (forward graph) at /home/me/model.py:62")


def test_torchparitys_own_frames_are_not_the_users_line():
    # A hand-written model's tensor methods run through torchparity's SDPA-redirecting mode:
    # its frame is innermost, the user's line is the one before it.
    from torchparity import backends
    from torchparity.reference import zoo

    assert applications.is_library(backends.__file__)
    assert not applications.is_library(zoo.__file__)  # the zoo's models are users' code
    trace = ('  File "/home/me/model.py", line 62, in forward\n'
             '    weights = scores.softmax(-1)\n'
             f'  File "{backends.__file__}", line 158, in __torch_function__\n'
             '    return getattr(args[0], name)(*args[1:], **kwargs)\n')
    assert applications.source_line(trace) == (
        "/home/me/model.py", 62, "weights = scores.softmax(-1)")


def test_nothing_bisected_is_null_in_the_json_and_says_what_it_compiled():
    nothing = BisectOutcome(compiles=1, graphs=1, compile_seconds=9.4)
    assert to_json(nothing) is None
    said = " ".join(" ".join(lines(nothing, "case cell")).split())  # wrapped at 80, joined
    assert "nothing to bisect (1 compiled run of the cell: 1 graph, 0 recompiles, 9 s " \
           "compiling)" in said


def test_an_oracle_that_passes_at_its_upper_bound_is_one_line_and_leaves_nothing(tmp_path):
    from torch._inductor.compiler_bisector import CompilerBisector

    # Dynamo and AOTAutograd pass, Inductor fails, fails again without pre_grad_passes,
    # passes without joint_graph_passes, then passes with every one of them on: the
    # verdict changed between runs.
    answers = iter([True, True, True, True, False, False, True, True])
    outcome = BisectOutcome(bound=10)
    with pytest.raises(NotBisected, match="^could not bisect: .*changes between runs"):
        engine._bisected(lambda state: next(answers), tmp_path / "bisector",
                         applications.Recorder(), outcome)
    assert next(answers, None) is None  # every answer asked for
    assert not (tmp_path / "bisector").exists()
    assert not CompilerBisector.bisection_enabled and CompilerBisector.in_process_cache is None
