"""Which module's gradients a diagnosis across ranks names (diagnosis/ranks/judging.py), from
each rank's verdicts on its own shards: no process group needed."""

from __future__ import annotations

import torch

from torchparity.diagnosis.judging import judge_quickly
from torchparity.diagnosis.ranks.judging import (
    GradVerdict,
    first_grad_divergence,
    ranks_differ,
)


def verdict(module: str, b: torch.Tensor, a: torch.Tensor, a_digest: str, b_digest: str
            ) -> GradVerdict:
    golden = {"param.weight": a.double()}
    result = judge_quickly({"param.weight": b}, golden, {"param.weight": a}, "grad")
    return GradVerdict(module, "Linear", result, a_digest, b_digest)


def test_a_gradient_within_budget_on_every_rank_but_unlike_between_ranks_is_named():
    a = torch.linspace(-1, 1, 64)
    drifted = a * (1 + 2**-20)  # far inside any budget, but not the same bits
    everyone = [[verdict("head", a, a, "A", "B0"), verdict("norm", a, a, "A", "B")],
                [verdict("head", drifted, a, "A", "B1"), verdict("norm", a, a, "A", "B")]]
    assert all(v.result.ok for rank in everyone for v in rank)
    assert first_grad_divergence(everyone) == (1, None, "head")
    differ = ranks_differ([{"g": a}, {"g": drifted}], "gradient")
    assert differ.ranks == [1] and 0 < differ.difference <= 2**-20
    assert "the gradient of rank(s) 1 differs from rank 0's" in differ.explain()


def test_shards_that_differ_between_ranks_in_a_as_in_b_are_not_a_divergence():
    # each rank holds another slice of a column-parallel weight's gradient: A's differ too
    a0, a1 = torch.linspace(-1, 0, 32), torch.linspace(0, 1, 32)
    everyone = [[verdict("up", a0, a0, "A0", "B0")], [verdict("up", a1, a1, "A1", "B1")]]
    assert first_grad_divergence(everyone) == (1, None, None)


def test_the_first_module_a_backward_reaches_that_diverges_on_a_rank_is_named():
    a = torch.linspace(-1, 1, 64)
    everyone = [[verdict("head", a, a, "A", "B"), verdict("norm", a, a, "A", "B")],
                [verdict("head", a, a, "A", "B"), verdict("norm", 2 * a, a, "A", "C")]]
    judged, first, flagged = first_grad_divergence(everyone)
    assert (judged, first.module, first.ranks, flagged) == (2, "norm", [1], None)
    assert first.result.verdict == "diverged"
