"""The quick judgement of a diagnosis decides only what the full comparison decides: a bound
it gives has the full verdict and, for "within", at least the share of the budget the full one
reports; every other case goes to the full comparison. Checked on exact tensors and on sketched
ones (the golden kept as a sketch, as a big tensor's is in a trace), against candidates from a
rounding of the golden's own size to many times it, everywhere or only where a sketch keeps no
exact element."""

import pytest
import torch

from torchparity import sketching
from torchparity.diagnosis.core.judging import judge, judge_quickly
from torchparity.diagnosis.core.results import Bounded, headroom

#: Candidate errors as multiples of A's own rounding error.
SCALES = (0.0, 0.5, 1.0, 2.0, 8.0, 40.0)


def sides(seed: int, scale: float, kind: str, inner: bool) -> tuple[dict, dict, dict]:
    """Golden (float64), A (the golden rounded to float32) and B (the golden moved by
    ``scale`` times a rounding of the same size, then rounded to float32; with ``inner``, only
    away from the first and last rows, where a sketch keeps no exact element)."""
    gen = torch.Generator().manual_seed(seed)
    golden = torch.randn(8, 64, 64, generator=gen, dtype=torch.float64)
    if kind == "grad":
        golden = golden * 1e-3
    a = golden.float()
    step = (a.double() - golden).abs().mean()
    b = (golden + scale * step * torch.randn(golden.shape, generator=gen,
                                             dtype=torch.float64)).float()
    if scale == 0.0:
        b = a.clone()
    if inner:  # moved only between a sketch's exact slices (its first and last rows)
        b = torch.cat([a[:, :1], b[:, 1:-1], a[:, -1:]], dim=1)
    return {"output": b}, {"output": golden}, {"output": a}


@pytest.mark.parametrize("sketched", [False, True], ids=["exact", "sketched"])
@pytest.mark.parametrize("kind", ["forward", "grad"])
def test_a_quick_verdict_is_the_full_one_and_bounds_its_share(
        sketched: bool, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(sketching.SKETCH_ABOVE_ENV, "1024")
    bounded = diverged = 0
    for seed in range(6):
        for scale, inner in [(scale, inner) for scale in SCALES for inner in (False, True)]:
            candidate, golden, baseline = sides(seed, scale, kind, inner)
            if sketched:
                golden = {p: sketching.sketch(t, p) for p, t in golden.items()}
            full = judge(candidate, golden, baseline, kind)
            quick = judge_quickly(candidate, golden, baseline, kind)
            if isinstance(quick, Bounded):
                bounded += 1
                assert full.ok, (seed, scale)
                assert quick.verdict == full.verdict
                if quick.verdict == "within":  # an identical one reports no share
                    assert quick.headroom >= headroom(full), (seed, scale)
            else:
                assert quick.verdict == full.verdict
            diverged += not full.ok
    assert bounded >= 6 * 3 * 2  # a rounding up to its own size is bounded quickly
    assert diverged >= 6 * 2  # and a change 40 times it is judged in full, and fails


def test_a_call_of_a_sketched_and_an_exact_tensor_is_judged_as_in_full(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A big output kept as a sketch beside a small one kept whole (a decoder's logits and its
    cache): each tensor is bounded by its own rule, and the verdict is the full one's."""
    monkeypatch.setenv(sketching.SKETCH_ABOVE_ENV, "1024")
    for scale in (0.5, 40.0):
        big = sides(0, scale, "forward", False)
        small = [{"small": side["output"][0, :4, :4].clone()} for side in sides(1, 0.5,
                                                                              "forward", False)]
        candidate, golden, baseline = ({**b, **s} for b, s in zip(big, small, strict=True))
        golden["output"] = sketching.sketch(golden["output"], "output")
        quick = judge_quickly(candidate, golden, baseline, "forward")
        assert quick.verdict == judge(candidate, golden, baseline, "forward").verdict
        assert quick.ok == (scale < 1.0)
