"""Divergences in gradients: found, drilled down to their backward ops, or traced to the
forward divergence they follow from.

The model and its changes are in tests/diagnosis/grad_plants.py, the lines the answers should
name marked ``# planted`` there and read from its source, independently of the diagnosis.
"""

from __future__ import annotations

import copy
import inspect
import json
import os

import grad_plants as plants
import pytest
import torch

import torchparity as tp
from torchparity import cli
from torchparity.diagnosis.stages.ops.align import align_steps
from torchparity.diagnosis.stages.ops.backward import capture_backward
from torchparity.diagnosis.stages.ops.judge import golden_on_inputs, judge_ops

pytestmark = pytest.mark.usefixtures("single_thread")

PLANTS = inspect.getsourcefile(plants)


def planted_line(function: object) -> str:
    """``path:line`` of the line marked ``# planted`` in ``function``'s source."""
    lines, start = inspect.getsourcelines(function)
    offset = next(i for i, line in enumerate(lines) if "# planted" in line)
    return f"{os.path.relpath(PLANTS)}:{start + offset}"


def diagnosed(b: str, tmp_path, capsys) -> tuple[int, dict, str]:
    """The command's exit status, its JSON, and its terminal output with each run of
    whitespace one space (sentences wrap at spaces, never inside a path)."""
    status = cli.main(["diagnose", f"{PLANTS}:make_a", f"{PLANTS}:make_b_{b}",
                       "--json", str(tmp_path / "d.json")])
    out = capsys.readouterr().out
    return status, json.loads((tmp_path / "d.json").read_text()), " ".join(out.split())


def test_a_backward_only_change_is_found_at_the_line_of_its_backward(tmp_path, capsys) -> None:
    """A custom autograd.Function, its forward exact and its backward 2% off: nothing in the
    forward diverges, the gradient does, at the module that calls it, and the drill-down names
    the line of ``backward`` (user code) as B's."""
    status, report, out = diagnosed("custom_backward", tmp_path, capsys)
    assert status == 1, out
    assert report["first_divergence"] is None
    grad = report["first_grad_divergence"]
    assert grad["module"] == "blocks.1.act", out
    op = grad["op"]
    assert op["found"] and op["follows_forward"] is None, op
    line = planted_line(plants.ScaledGelu.backward)
    assert op["b_stack"][0] == line, op
    assert "First gradient divergence: blocks.1.act." in out
    assert (f"In its backward pass: It enters at blocks.1.act (backward), in {op['name']} "
            f"(B: {line} ") in out, out


def test_a_forward_change_s_gradient_follows_from_the_forward_divergence(tmp_path,
                                                                          capsys) -> None:
    """tanh GELU for exact GELU: the gradient of the module diverges because its forward
    does, and the answer says so and points at the forward's op and line."""
    status, report, out = diagnosed("tanh", tmp_path, capsys)
    assert status == 1, out
    line = planted_line(plants.GeluTanh.forward)
    assert report["first_divergence"]["op"]["b_stack"][0] == line
    grad = report["first_grad_divergence"]
    assert grad["module"] == "blocks.1.act", out
    assert not grad["op"]["found"], grad
    assert grad["op"]["follows_forward"] == {
        "module": "blocks.1.act", "op": "aten::gelu", "line": line,
        "code": 'return F.gelu(x, approximate="tanh")  # planted'}
    assert ("First gradient divergence: blocks.1.act, which follows from the forward "
            "divergence of blocks.1.act.") in out
    assert ("In its backward pass: Its gradient follows from the forward divergence of "
            f"blocks.1.act, which enters at aten::gelu ({line} ") in out, out


def test_an_exact_rewrite_of_the_math_is_clean(tmp_path, capsys) -> None:
    """GELU written out with erf: the same math in other ops, forward and backward."""
    status, report, out = diagnosed("rewritten", tmp_path, capsys)
    assert status == 0, out
    assert report["first_divergence"] is None and report["first_grad_divergence"] is None
    assert "No gradient diverges locally." in out


def judged_block_backward(act: type[torch.nn.Module]) -> tuple[list, int | None]:
    """A block's backward ops, B's activation ``act``, aligned and judged as a drill-down
    judges them: A's and B's on the same input and output gradient, a float64 copy of A's
    as the golden."""
    torch.manual_seed(0)
    block_a = plants.Block(8)
    block_b = copy.deepcopy(block_a)
    block_b.act = act()
    x = torch.randn(2, 5, 8)
    grad_out = {"output": torch.randn(2, 5, 8)}
    steps_a, steps_b = (capture_backward(m, (x,), {}, grad_out) for m in (block_a, block_b))
    golden = capture_backward(copy.deepcopy(block_a).double(), (x.double(),), {},
                              {p: g.double() for p, g in grad_out.items()})
    partners = {p.a.index: p.b for p in align_steps(steps_a, golden) if p.a and p.b}
    for step in steps_a:
        step.local_golden = golden_on_inputs(step, partners.get(step.index))
    return judge_ops(align_steps(steps_a, steps_b), partners)


def test_a_backward_op_that_differs_itself_is_named_not_one_that_inherits() -> None:
    """A block's backward with tanh GELU: the next linear's weight gradient (an ``mm`` that
    reads the changed activation the forward saved) diverges first, but on A's inputs it
    computes what A's does; ``gelu_backward``, whose own arguments differ, is the answer, at
    the forward line it differentiates."""
    lines, first = judged_block_backward(plants.GeluTanh)
    assert first is not None
    answer = lines[first]
    assert answer.pair.name == "aten::gelu_backward", [line.pair.name for line in lines]
    assert answer.pair.b.stack[0].text == 'return F.gelu(x, approximate="tanh")  # planted'
    inherited = [line for line in lines[:first] if line.propagated is not None
                 and not line.propagated.ok]
    assert any(line.pair.name == "aten::mm" for line in inherited), [
        (line.pair.name, line.propagated) for line in lines]
    assert all(line.local is None or line.local.ok for line in inherited)


def test_a_backward_whose_ops_only_inherit_a_forward_change_names_none() -> None:
    """GELU shifted up: its own backward is A's; the weight gradient of the next linear
    diverges through the saved activation alone, so no backward op is named."""
    lines, first = judged_block_backward(plants.GeluShifted)
    assert first is None, lines[first].pair.name
    diverged = [line for line in lines if line.propagated is not None
                and not line.propagated.ok]
    mms = [line for line in diverged if line.pair.name == "aten::mm"]
    assert mms and all(line.reads_divergent for line in mms), [
        (line.pair.name, line.propagated) for line in lines]


def test_against_a_trace_the_backward_line_is_named_as_in_process(tmp_path) -> None:
    """The custom Function's backward drilled with A's backward ops from ``record --ops``:
    the same answer as in one process."""
    model_a, inputs = plants.make_a()
    model_b, _ = plants.make_b_custom_backward()
    trace = tp.record(model_a, inputs, tmp_path / "t", ops="blocks.1.act")
    against = tp.diagnose_against(trace, model_b, inputs)
    in_process = tp.diagnose(model_a, model_b, inputs)
    op, expected = (r.to_dict()["first_grad_divergence"]["op"] for r in (against, in_process))
    assert op is not None and op["found"], against.render()
    assert op["b_stack"][0] == planted_line(plants.ScaledGelu.backward)
    same = ("module", "name", "kind", "a_stack", "b_stack", "code", "follows_forward")
    assert {k: op[k] for k in same} == {k: expected[k] for k in same}, against.render()
