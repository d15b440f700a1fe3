"""The sentence that says where a divergence enters, stated once per kind of answer, and the
same sentence in every format: the terminal, the JSON, the Markdown summary, the GitHub
annotation and the HTML page (the JUnit report names the module in its inherited notes).

The expected sentences are written out in the wording of docs/diagnose.md; the lines they name
are read from this file's own source, independently of the diagnosis."""

from __future__ import annotations

import html
import inspect
import os
import xml.etree.ElementTree as ET

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import torchparity as tp
from torchparity.ci import diagnosis_outcome, junit_xml, summary_markdown
from torchparity.ci.writers import annotations
from torchparity.diagnosis.core.results import Entry
from torchparity.diagnosis.reports import sentence
from torchparity.diagnosis.stages.ops.capture import Frame

pytestmark = pytest.mark.usefixtures("single_thread")


def line(marker: str) -> str:
    """``path:line "code"`` of the one line of this file that ends with ``marker``."""
    lines, _ = inspect.findsource(inspect.getmodule(line))
    [number] = [i + 1 for i, text in enumerate(lines) if text.rstrip().endswith(marker)]
    return f'{os.path.relpath(__file__)}:{number} "{lines[number - 1].strip()}"'


class ExactGelu(nn.Module):
    def forward(self, x):
        return F.gelu(x)  # the gelu of A


class TanhGelu(nn.Module):
    def forward(self, x):
        return F.gelu(x, approximate="tanh")  # the gelu of B


class _Steeper(torch.autograd.Function):
    """The identity forward; the gradient times ``slope``."""

    @staticmethod
    def forward(ctx, x, slope):
        ctx.slope = slope
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.slope, None  # the slope of the gradient


class Steeper(nn.Module):
    def __init__(self, slope: float):
        super().__init__()
        self.slope = slope

    def forward(self, x):
        return _Steeper.apply(x, self.slope)


class Masked(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, mask):
        return self.proj(x).masked_fill(mask, 0.0)


class Block(nn.Module):
    """Hands ``inner`` a mask it builds from its input cut at ``cut``."""

    def __init__(self, cut: float):
        super().__init__()
        self.cut = cut
        self.up = nn.Linear(8, 8)
        self.inner = Masked()

    def forward(self, x):
        h = self.up(x)
        mask = h > self.cut  # the cut of the mask
        return self.inner(h, mask)


class Net(nn.Module):
    def __init__(self, act: nn.Module):
        super().__init__()
        self.up, self.act, self.down = nn.Linear(8, 8), act, nn.Linear(8, 4)

    def forward(self, x):
        return self.down(self.act(self.up(x)))


def net(act: type[nn.Module], *args: float) -> Net:
    """``Net`` around ``act(*args)``, seeded: A and B share every weight."""
    torch.manual_seed(0)
    return Net(act(*args))


def inputs() -> tuple[torch.Tensor]:
    return (torch.randn(2, 8, generator=torch.Generator().manual_seed(1)),)


def squared(out: torch.Tensor, _) -> torch.Tensor:
    return out.square().sum()


def gelu_answer() -> tuple[tp.DiagnosisReport, list[str]]:
    """tanh GELU for the exact one: the forward op with both sides' lines, and the gradient
    that follows from it."""
    report = tp.diagnose(net(ExactGelu), net(TanhGelu), inputs(), loss_fn=squared)
    return report, [
        f"It enters at act, in aten::gelu (B: {line('# the gelu of B')}; "
        f"A: {line('# the gelu of A')}): approximate default (A) vs 'tanh' (B).",
        "First gradient divergence: act, which follows from the forward divergence of act.",
        "In its backward pass: Its gradient follows from the forward divergence of act, which "
        f"enters at aten::gelu ({line('# the gelu of B')}).",
    ]


def steeper_answer() -> tuple[tp.DiagnosisReport, list[str]]:
    """The same forward, a gradient 2% steeper: a backward op, found by its argument."""
    report = tp.diagnose(net(Steeper, 1.0), net(Steeper, 1.02), inputs(), loss_fn=squared)
    slope = line("# the slope of the gradient")
    return report, [f"In its backward pass: It enters at act (backward), in aten::mul.Tensor "
                    f"(B: {slope}; A: {slope}): other 1.0 (A) vs 1.02 (B)."]


