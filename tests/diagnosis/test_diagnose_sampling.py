"""Decoding diagnosis of seeded sampling: A samples with torchparity's uniforms, B and the golden
are fed A's samples, and a changed draw (B's draw with A's uniform) is a near tie only when the
uniform lies within the noise budget of the boundary that moved."""

from __future__ import annotations

import copy
import json
import random
from pathlib import Path

import pytest
import torch

import torchparity as tp
from torchparity.cli import main
from torchparity.diagnosis.core.decode_reference import DecodeReference
from torchparity.diagnosis.pipelines.decoding.judging import judge_steps
from torchparity.diagnosis.pipelines.decoding.sampling import first_changed_draws
from torchparity.subject import hf
from torchparity.subject.factory import resolve_entry
from torchparity.subject.sampling import SampleSettings, drawn, probabilities, uniforms

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one thread is faster

TOYS = Path(__file__).with_name("toy_decoders.py")
SETTINGS = SampleSettings(temperature=0.7, top_k=20, top_p=0.9, seed=5)


def test_a_temperature_applied_twice_is_a_real_change_from_the_first_draw() -> None:
    clean = resolve_entry(f"{TOYS}:clean")()

    def twice(model, tokens, state):  # the refactor divides by the temperature once more
        logits, state = clean["step"](model, tokens, state)
        return logits / SETTINGS.temperature, state

    report = tp.diagnose_decode(clean["model"], copy.deepcopy(clean["model"]), clean["inputs"],
                                step=clean["step"], step_b=twice, steps=4, sample=SETTINGS)
    assert report.first_step == 0 and report.meta.tokens == "A's samples"
    first = min(report.flips, key=lambda f: f.step)
    assert first.step == 0 and first.verdict == "real change", report.render(100)
    assert not report.ok


@pytest.mark.transformers
def test_transformers_eager_against_sdpa_with_the_same_seed_changes_no_draw_but_by_noise():
    import tiny_transformers

    torch.manual_seed(0)
    model = tiny_transformers.llama().eval()
    eager, sdpa = copy.deepcopy(model), copy.deepcopy(model)
    hf.set_attention(eager, hf.EAGER)
    hf.set_attention(sdpa, hf.SDPA)
    ids = torch.randint(3, 64, (8, 6), generator=torch.Generator().manual_seed(0))
    report = tp.diagnose_decode(eager, sdpa, {"input_ids": ids}, steps=6, sample=SETTINGS)
    assert report.first_step is None, report.render(100)
    assert all(f.verdict == "near tie" for f in report.flips) and report.ok


def _reference(a: list[torch.Tensor], golden: list[torch.Tensor]) -> DecodeReference:
    return DecodeReference(tokens=torch.empty(1, 0, dtype=torch.long), greedy=False, logits=a,
                           golden_logits=golden, calls={}, store=None, signatures={}, golden="")


@pytest.mark.parametrize(("moved", "verdict"), [(2e-7, "near tie"), (1e-2, "real change")])
def test_a_changed_draw_is_a_near_tie_only_within_noise_of_its_boundary(moved: float,
                                                                        verdict: str) -> None:
    """Two tokens; A's boundary lies just below the uniform (A draws token 1), B's moved by
    ``moved`` across it (B draws token 0). A carries fp32-sized noise against the golden."""
    settings = SampleSettings(seed=3)
    u = float(uniforms(3, 1, 1)[0, 0])
    boundary = u - moved / 2

    def logits(p0: float) -> torch.Tensor:  # log-odds of token 0 at probability p0
        return torch.tensor([[0.0, float(torch.tensor(p0 / (1 - p0)).log().neg())]],
                            dtype=torch.float64)

    golden = logits(boundary)
    a = (golden + torch.tensor([[0.0, 1e-7]], dtype=torch.float64)).float()
    b = logits(u + moved / 2).float()
    reference = _reference([a], [golden])
    changed = first_changed_draws(reference, [b], judge_steps(reference, [b]), settings)
    assert [(f.a_token, f.b_token) for f in changed] == [(1, 0)]
    assert changed[0].verdict == verdict, changed


def test_sampling_draws_by_inverse_cdf_from_the_processed_distribution() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    # top-k 3 keeps the three largest, top-p 0.8 of those the fewest reaching 0.8
    kept = torch.tensor([2.0, 1.0, 0.5], dtype=torch.float64).div(1.25).softmax(-1)
    assert kept[0] < 0.8 <= kept[0] + kept[1]
    expected = torch.tensor([kept[0], kept[1], 0, 0, 0], dtype=torch.float64) / kept[:2].sum()
    probs = probabilities(logits, SampleSettings(temperature=1.25, top_k=3, top_p=0.8))
    torch.testing.assert_close(probs[0], expected)
    grid = (torch.arange(10_000, dtype=torch.float64) + 0.5) / 10_000
    counts = torch.bincount(drawn(probs.expand(len(grid), -1), grid), minlength=5)
    assert (counts / len(grid) - expected).abs().max() <= 1e-4
    # the uniforms are Python's Mersenne Twister, the same on every machine
    python = random.Random(7)
    assert uniforms(7, 2, 3).flatten().tolist() == [python.random() for _ in range(6)]


def test_sampling_across_revisions_and_on_the_command_line(tmp_path: Path, capsys) -> None:
    trace = tmp_path / "base.tptrace"
    assert main(["record", f"{TOYS}:clean", "--decode", "--sample", "--temperature", "0.7",
                 "--top-k", "20", "--top-p", "0.9", "--seed", "5", "--steps", "4", "-o",
                 str(trace)]) == 0
    assert "(sampled)" in capsys.readouterr().out
    out = tmp_path / "report.json"
    assert main(["diagnose", f"{TOYS}:reordered", "--against", str(trace), "--json",
                 str(out)]) == 0
    decode = json.loads(out.read_text())["decode"]
    assert decode["sample"] == SETTINGS.to_dict()
    assert main(["diagnose", f"{TOYS}:off_by_one", "--against", str(trace)]) == 1
    text = capsys.readouterr().out
    assert "changed draw" in text and max(map(len, text.splitlines())) <= 80
    for args, message in ((["--decode", "--top-p", "0.5"], "--top-p: options of sampling; "
                                                           "add --sample"),
                          (["--decode", "--sample", "--beams", "2"], "without beams"),
                          (["--decode", "--sample", "--temperature", "0"],
                           "--temperature must be above 0")):
        assert main(["diagnose", f"{TOYS}:clean", f"{TOYS}:reordered", *args]) == 2
        assert message in capsys.readouterr().err
