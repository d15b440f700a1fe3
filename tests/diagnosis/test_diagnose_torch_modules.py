"""A divergence inside a module of torch's own (or of an installed package) is drilled into.

Each plant (tests/diagnosis/torch_module_plants.py) builds one of a block's torch modules with
other arguments on the line marked ``# planted``; the expected lines (the block's call of the
module, the constructor's line on each side) are read from the plants' source, independently
of the diagnosis. The op and its arguments come from the torch functions the modules call.
"""

from __future__ import annotations

import copy
import inspect
import os
import re

import pytest
import torch
import torch_module_plants as plants

import torchparity as tp
from torchparity.diagnosis.stages.ops.capture import display_path

pytestmark = pytest.mark.usefixtures("single_thread")


def source_line(cls: type, method: str, marker: str) -> str:
    """``path:line`` of the first line of ``cls.method`` that contains ``marker``."""
    return source(cls, method, marker)[0]


def source(cls: type, method: str, marker: str) -> tuple[str, str]:
    """``path:line`` and the text of the first line of ``cls.method`` containing ``marker``."""
    lines, start = inspect.getsourcelines(vars(cls)[method])
    offset = next(i for i, line in enumerate(lines) if marker in line)
    return f"{os.path.relpath(inspect.getsourcefile(cls))}:{start + offset}", \
        lines[offset].strip()


def drilled(plant: type) -> dict:
    model_a, model_b, ids = plants.pair(plant)
    report = tp.diagnose(model_a, model_b, (ids,), backward=False)
    op = report.to_dict()["first_divergence"]["op"]
    assert op is not None and op["found"], report.render()
    return op


@pytest.mark.parametrize("plant, module, argument", [
    (plants.LayerNormEps, "ln2", "eps 1e-05 (A) vs 0.001 (B)"),
    # torch's RMSNorm adds its eps (cast to float32) in an op of its own on the CPU, or
    # hands it to a fused kernel: the argument's name is that op's
    (plants.RMSNormEps, "ln1", " 1e-06 (A) vs 0.1 (B)"),
])
def test_an_eps_inside_a_torch_norm_is_named_at_its_op_call_and_constructor(
        plant: type, module: str, argument: str) -> None:
    op = drilled(plant)
    assert op["module"] == module and op["kind"] == "differs", op
    assert len(op["arguments"]) == 1 and op["arguments"][0].endswith(argument), op
    called = source_line(plants.Block, "forward", f"self.{module}(")
    assert op["a_stack"] == op["b_stack"] == [called], op
    built = {"a": source(plants.Block, "__init__", f"self.{module} ="),
             "b": source(plant, "__init__", "# planted")}
    assert op["built"] == {side: {"at": at, "code": code}
                           for side, (at, code) in built.items()}, op


def test_a_max_norm_of_an_embedding_is_named_at_its_renorm_only_in_b() -> None:
    """nn.Embedding's max_norm renormalises the rows it looks up, in place, in B only: the
    lookup that reads the weight it wrote diverges."""
    op = drilled(plants.EmbeddingMaxNorm)
    assert (op["module"], op["name"], op["kind"]) == \
        ("embed", "aten::embedding_renorm_", "only in B"), op
    assert op["b_stack"] == [source_line(plants.Block, "forward", "self.embed(")], op
    assert op["built"]["b"]["at"] == source_line(plants.EmbeddingMaxNorm, "__init__",
                                                 "# planted")


def test_a_linear_without_its_bias_is_named_at_its_addmm_only_in_a() -> None:
    """A's addmm adds the bias that B's mm lacks; the view A's Linear returns is only its
    reader."""
    op = drilled(plants.LinearNoBias)
    assert (op["module"], op["name"], op["kind"]) == ("down", "aten::addmm", "only in A"), op
    assert op["a_stack"] == [source_line(plants.Block, "forward", "self.down(")], op
    assert op["built"]["b"]["code"] == "self.down = nn.Linear(2 * d, d, bias=False)  # planted"


def test_a_torch_module_changed_after_it_was_built_has_one_constructor_line() -> None:
    """B's eps set on the built module: both sides were built by the same line, said once."""
    model_a, _, ids = plants.pair(plants.Block)
    model_b = copy.deepcopy(model_a)
    model_b.ln2.eps = 1e-3
    report = tp.diagnose(model_a, model_b, (ids,), backward=False)
    op = report.to_dict()["first_divergence"]["op"]
    assert op["arguments"] == ["eps 1e-05 (A) vs 0.001 (B)"]
    built = source_line(plants.Block, "__init__", "self.ln2 =")
    assert op["built"]["a"] == op["built"]["b"] and op["built"]["a"]["at"] == built
    printed = " ".join(text for text, _ in report.table_lines(80))
    assert f"ln2 was built at {built}" in " ".join(printed.split()), printed