def mask_answer() -> tuple[tp.DiagnosisReport, list[str]]:
    """A mask cut at 0.1 for 0: the op that builds it, and the argument it reaches a module
    inside through, with how many entries it flips."""
    report = tp.diagnose(net(Block, 0.0), net(Block, 0.1), inputs(), backward=False)
    with torch.no_grad():
        a = net(Block, 0.0)
        h = a.act.up(a.up(*inputs()))
    flipped = int(((h > 0.0) != (h > 0.1)).sum())
    return report, [
        f"It enters at act, in aten::gt.Scalar (B: {line('# the cut of the mask')}; "
        f"A: {line('# the cut of the mask')}): other 0.0 (A) vs 0.1 (B), and reaches "
        f"act.inner through its argument mask ({flipped} of {h.numel()} entries attend "
        "otherwise (A: boolean attend mask, B: boolean attend mask)).",
    ]


def one_line(text: str) -> str:
    """Each run of whitespace one space: the terminal wraps sentences at spaces."""
    return " ".join(text.split())


@pytest.mark.parametrize("answer", [gelu_answer, steeper_answer, mask_answer])
def test_every_format_says_where_it_enters_in_the_same_sentence(answer, tmp_path):
    report, sentences = answer()
    outcome = diagnosis_outcome(report, "b against a")
    formats = {"terminal": one_line(report.render()),
               "json": one_line(report.to_dict()["summary"]),
               "markdown": one_line(summary_markdown(outcome)),
               "annotation": one_line(" ".join(annotations(outcome))),
               "html": one_line(html.unescape(report.to_html()))}
    for said in sentences:
        for name, text in formats.items():
            assert one_line(said) in text, f"{name}:\n{text}"
        assert formats["terminal"].count(one_line(said)) == 1, formats["terminal"]
    if report.first_divergence is not None:
        notes = [case.find("system-out").text for case in
                 ET.fromstring(junit_xml(outcome)).iter("testcase")
                 if case.find("system-out") is not None]
        entered = "; it enters at act"
        assert any(note.endswith(entered) for note in notes), notes


def test_the_sentences_of_the_docs_are_built_from_their_parts():
    """The worked examples of docs/diagnose.md, rebuilt from the facts they name."""
    ln2 = Frame("tests/diagnosis/torch_module_plants.py", 25, "return self.ln2(x + h)")
    assert sentence.op_sentence("ln2", "aten::native_layer_norm", [("B", ln2), ("A", ln2)],
                                ["eps 1e-05 (A) vs 0.001 (B)"]) == (
        'It enters at ln2, in aten::native_layer_norm (B: tests/diagnosis/torch_module_plants'
        '.py:25 "return self.ln2(x + h)"; A: tests/diagnosis/torch_module_plants.py:25 '
        '"return self.ln2(x + h)"): eps 1e-05 (A) vs 0.001 (B).')
    mask = Entry("model.layers.1.self_attn", "attention_mask",
                 "4 of 256 (query, key) pairs of judged queries attend otherwise")
    assert sentence.entered_at(mask) == (
        "It enters at model.layers.1.self_attn argument attention_mask (4 of 256 (query, key) "
        "pairs of judged queries attend otherwise).")
    cache = Entry("layers.0.self_attn", "k_cache", "holds 12 positions in B, 11 in A", "state")
    assert sentence.entered_through(cache) == (
        "It enters through its state k_cache (holds 12 positions in B, 11 in A).")
    gelu = Frame("grad_plants.py", 47, 'return F.gelu(x, approximate="tanh")  # planted')
    assert sentence.backward_sentence(sentence.follows_sentence(
        sentence.forward_clause("blocks.1.act", "aten::gelu", gelu), 0)) == (
        "In its backward pass: Its gradient follows from the forward divergence of "
        'blocks.1.act, which enters at aten::gelu (grad_plants.py:47 "return F.gelu(x, '
        'approximate="tanh")  # planted").')
    dropped = [Frame("attn.py", n, text) for n, text in
               ((52, "p = p.tanh()"), (51, "p = s / 8"), (53, "p = p * 8"))]
    assert sentence.dropped_sentence("attn", "A", ["aten::div.Tensor", "aten::tanh",
                                                   "aten::mul.Tensor"], dropped) == (
        "It enters at attn, in 3 ops only in A (aten::div.Tensor, aten::tanh, "
        'aten::mul.Tensor; A: attn.py:51..53 "p = s / 8"): B has no counterpart.')
