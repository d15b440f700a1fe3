"""Decoding diagnosis of a beam search: B and the goldens follow A's parents and tokens, a
reorder that leaves a cache part behind is named at the first step where it matters, and beam
swaps and the final n-best get the verdicts of token flips.

The toy beam decoder of ``toy_beam_decoders.py`` keeps its cache on its attention modules and
reorders it through ``map_state``; its ``forgetful`` refactor leaves the values out. Which rows
go stale is a property of the search alone (``stale_rows`` there): before the reorder of step
``s`` a row holds the tokens its lineage fed, and a row whose parent holds other tokens keeps
the wrong values when they are not reordered.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

import torchparity as tp
from torchparity.cli import main
from torchparity.diagnosis.pipelines.decoding.report import DecodeReport
from torchparity.errors import UsageError
from torchparity.reference import build_model, zoo
from torchparity.subject import hf
from torchparity.subject.beams import BeamSettings
from torchparity.subject.factory import resolve_entry

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

TOYS = Path(__file__).with_name("toy_beam_decoders.py")
STEPS, BEAMS = 6, 4


def _factory(name: str) -> dict:
    return resolve_entry(f"{TOYS}:{name}")()


stale_rows = resolve_entry(f"{TOYS}:stale_rows")
first_moving_reorder = resolve_entry(f"{TOYS}:first_moving_reorder")
ValuesLeftBehind = resolve_entry(f"{TOYS}:ValuesLeftBehind")


def _diagnosed(a: str, b: str, beams: int = BEAMS) -> DecodeReport:
    made_a, made_b = _factory(a), _factory(b)
    return tp.diagnose_decode(made_a["model"], made_b["model"], made_a["inputs"],
                              step=made_a["step"], reorder=made_a["reorder"], steps=STEPS,
                              beams=BeamSettings(beams))


def test_a_cache_part_left_out_of_the_reorder_is_named_where_a_reorder_first_moves_rows():
    report = _diagnosed("clean", "forgetful")
    tokens, parents = report.tokens, report.parents
    step = first_moving_reorder(tokens, parents)
    assert step > 1  # the first reorder copies beam 0 of each prompt: identical rows
    assert report.steps[step - 1].ok and report.first_step == step, report.render(100)
    assert report.first_module_label == f"layers.0.self_attn @ step {step}"
    entry = report.first_module.entry
    assert (entry.via, entry.argument) == ("reorder", "layers.0.self_attn.v_cache")
    stale = stale_rows(tokens, parents, step)
    assert entry.detail.startswith(f"rows {', '.join(map(str, stale[:6]))}")
    assert entry.detail.endswith("not reordered at all")
    assert any("layers.1.self_attn.v_cache" in note for note in report.meta.notes)
    assert not report.ok


@pytest.mark.parametrize("twins", [False, True])
def test_a_reordered_sum_in_a_beam_search_leaves_no_step_and_only_near_ties(twins: bool):
    suffix = "_twins" if twins else ""
    # With twins and an odd beam the last kept and the first dropped candidate are twins at
    # every step (2 prompts x 6 steps): the rounding keeps one or the other.
    report = _diagnosed(f"clean{suffix}", f"reordered{suffix}",
                        beams=3 if twins else BEAMS)
    assert report.first_step is None, report.render(100)
    assert all(s.verdict == "near tie" for s in [*report.swaps, *report.nbest])
    assert report.ok
    if twins:
        assert report.swaps and "near tie" in report.summary()


@pytest.mark.transformers
@pytest.mark.parametrize("family", ["llama", "bart"])
def test_transformers_eager_against_sdpa_in_a_beam_search(family: str) -> None:
    import tiny_transformers

    model = tiny_transformers.generator(family)
    eager, sdpa = copy.deepcopy(model), copy.deepcopy(model)
    hf.set_attention(eager, hf.EAGER)
    hf.set_attention(sdpa, hf.SDPA)
    ids = torch.randint(3, 64, (2, 6), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding: the masks and positions are reordered too
    inputs = {"input_ids": ids.masked_fill(mask == 0, 0), "attention_mask": mask}
    report = tp.diagnose_decode(eager, sdpa, inputs, steps=STEPS, beams=BeamSettings(BEAMS))
    assert report.first_step is None, report.render(100)
    assert all(s.verdict == "near tie" for s in [*report.swaps, *report.nbest])
    assert report.parents is not None and report.tokens.shape == (2 * BEAMS, STEPS)


def test_beams_across_revisions_and_on_the_command_line(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "base.tptrace"
    assert main(["record", f"{TOYS}:clean", "--decode", "--beams", str(BEAMS), "--steps",
                 str(STEPS), "-o", str(trace)]) == 0
    assert capsys.readouterr().out.splitlines()[0] == (
        f"recorded a decoding of {STEPS} step(s) ({BEAMS} beams) of BeamDecoder to {trace}")
    out = tmp_path / "report.json"
    assert main(["diagnose", f"{TOYS}:forgetful", "--against", str(trace), "--json",
                 str(out), "--html", str(tmp_path / "report.html")]) == 1
    assert "<h2>First beam swap per step</h2>" in (tmp_path / "report.html").read_text()
    text = capsys.readouterr().out
    assert max(map(len, text.splitlines())) <= 80
    decode = json.loads(out.read_text())["decode"]
    assert decode["beams"] == {"beams": BEAMS, "length_penalty": 1.0, "eos": None}
    assert decode["entry"] == {"argument": "layers.0.self_attn.v_cache", "via": "reorder",
                               "detail": decode["entry"]["detail"]}
    step = first_moving_reorder(torch.tensor(decode["tokens"]), torch.tensor(decode["parents"]))
    assert decode["first_module"] == f"layers.0.self_attn @ step {step}"
    assert main(["diagnose", f"{TOYS}:reordered", "--against", str(trace)]) == 0
    assert "Beam search of 4 beam(s) (length penalty 1, end of sequence none)" in \
        capsys.readouterr().out
    assert main(["diagnose", f"{TOYS}:clean", f"{TOYS}:forgetful", "--decode", "--beams",
                 str(BEAMS), "--steps", str(STEPS), "--length-penalty", "0.5", "--eos", "3",
                 "--json", str(out)]) == 1
    decode = json.loads(out.read_text())["decode"]
    assert decode["beams"] == {"beams": BEAMS, "length_penalty": 0.5, "eos": 3}
    capsys.readouterr()


def test_a_reference_model_reorders_its_cache_built_in() -> None:
    cfg = zoo.get("llama-tiny").config
    model = build_model(cfg, seed=0)
    batch = zoo.make_batch(cfg, batch_size=2, seq_len=6, seed=0)
    same = tp.diagnose_decode(model, copy.deepcopy(model), batch, steps=4,
                              beams=BeamSettings(BEAMS))
    assert same.first_step is None and not same.swaps and not same.nbest, same.render(100)
    broken = copy.deepcopy(model)
    broken.new_cache = ValuesLeftBehind
    report = tp.diagnose_decode(model, broken, batch, steps=4, beams=BeamSettings(BEAMS))
    step = first_moving_reorder(report.tokens, report.parents)
    assert report.first_step == step, report.render(100)
    assert report.first_module.module == "decoder.layers.0.attn"
    assert report.first_module.entry.argument == "state.cache.self_kv.0.1"


def test_beam_usage_errors(capsys) -> None:
    made = _factory("clean")
    with pytest.raises(UsageError, match="give tokens or beams, not both"):
        tp.diagnose_decode(made["model"], made["model"], made["inputs"], step=made["step"],
                           tokens=torch.zeros(8, 2, dtype=torch.long), beams=BeamSettings(2))
    with pytest.raises(UsageError, match="has no reorder for a beam search; return a 'reorder'"):
        tp.diagnose_decode(made["model"], copy.deepcopy(made["model"]), made["inputs"],
                           step=made["step"], steps=2, beams=BeamSettings(2))
    for args, message in (
            (["--beams", "2"], "--steps, --tokens, --beams and --sample describe a decoding; "
                               "add --decode"),
            (["--decode", "--eos", "1"], "--length-penalty and --eos are options of a beam "
                                         "search; add --beams K"),
            (["--decode", "--beams", "0"], "--beams 0: search with one beam or more")):
        assert main(["diagnose", f"{TOYS}:clean", f"{TOYS}:reordered", *args]) == 2
        assert message in capsys.readouterr().err