def test_the_command_line_says_call_and_constructor_lines_whole_in_80_columns(
        tmp_path, capsys) -> None:
    from torchparity import cli

    plants_file = inspect.getsourcefile(plants)
    assert cli.main(["diagnose", f"{plants_file}:make_a", f"{plants_file}:make_b_layer_norm",
                     "--no-backward", "--json", str(tmp_path / "d.json")]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    words = " ".join(lines).split()
    assert source_line(plants.Block, "forward", "self.ln2(") in words, "\n".join(lines)
    assert source_line(plants.LayerNormEps, "__init__", "# planted") in words, "\n".join(lines)
    assert "eps 1e-05 (A) vs 0.001 (B)" in " ".join(words)


def test_against_a_trace_the_op_and_lines_are_as_in_process_and_b_built_it(tmp_path) -> None:
    """A's ops of the norm and of its caller (the root) come from the trace; only B's model
    is here to say where it was built."""
    model_a, model_b, ids = plants.pair(plants.LayerNormEps)
    trace = tp.record(model_a, (ids,), tmp_path / "t", backward=False, ops="ln2,(model)")
    op = tp.diagnose_against(trace, model_b, (ids,)).to_dict()["first_divergence"]["op"]
    in_process = drilled(plants.LayerNormEps)
    same = ("module", "name", "kind", "a_stack", "b_stack", "code", "arguments")
    assert {k: op[k] for k in same} == {k: in_process[k] for k in same}
    assert op["built"] == {"b": in_process["built"]["b"]}, op


# --- an installed package's code ---------------------------------------------------------------


PACKAGE_PATH = re.compile(r"^transformers/models/gpt2/modeling_gpt2\.py:\d+$")
#: Any file of the package (a decorator's wrapper is a frame of the stack too).
IN_PACKAGE = re.compile(r"^transformers/[\w/]+\.py:\d+$")


@pytest.mark.transformers
def test_ops_in_an_installed_package_are_named_by_the_packages_own_path() -> None:
    """GPT-2's attention without its scaling in B: the op rows are in modeling_gpt2.py, named
    from the package's folder, never the environment's, whole in 80 columns."""
    import gpt2_plants
    from transformers.models.gpt2 import modeling_gpt2

    model_a, batch = gpt2_plants.gpt2_a()
    report = tp.diagnose(model_a, gpt2_plants.gpt2_b_unscaled()[0], batch, backward=False)
    op = report.to_dict()["first_divergence"]["op"]
    assert op is not None and op["found"], report.render()
    # 5.x scales by the attribute (B's mul differs), older releases divide (A's only)
    assert PACKAGE_PATH.match((op["b_stack"] or op["a_stack"])[0]), op
    assert all(IN_PACKAGE.match(where) for where in op["a_stack"] + op["b_stack"]), op
    assert display_path(modeling_gpt2.__file__) == "transformers/models/gpt2/modeling_gpt2.py"
    lines = [text for text, _ in report.table_lines(80)]
    assert all(len(line) <= 80 for line in lines), "\n".join(lines)
    assert any(PACKAGE_PATH.match(word) for line in lines for word in line.split()), lines


@pytest.mark.transformers
def test_a_torch_norm_in_an_installed_package_is_named_at_the_packages_lines() -> None:
    from test_diagnose_ops import hf_inputs

    import tiny_transformers

    torch.manual_seed(0)
    model_a = tiny_transformers.gpt2().eval()
    model_b = copy.deepcopy(model_a)
    model_b.transformer.h[1].ln_2.eps = 1e-3
    report = tp.diagnose(model_a, model_b, hf_inputs(), backward=False)
    op = report.to_dict()["first_divergence"]["op"]
    assert (op["module"], op["name"]) == ("transformer.h.1.ln_2", "aten::native_layer_norm")
    assert op["arguments"] == ["eps 1e-05 (A) vs 0.001 (B)"]
    assert PACKAGE_PATH.match(op["b_stack"][0]) and "self.ln_2(" in op["code"]["b"], op
    assert PACKAGE_PATH.match(op["built"]["b"]["at"]), op
    assert op["built"]["b"]["code"].startswith("self.ln_2 = nn.LayerNorm("), op


class _Stack(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(4) for _ in range(2))
        self.up, self.norm = torch.nn.Linear(4, 4), torch.nn.LayerNorm(4)


def test_the_constructor_line_of_a_containers_element_and_of_a_tuple_assignment() -> None:
    from torchparity.diagnosis.stages.ops.library import built_at

    model = _Stack()
    container = source(_Stack, "__init__", "self.norms =")
    assert (str(built_at(model, "norms.1")), built_at(model, "norms.1").text) == container
    tupled = source(_Stack, "__init__", "self.up, self.norm =")
    assert (str(built_at(model, "norm")), built_at(model, "norm").text) == tupled
    assert built_at(torch.nn.Sequential(torch.nn.LayerNorm(4)), "0") is None  # torch's own
