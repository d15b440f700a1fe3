"""Decoding diagnosis: the first step, the first module and how the change gets in, and the
verdict of each token flip, in one process, across revisions (``record --decode`` and
``diagnose --against``) and on the command line.

The toy decoder of ``toy_decoders.py`` keeps its cache on its attention modules; its
``off_by_one`` refactor writes each new key at the step counter the generator hands it, one too
far: the prompt (10 tokens) is unaffected, and from step 1 on attention reads one never-written
slot (position 10) more than the clean decoder (12 positions against 11). Its ``reordered``
refactor only sums over the keys in another order.
"""

from __future__ import annotations

import copy
import json
import shlex
from pathlib import Path

import pytest
import torch

import torchparity as tp
from torchparity.cli import main
from torchparity.errors import UsageError
from torchparity.reference import KVCache, build_model, greedy_decode, zoo
from torchparity.subject.factory import resolve_entry

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

TOYS = Path(__file__).with_name("toy_decoders.py")
PROMPT = 10  # toy_decoders.PROMPT


def _factory(name: str) -> dict:
    """What the factory ``name`` of toy_decoders.py returns (model, prompt, step)."""
    return resolve_entry(f"{TOYS}:{name}")()


STEPS = 12  # with 8 sequences: the off-by-one flips a token in several, whatever the tokens


def sampled_tokens(steps: int = STEPS) -> torch.Tensor:
    """Tokens a seeded sampler might have produced: not A's greedy choices."""
    return torch.randint(0, 32, (8, steps), generator=torch.Generator().manual_seed(7))


def _assert_off_by_one_found(report) -> None:
    assert report.steps[0].verdict == "identical", report.render(100)
    assert report.first_step == 1
    assert report.first_module_label == "layers.0.self_attn @ step 1"
    entry = report.first_module.entry
    assert (entry.via, entry.argument) == ("state", "k_cache")
    assert entry.detail.startswith(f"holds {PROMPT + 2} positions in B, {PROMPT + 1} in A")
    assert f"B never wrote position {PROMPT} (all zeros)" in entry.detail
    assert report.flips and min(report.flips, key=lambda f: f.step).verdict == "real change"


def _assert_reorder_is_noise(report) -> None:
    assert report.first_step is None, report.render(100)
    assert all(f.verdict == "near tie" for f in report.flips)


@pytest.mark.parametrize("tokens", ["greedy", "given"])
def test_an_unwritten_cache_slot_is_found_at_its_step_module_and_state(tokens: str) -> None:
    clean, changed = _factory("clean"), _factory("off_by_one")
    given = sampled_tokens() if tokens == "given" else None
    report = tp.diagnose_decode(clean["model"], changed["model"], clean["inputs"],
                                step=clean["step"], steps=STEPS, tokens=given)
    _assert_off_by_one_found(report)
    if given is not None:
        assert torch.equal(report.tokens, given)


@pytest.mark.parametrize("tokens", ["greedy", "given"])
def test_a_reordered_sum_leaves_no_step_and_only_near_ties(tokens: str) -> None:
    given = sampled_tokens() if tokens == "given" else None
    for clean, changed in (("clean", "reordered"), ("clean_twins", "reordered_twins")):
        a, b = _factory(clean), _factory(changed)
        report = tp.diagnose_decode(a["model"], b["model"], a["inputs"], step=a["step"],
                                    steps=STEPS, tokens=given)
        _assert_reorder_is_noise(report)
    # With twin tokens (16 pairs one part in 1e7 apart, 8 sequences x 13 steps) greedy choices
    # between twins follow the rounding: the reorder flips some, and each is a near tie.
    assert report.flips and "regenerating the golden is safe" in report.summary()


