"""Which module a diagnosis across ranks names (diagnosis/ranks/judging.py): from every rank's
outputs of one call, streamed call by call to rank 0 (here by a gather in one process), and
from each rank's verdicts on its own gradient shards: no process group needed."""

from __future__ import annotations

import pytest
import torch

from torchparity.diagnosis.core.judging import judge_quickly
from torchparity.diagnosis.pipelines.ranks.judging import (
    GradVerdict,
    RankTensors,
    first_divergence,
    first_grad_divergence,
    judged_against_a,
    ranks_differ,
)

X = torch.linspace(-1, 1, 2 * 8).reshape(2, 8)


def sides(a: torch.Tensor, b: torch.Tensor) -> RankTensors:
    """One rank's A, golden (A in float64: A is exact) and B outputs of one call."""
    return {"output": a}, {"output": a.double()}, {"output": b}


def judged(key: str, parts: list[RankTensors]):
    return judged_against_a(key, "Linear", parts, None)


def streamed(calls: dict[str, list[RankTensors]], said: list[bool] | None = None, judge=judged):
    """``first_divergence`` over ``calls`` (key -> each rank's sides) as rank 0 runs it, with
    a gather that hands it the other ranks' sides of the call rank 0 gives; which calls
    rank 0 gave, and what it told the other ranks after each (into ``said``)."""
    given, said = [], [] if said is None else said

    def held(key: str) -> RankTensors:
        given.append(key)
        return calls[key][0]

    def gather(mine: RankTensors) -> list[RankTensors]:
        return [mine, *calls[given[-1]][1:]]

    def stop(diverged: bool) -> bool:
        said.append(diverged)
        return diverged

    return first_divergence(list(calls), held, judge, gather, stop), given, said


def test_the_ranks_stop_at_the_first_call_that_diverges_and_gather_no_later_one():
    calls = {"embed": [sides(X, X), sides(X, X)],
             "up": [sides(X, X), sides(X, 1.5 * X)],  # rank 1's B far off A
             "head": [sides(X, 2 * X), sides(X, 2 * X)]}
    (judged, first), given, said = streamed(calls)
    assert (judged, first.module, first.ranks, first.result.verdict) == (2, "up", [1],
                                                                         "diverged")
    assert given == ["embed", "up"] and said == [False, True]  # head's never gathered


def test_a_call_rank_0_fails_to_judge_lets_the_other_ranks_go_before_rank_0_fails():
    def judge(key: str, parts: list[RankTensors]):
        if key == "up":
            raise RuntimeError("up cannot be judged")
        return judged(key, parts)

    said: list[bool] = []
    with pytest.raises(RuntimeError, match="up cannot be judged"):
        streamed({name: [sides(X, X), sides(X, X)] for name in ("embed", "up", "head")},
                 said, judge)
    assert said == [False, True]  # else they would wait for rank 0 at head's gather


def test_a_correct_run_is_judged_call_by_call_to_the_end():
    (judged, first), given, said = streamed({"embed": [sides(X, X), sides(X, X)],
                                             "head": [sides(X, X), sides(X, X)]})
    assert (judged, first, given, said) == (2, None, ["embed", "head"], [False, False])


def test_columns_a_keeps_per_rank_are_joined_to_judge_b_s_gathered_whole():
    # A keeps each rank's half of the columns; B gathers them, in order or swapped
    left, right = X[:, :4], X[:, 4:]
    swapped = torch.cat([right, left], dim=1)
    in_order = judged_against_a("up", "Linear", [sides(left, X), sides(right, X)], None)
    out_of_order = judged_against_a("up", "Linear",
                                    [sides(left, swapped), sides(right, swapped)], None)
    assert [r.ok for r in in_order.results] == [True, True]
    assert [r.verdict for r in out_of_order.results] == ["diverged", "diverged"]
    # A's columns joined are alike on every rank: so must B's gathered wholes be
    assert in_order.copies is not None and ranks_differ(in_order.copies) is None


def test_a_replicated_output_one_rank_computes_otherwise_differs_between_ranks():
    drifted = X * (1 + 2**-20)  # far inside any budget, but not the same bits
    (judged, first), _, _ = streamed({"norm": [sides(X, X), sides(X, drifted)]})
    assert first.result.ok is False and first.result.verdict == "differs between ranks"
    assert (judged, first.ranks) == (1, [1]) and 0 < first.result.difference <= 2**-20


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
