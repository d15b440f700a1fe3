"""``diagnose`` of a user's model file against the refactors of tests/renamed_models.py.

The three refactors equal in meaning (a tied head read directly, q, k and v fused into one
projection, GELU written out) pass, as ``check --model`` passes them against the base's goldens
(tests/golden/test_renamed.py). The four that change the arithmetic (a LayerNorm's eps,
the attention's scale, the tanh GELU, a GELU whose backward alone is 2% off) fail, each at the
module, the op and the line that changed: the line is found in the model's text by its
``# changed`` marker, independently of the diagnosis.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from renamed_models import source
from torchparity.cli import main

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster


def written(root: Path, version: str) -> Path:
    path = root / version / "models.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(source(version))
    return path


def line_of(path: Path, marker: str) -> str:
    """``DIR/models.py:LINE`` of the one line of ``path`` that holds ``marker``."""
    numbers = [i for i, line in enumerate(path.read_text().splitlines(), 1) if marker in line]
    assert len(numbers) == 1, (marker, numbers)
    return f"{path.parent.name}/{path.name}:{numbers[0]}"


def diagnosed(tmp_path: Path, version: str, capsys) -> tuple[int, dict, str]:
    """The exit status, the JSON report and the terminal output (whitespace runs joined)."""
    report = tmp_path / f"{version}.json"
    status = main(["diagnose", f"{written(tmp_path, 'base')}:make",
                   f"{written(tmp_path, version)}:make", "--json", str(report)])
    out = " ".join(capsys.readouterr().out.split())
    return status, json.loads(report.read_text()), out


@pytest.mark.parametrize("version", ["tied", "fused", "gelu"])
def test_refactors_equal_in_meaning_pass(tmp_path, capsys, version) -> None:
    status, report, out = diagnosed(tmp_path, version, capsys)
    assert status == 0, out
    assert report["first_divergence"] is None and report["first_grad_divergence"] is None


@pytest.mark.parametrize("version, module, op_name, marker, argument", [
    ("eps", "norm2", "aten::native_layer_norm", "eps=EPS", "eps 1e-05 (A) vs 0.001 (B)"),
    ("scale", "attn", "aten::_scaled_dot_product", "scale=SCALE", "scale default (A) vs 0.318"),
    ("tanh", "mlp", "aten::gelu", "approximate=", "approximate default (A) vs 'tanh' (B)"),
])
def test_a_changed_forward_is_named_at_its_module_op_and_line(
        tmp_path, capsys, version, module, op_name, marker, argument) -> None:
    status, report, out = diagnosed(tmp_path, version, capsys)
    assert status == 1, out
    first = report["first_divergence"]
    assert first["module"] == module, out
    op = first["op"]
    assert op["found"] and op["name"].startswith(op_name), op
    assert any(text.startswith(argument) for text in op["arguments"]), op
    b_file = tmp_path / version / "models.py"
    if version == "eps":  # an argument of the constructor: called in the block, built above
        assert op["b_stack"][0].endswith(line_of(b_file, "self.mlp(self.norm2(x))")), op
        assert op["built"]["b"]["at"].endswith(line_of(b_file, f"{marker})  # changed")), op
    else:
        assert op["b_stack"][0].endswith(line_of(b_file, marker)), op
    assert f"It enters at {module}, in {op['name']}" in out, out


def test_a_backward_only_change_is_named_at_the_line_of_its_backward(tmp_path, capsys) -> None:
    status, report, out = diagnosed(tmp_path, "backward", capsys)
    assert status == 1, out
    assert report["first_divergence"] is None, out
    grad = report["first_grad_divergence"]
    assert grad["module"] == "mlp", out
    op = grad["op"]
    assert op["found"] and op["follows_forward"] is None, op
    assert op["b_stack"][0].endswith(line_of(tmp_path / "backward" / "models.py", "1.02  #")), op
    assert "In its backward pass: It enters at mlp (backward), in aten::mul" in out, out