def test_across_revisions_and_on_the_command_line(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "base.tptrace"
    assert main(["record", f"{TOYS}:clean", "--decode", "--steps", str(STEPS), "-o",
                 str(trace)]) == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0] == f"recorded a decoding of {STEPS} step(s) of ToyDecoder to {trace}"
    meta = json.loads((trace / "trace.json").read_text())
    # A toy's steps hold small tensors only: they wait, and go to disk together, at the end.
    assert meta["kind"] == "decode"
    assert len(list((trace / "tensors").iterdir())) == 1

    report_json = tmp_path / "report.json"
    code = main(["diagnose", f"{TOYS}:off_by_one", "--against", str(trace),
                 "--json", str(report_json), "--html", str(tmp_path / "report.html")])
    assert code == 1
    decode = json.loads(report_json.read_text())["decode"]
    assert decode["first_step"] == 1 and decode["prompt"] == "identical"
    assert decode["first_module"] == "layers.0.self_attn @ step 1"
    assert decode["entry"]["argument"] == "k_cache"
    assert set(decode["flips"][0]) == {"step", "sequence", "a_token", "b_token", "margin",
                                       "change", "budget", "verdict"}
    assert min(decode["flips"], key=lambda f: f["step"])["verdict"] == "real change"
    assert decode["first_op"] is None  # the trace holds no ops: said in one line, with how
    text = capsys.readouterr().out
    assert "layers.0.self_attn @ step 1" in text and max(map(len, text.splitlines())) <= 80
    command = shlex.join(["torchparity", "record", f"{TOYS}:clean", "--decode", "--steps",
                          str(STEPS), "-o", str(trace), "--ops", "layers.0.self_attn"])
    # a path longer than a line is folded across lines, every character kept
    hint = f"`{command}` on A's code adds them"
    assert "".join(hint.split()) in "".join(text.split())
    # --ops is refused, never ignored, with a decoding's trace
    assert main(["diagnose", f"{TOYS}:off_by_one", "--against", str(trace), "--ops",
                 "layers.0.self_attn"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--ops drills down a forward diagnosis" in err
    assert main(["record", f"{TOYS}:clean", "--decode", "--ops", "layers.9", "-o",
                 str(tmp_path / "no.tptrace")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--ops layers.9: ToyDecoder has no such module" in err
    assert main(["record", f"{TOYS}:clean", "--decode", "--ops", "all", "-o",
                 str(tmp_path / "no.tptrace")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "a decoding keeps the ops of the modules --ops names" in err
    assert (tmp_path / "report.html").read_text().startswith("<!DOCTYPE html>")

    assert main(["diagnose", f"{TOYS}:reordered", "--against", str(trace)]) == 0
    assert "No step's logits leave the budget" in capsys.readouterr().out


def test_a_trace_with_ops_drills_down_as_in_process(tmp_path: Path) -> None:
    """A's ops kept by ``record --decode --ops`` give the op and B's line at the first
    divergent step that the two models in one process give."""
    clean, changed = _factory("clean"), _factory("off_by_one")
    trace = tp.record_decode(clean["model"], clean["inputs"], tmp_path / "ops.tptrace",
                             step=clean["step"], steps=4, ops="layers.0.self_attn")
    against = tp.diagnose_decode_against(trace, changed["model"], changed["inputs"],
                                         step=changed["step"])
    in_process = tp.diagnose_decode(_factory("clean")["model"], _factory("off_by_one")["model"],
                                    clean["inputs"], step=clean["step"], steps=4)
    op, expected = (r.to_dict()["decode"]["first_op"] for r in (against, in_process))
    assert against.first_step == in_process.first_step == 1
    assert op is not None and op["found"], against.render(100)
    assert {k: op[k] for k in ("name", "kind", "a_stack", "b_stack", "code")} == \
        {k: expected[k] for k in ("name", "kind", "a_stack", "b_stack", "code")}
    assert "self.k_cache[..., " in op["code"]["b"]  # the read of the slot never written
    # nothing diverges: no op drill-down, no note about one
    same = tp.diagnose_decode_against(trace, _factory("clean")["model"], clean["inputs"],
                                      step=clean["step"])
    assert same.first_step is None and "drill-down" not in " ".join(same.meta.notes)


def test_given_tokens_across_revisions_in_python_and_on_the_command_line(tmp_path: Path,
                                                                         capsys) -> None:
    tokens = sampled_tokens()
    tokens_file = tmp_path / "beams.txt"
    tokens_file.write_text("\n".join(" ".join(map(str, row)) for row in tokens.tolist()))
    clean = _factory("clean")
    trace = tp.record_decode(clean["model"], clean["inputs"], tmp_path / "py.tptrace",
                             step=clean["step"], tokens=tokens, steps=STEPS)
    changed = _factory("off_by_one")
    report = tp.diagnose_decode_against(trace, changed["model"], changed["inputs"],
                                        step=changed["step"])
    _assert_off_by_one_found(report)
    assert torch.equal(report.tokens, tokens) and report.meta.tokens == "given"
    # diagnose_against reads the trace's kind: a decoding goes to the decoding pipeline
    routed = tp.diagnose_against(trace, changed["model"], changed["inputs"], step=changed["step"])
    _assert_off_by_one_found(routed)
    assert routed.to_dict()["decode"] == report.to_dict()["decode"]
    reordered = _factory("reordered")
    _assert_reorder_is_noise(tp.diagnose_decode_against(trace, reordered["model"],
                                                        reordered["inputs"],
                                                        step=reordered["step"]))

    assert main(["record", f"{TOYS}:clean", "--decode", "--tokens", str(tokens_file),
                 "-o", str(tmp_path / "cli.tptrace")]) == 0
    assert main(["diagnose", f"{TOYS}:off_by_one", "--against", str(tmp_path / "cli.tptrace"),
                 "--json", str(tmp_path / "r.json")]) == 1
    decode = json.loads((tmp_path / "r.json").read_text())["decode"]
    assert decode["tokens"] == tokens.tolist() and decode["first_step"] == 1
    assert main(["diagnose", f"{TOYS}:clean", f"{TOYS}:off_by_one", "--decode", "--tokens",
                 str(tokens_file), "--json", str(tmp_path / "one.json")]) == 1
    one = json.loads((tmp_path / "one.json").read_text())["decode"]
    assert (one["first_step"], one["first_module"]) == (1, "layers.0.self_attn @ step 1")
    capsys.readouterr()


class StaleSlotCache(KVCache):
    """Hands attention the previous token's value in the newest slot once anything is cached."""

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        k_all, v_all = super().append(layer, k, v)
        if k_all.shape[-2] > k.shape[-2]:
            v_all = torch.cat([v_all[..., :-1, :], v_all[..., -2:-1, :]], dim=-2)
        return k_all, v_all


@pytest.fixture(scope="module")
def llama() -> tuple:
    cfg = zoo.get("llama-tiny").config
    return build_model(cfg, seed=0), zoo.make_batch(cfg, batch_size=2, seq_len=6, seed=0,
                                                    padding="left")


def test_a_correct_cache_matches_its_recompute_along_the_reference_greedy_tokens(llama) -> None:
    model, batch = llama
    report = tp.diagnose_decode(model, None, batch, steps=3)
    assert report.first_step is None and report.first_module is None and not report.flips
    assert len(report.steps) == 4 and all(step.ok for step in report.steps)
    assert torch.equal(report.tokens, greedy_decode(model, batch, steps=3).tokens)


@pytest.mark.parametrize("against", ["model_a", "own recompute"])
def test_a_stale_cache_slot_of_a_reference_model_is_found_at_its_step_and_module(
        llama, against: str) -> None:
    model_a, batch = llama
    model_b = copy.deepcopy(model_a)
    model_b.new_cache = StaleSlotCache
    if against == "model_a":
        report = tp.diagnose_decode(model_a, model_b, batch, steps=3)
    else:
        report = tp.diagnose_decode(model_b, None, batch, steps=3)
    assert report.first_step == 1, report.render(100)  # step 0 (the prompt) has no cache yet
    assert report.steps[0].ok
    assert report.first_module.module == "decoder.layers.0.attn", report.render(100)


def test_masked_logits_are_judged_apart_in_a_decoding() -> None:
    """A generator banning a token writes -65504 in A and -inf in B: no divergence; B letting
    it through is found at the step it does."""
    clean = _factory("clean")

    def banning(sentinel: float, through_at: int | None = None):
        def step(model, tokens, state):
            logits, state = clean["step"](model, tokens, state)
            logits = logits[:, -1].clone()
            at = state - PROMPT  # the step this call made (the prompt is 0)
            if at != through_at:
                logits[:, 3] = sentinel  # token 3 is banned
            return logits, state
        return step

    model = clean["model"]
    same = tp.diagnose_decode(model, copy.deepcopy(model), clean["inputs"],
                              step=banning(-65504.0), step_b=banning(float("-inf")))
    assert same.first_step is None and same.steps[0].verdict == "within"  # other sentinel bits
    leak = tp.diagnose_decode(model, copy.deepcopy(model), clean["inputs"],
                              step=banning(-65504.0), step_b=banning(-65504.0, through_at=3))
    assert leak.first_step == 3
    assert "masks 8 element(s)" in leak.steps[3].explain()  # token 3 of the 8 sequences


def test_decode_usage_errors(llama, tmp_path: Path, capsys) -> None:
    model, batch = llama
    with pytest.raises(UsageError, match="tokens must be"):
        tp.diagnose_decode(model, None, batch, steps=4, tokens=torch.zeros(2, 1, dtype=int))
    with pytest.raises(UsageError, match="cannot decode a Linear by itself; pass step="):
        tp.diagnose_decode(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2), (torch.ones(2),))
    trace = tp.record(model, batch, tmp_path / "forward.tptrace", backward=False)
    with pytest.raises(UsageError, match="records a forward pass, not a decoding"):
        tp.diagnose_decode_against(trace, model, batch)
    with pytest.raises(UsageError, match="records a forward pass, not a decoding"):
        tp.diagnose_against(trace, model, batch, decode=True)
    assert main(["record", f"{TOYS}:clean", "--steps", "3", "-o", str(tmp_path / "x")]) == 2
    assert "--steps, --tokens, --beams and --sample describe a decoding; add --decode" in \
        capsys.readouterr().err
