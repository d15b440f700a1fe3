"""What every report kind (terminal, JSON, HTML) says of what it could not compare, and how the
terminal lays out long module names at 80 columns.

A block that returns ``{"hidden": h}`` in A and ``[h]`` in B shares no tensor with A: its row is
"not compared", with why, never ``=``. Module names of 60 characters are never cut.
"""

from __future__ import annotations

import html
import json
import re
from pathlib import Path

import pytest
import torch
from masked_models import CachedMask
from torch import nn

import torchparity as tp
from torchparity.diagnosis.reports.columns import wrapped_name

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

VOCAB, DIM = 16, 8


class Block(nn.Module):
    def __init__(self, as_list: bool) -> None:
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.as_list = as_list

    def forward(self, x: torch.Tensor):
        h = torch.tanh(self.proj(x))
        return [h] if self.as_list else {"hidden": h}


class Tiny(nn.Module):
    """Embedding, a block, a head; B's block returns another container, and B's head is
    scaled (a real change, so that a decoding has a failing step whose modules are judged)."""

    def __init__(self, revised: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.block = Block(as_list=revised)
        self.head = nn.Linear(DIM, VOCAB)
        if revised:
            with torch.no_grad():
                self.head.weight.mul_(1.5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        out = self.block(self.embed(ids))
        return self.head(out[0] if isinstance(out, list) else out["hidden"])


def recompute(model, tokens, state):
    ids = tokens["ids"] if state is None else torch.cat((state, tokens), dim=1)
    return model(ids), ids


IDS = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def forward_report():
    return tp.diagnose(Tiny(False).eval(), Tiny(True).eval(), {"ids": IDS}, backward=False,
                       local="all", progress=False)


@pytest.fixture(scope="module")
def decode_report():
    return tp.diagnose_decode(Tiny(False).eval(), Tiny(True).eval(), {"ids": IDS},
                              step=recompute, steps=2, progress=False)


@pytest.fixture(params=["forward", "decode"])
def report(request, forward_report, decode_report):
    return forward_report if request.param == "forward" else decode_report


def _block(report):
    return next(r for r in report.rows if r.module == "block")


def test_the_terminal_says_not_compared_never_identical(report) -> None:
    assert _block(report).propagated.verdict == "not compared"
    line = next(line for line in report.render(80).splitlines()
                if re.match(r"\s*\d+\s.*\sblock(\s|$)", line))
    cells = line.split()
    assert cells[cells.index("block") - 1] == "n/c", line  # B's output against A's
    assert "n/c: not compared" in " ".join(report.render(80).split())


def test_the_json_says_not_compared_and_why(report) -> None:
    rows = json.loads(report.to_json())
    rows = rows["decode"]["rows"] if "decode" in rows else rows["rows"]
    block = next(r for r in rows if r["module"] == "block")
    assert block["propagated"]["verdict"] == "not compared"
    assert block["propagated"]["ok"] is None
    assert block["propagated"]["not_compared"] == (
        "A and B share no tensor (A holds output.hidden, B holds output.0)")


def test_the_html_says_not_compared_and_why(report, tmp_path: Path) -> None:
    page = report.to_html(tmp_path / "report.html")
    row = next(r for r in re.findall(r"<tr.*?</tr>", page) if re.search(r"(;|>)block(<|$)", r))
    cells = re.findall(r"<td[^>]*>(.*?)</td>", row)
    assert ">n/c<" in cells[-1 if hasattr(report, "flips") else -2], row  # the output's cell
    assert "not compared: A and B share no tensor (A holds output.hidden, B holds output.0)" \
        in html.unescape(row)


# --------------------------------------------------------------------------------------------
# 80 columns


LONG = "transformer_layers_of_the_decoder_stack"


class Deep(nn.Module):
    """Module names of 60 characters and more: ``decoder.<long>.0.self_attention.linear_values``."""

    def __init__(self, scale: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        attention = nn.Module()
        attention.linear_values = nn.Linear(DIM, DIM)
        attention.linear_keys = nn.Linear(DIM, DIM)
        layer = nn.Module()
        layer.self_attention = attention
        stack = nn.Module()
        setattr(stack, LONG, nn.ModuleList([layer]))
        self.decoder = stack
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attention = getattr(self.decoder, LONG)[0].self_attention
        return attention.linear_values(x) * self.scale + attention.linear_keys(x)


def test_no_name_of_60_characters_is_cut_at_80_columns() -> None:
    a, b = Deep(1.0), Deep(1.001)
    names = [n for n, _ in a.named_modules() if n.count(".") == 4]
    assert min(map(len, names)) >= 60
    report = tp.diagnose(a, b, torch.randn(3, DIM), progress=False)
    text = report.render(80)
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80, text
    for name in names:
        assert any(re.search(rf"(^|\s){re.escape(name)}(\s|$)", line) for line in lines), text


@pytest.mark.parametrize("width", [40, 60, 80])
def test_a_layout_yields_indentation_then_gives_a_name_its_own_line(width: int) -> None:
    name = "decoder." + LONG + ".0.self_attention.linear_values"
    prefix = " 12  X 1e+03  X 2e+04  "
    lines = wrapped_name(prefix, name + " (shape differs)", 6, width)
    assert any(line.strip() == name or line.endswith(" " + name) for line in lines), lines
    assert all(len(line) <= max(width, len(name)) for line in lines)
    assert "".join(lines).replace(" ", "") == (prefix + name + "(shapediffers)").replace(" ", "")


class _SteeperBackward(torch.autograd.Function):
    """The identity forward, a backward that scales the gradient: only gradients change."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * 1.5


class _Scaled(nn.Module):
    def __init__(self, steeper: bool) -> None:
        super().__init__()
        self.weight, self.steeper = nn.Parameter(torch.randn(DIM)), steeper

    def forward(self, x):
        y = x * self.weight
        return _SteeperBackward.apply(y) if self.steeper else y


def test_a_failing_diagnosis_whose_output_is_within_says_why_it_fails() -> None:
    """The forward passes agree bit for bit, the backward of one module does not: the
    report says ``Final output: identical`` and must also say why it fails."""
    torch.manual_seed(0)
    a, b = nn.Sequential(_Scaled(False), nn.Tanh()), nn.Sequential(_Scaled(True), nn.Tanh())
    b.load_state_dict(a.state_dict())
    report = tp.diagnose(a, b, (torch.randn(3, DIM),), local="all")
    assert report.first_divergence is None and report.first_grad_divergence is not None
    assert report.output.ok
    findings = report.findings()
    final = next(i for i, f in enumerate(findings) if f.startswith("Final output: "))
    assert findings[final + 1] == (
        f"Verdict: fail (exit 1): the local gradient error of "
        f"{report.first_grad_divergence.module} breaks its budget, although the output "
        "stays within its budget: the backward pass differs, the forward pass does not.")


@pytest.mark.parametrize("changed, depends", [(None, "could depend on them"),
                                             ("head", "could depend on them"),
                                             ("pre", "does not depend on them: pre diverges "
                                                     "before them")])
def test_a_module_that_cannot_be_replayed_says_its_local_error_is_unknown(changed,
                                                                          depends) -> None:
    """A's attention gets a mask of 16 keys, B's one of 5, and A's attends keys past the 5 (A's
    attention ignores them): B's attention cannot be fed A's recorded arguments. Its row says
    its local error is unknown, and the summary says whether the verdict could depend on it:
    not when a module before it diverges."""
    x = torch.randn(2, 5, DIM, generator=torch.Generator().manual_seed(1))
    a, b = CachedMask(False, spare=0.0), CachedMask(True)
    if changed:
        with torch.no_grad():
            getattr(b, changed).bias.add_(1.0)
    report = tp.diagnose(a, b, (x,), backward=False, local="all")
    attn = report.row("attn")
    assert attn.local is None
    assert any(note.startswith("local error unknown: replay of B's module on A's recorded "
                               "inputs failed (RuntimeError") for note in attn.notes)
    assert "attn: local error unknown" in " ".join(report.render().split())
    summary = report.summary()
    assert "The local error of 1 module(s) is unknown, their replay on A's inputs failed " \
           f"(attn); the verdict {depends}" in summary
    assert (report.first_divergence is not None) == (changed is not None)
