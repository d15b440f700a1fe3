"""The terminal report of a deep model shows the rows that matter and folds the rest: the
first divergence, the layer it sits in and its neighbours are shown, runs of layers with the
same verdicts become one line each, the whole fits 40 lines of 80 columns; JSON and HTML keep
every row."""

from __future__ import annotations

import json

import torch

import torchparity as tp
from torchparity.diagnosis.core.results import Bounded, Row
from torchparity.diagnosis.reports.diagnosis import DiagnosisReport
from torchparity.diagnosis.reports.meta import DiagnosisMeta

LAYERS = 16
MODULES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "self_attn", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.act_fn", "mlp",
           "input_layernorm", "post_attention_layernorm")
PLANTED = (7, "input_layernorm")


def _within(share: float = 0.1) -> Bounded:
    return Bounded("forward", "within", 1e-7, share)


def _diverged() -> tp.Comparison:
    return tp.compare(torch.ones(8) * 1.01, torch.ones(8, dtype=torch.float64), torch.ones(8))


def _row(module: str, start: int, local: object, propagated: object) -> Row:
    return Row(module=module, a_module=module, how="name", module_type="Module",
               depth=module.count(".") + 1, start=start, local=local, propagated=propagated,
               grad_local=_within(), grad_propagated=_within(0.2))


def deep_report() -> DiagnosisReport:
    """A Llama-like report: the planted norm diverges locally, everything after it inherits."""
    rows = [_row("model.embed_tokens", 0, None, _within())]
    after = False
    for layer in range(LAYERS):
        for module in MODULES:
            planted = (layer, module) == PLANTED
            after |= planted
            rows.append(_row(f"model.layers.{layer}.{module}", len(rows),
                             _diverged() if planted else (_within() if after else None),
                             _diverged() if after else _within()))
        rows.append(_row(f"model.layers.{layer}", len(rows),
                         _diverged() if layer == PLANTED[0] else None,
                         _diverged() if layer >= PLANTED[0] else _within()))
    rows += [_row("model.norm", len(rows), None, _diverged()),
             _row("lm_head", len(rows), None, _diverged()),
             _row("", len(rows), _diverged(), _diverged())]
    meta = DiagnosisMeta(reference="model A", model_b="Model", golden="float64 run of A",
                         backward=True, backends=["manual", "manual"],
                         mode="float32: A and B as given, against A's float64 golden",
                         alignment={}, notes=[], seconds={})
    return DiagnosisReport(rows=rows, output=_diverged(), loss=None, unmatched_a=[],
                           unmatched_b=[], meta=meta)


def test_a_deep_report_fits_40_lines_of_80_columns_with_the_rows_that_matter():
    report = deep_report()
    text = report.render(width=80)
    lines = text.splitlines()
    assert len(lines) <= 40, text
    assert max(len(line) for line in lines) <= 80
    packed = "".join(text.split())  # names wrap inside their column
    first = report.first_divergence
    assert first.module == "model.layers.7.input_layernorm"
    index = report.rows.index(first)
    layer = report.row("model.layers.7")
    for shown in (index - 1, index, index + 1, report.rows.index(layer)):
        assert any(line.lstrip().startswith(f"{shown} ") for line in lines), text
        assert report.rows[shown].module in packed
    # Layers before the divergence agree, those after inherit it: one line for each run.
    assert "(rows0-91,model.embed_tokenstomodel.layers.6)" in packed
    assert "(rows105-208,model.layers.8tomodel.layers.15)" in packed
    assert f"of {len(report.rows)} rows folded" in text


def test_json_and_html_keep_every_row(tmp_path):
    report = deep_report()
    assert len(json.loads(report.to_json())["rows"]) == len(report.rows)
    page = report.to_html(tmp_path / "report.html")
    assert all(f">{'&nbsp;' * 2 * r.depth}{r.module or '(model)'}<" in page
               for r in report.rows[:-1])


def test_a_report_of_few_rows_is_not_folded():
    report = deep_report()
    report.rows = report.rows[:30]
    text = report.render(width=80)
    assert "folded" not in text
    assert all(r.module in "".join(text.split()) for r in report.rows)
