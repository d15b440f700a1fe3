"""A verdict never contradicts its evidence: a tensor diverges exactly when its error leaves its
budget (or a fault or a shape says so), whatever the baseline did; a candidate bit-equal to its
golden is identical; a degraded baseline is a failure of the baseline, not a divergence of the
candidate. Over the comparison engine's tensors, dense and sketched, with honest and degraded
baselines, and over the rows of a check."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from torchparity import sketching
from torchparity.cli import main
from torchparity.comparison import compare
from torchparity.golden.check_loop import BASELINE_DEGRADED

#: How a side of a comparison is made from the float64 golden of a matmul.
SIDES = {
    "golden": lambda a, b: a @ b,
    "fp32": lambda a, b: (a.float() @ b.float()).double(),
    "bf16": lambda a, b: (a.bfloat16() @ b.bfloat16()).double(),  # a lost upcast
}


@st.composite
def problems(draw: st.DrawFn) -> dict:
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    rows, depth = draw(st.sampled_from([(4, 64), (16, 256), (64, 512)]))
    a = torch.randn(rows, depth, dtype=torch.float64, generator=gen)
    b = torch.randn(depth, 48, dtype=torch.float64, generator=gen)
    candidate = SIDES[draw(st.sampled_from(sorted(SIDES)))](a, b)
    baseline = SIDES[draw(st.sampled_from(sorted(SIDES)))](a, b)
    # A change of one element, of a size from nothing to far over any budget.
    shift = draw(st.sampled_from([0.0, 1e-12, 1e-7, 1e-4, 1e-1]))
    candidate[0, 0] += shift * candidate.abs().max()
    return {"golden": a @ b, "candidate": candidate, "baseline": baseline,
            "kind": draw(st.sampled_from(["forward", "grad", "loss"])),
            "dtype": draw(st.sampled_from(["fp64", "fp32"])),
            "sketched": draw(st.sampled_from([None, "golden", "candidate", "all"]))}


def _sides(problem: dict) -> tuple:
    sides = [problem["candidate"], problem["golden"], problem["baseline"]]
    if problem["sketched"] is None:
        return tuple(sides)
    which = {"golden": [1], "candidate": [0], "all": [0, 1, 2]}[problem["sketched"]]
    return tuple(sketching.sketch(t, "out", size=1024) if i in which else t
                 for i, t in enumerate(sides))


@given(problems())
def test_a_tensor_diverges_exactly_when_its_error_leaves_its_budget(problem):
    candidate, golden, baseline = _sides(problem)
    result = compare({"out": candidate}, {"out": golden}, {"out": baseline}, problem["kind"],
                     compute_dtype=problem["dtype"])
    (tensor,) = result.tensors
    assert (tensor.verdict == "diverged") == (tensor.headroom > 1), result.explain()
    if tensor.baseline_degraded:  # the baseline's failure, with the candidate judged anyway
        assert not result.ok and tensor.budget.source == "analytic", result.explain()
        assert result.explain().startswith(("baseline degraded", "diverged"))
    if torch.equal(problem["candidate"], problem["golden"]):
        assert tensor.verdict == "identical" and tensor.error == 0, result.explain()


@given(problems())
def test_an_error_of_zero_never_diverges(problem):
    golden = problem["golden"]
    _, sketched_golden, baseline = _sides(problem)
    result = compare({"out": golden.clone()}, {"out": sketched_golden}, {"out": baseline},
                     problem["kind"], compute_dtype=problem["dtype"])
    assert result.verdict == "identical", result.explain()


transformers = pytest.importorskip("transformers")


def test_no_row_of_a_check_diverges_within_its_budget(tmp_path, monkeypatch):
    """A tiny transformers Llama (float32 norms and rotary table, so its float64 golden is not
    float64 throughout) checked with every big tensor sketched: every row passes, and none
    that the tolerance model judged is diverged inside its budget or with an error of 0."""
    (tmp_path / "models.py").write_text(_LLAMA)
    monkeypatch.setenv(sketching.SKETCH_ABOVE_ENV, "256")
    entry, golden_dir = f"{tmp_path / 'models.py'}:llama", str(tmp_path / "golden")
    assert main(["golden", "update", "--model", entry, "--golden-dir", golden_dir]) == 0
    report = tmp_path / "check.json"
    status = main(["check", "--model", entry, "--golden-dir", golden_dir, "--backend",
                   "manual", "--backend", "sdpa", "--dtype", "fp32", "--json", str(report)])
    rows = json.loads(report.read_text())["results"]
    assert status == 0, [r["explain"] for r in rows if not r["ok"]]
    for row in rows:
        if row["verdict"] in ("identical", "within", "diverged", BASELINE_DEGRADED):
            headroom = math.inf if row["headroom"] == "inf" else row["headroom"]
            assert (row["verdict"] == "diverged") == (headroom > 1), row["explain"]
    reference = {r["output"]: r["verdict"] for r in rows if r["dtype"] == "fp64"}
    assert reference["outputs"] == reference["grads"] == "identical", reference


_LLAMA = '''
import torch
import transformers


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=64,
                                      max_position_embeddings=64, bos_token_id=1,
                                      eos_token_id=2)
    ids = torch.randint(3, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    return transformers.LlamaForCausalLM(config), {"input_ids": ids}
'''
