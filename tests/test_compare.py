"""Properties and hand-computed cases of the comparison engine."""

from __future__ import annotations

import json
import math
from collections import OrderedDict, namedtuple
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra.numpy import array_shapes, arrays
from torch.utils import _pytree as pytree

from torchparity.comparison import (
    NOT_COMPARED,
    Comparison,
    ShapeDifference,
    StructureDifference,
    StructureMismatch,
    assert_parity,
    compare,
    shared_tensors,
)
from torchparity.reference import TransformerConfig, build_model, positions, variants, zoo
from torchparity.tolerance import KINDS, Measurement, budget, error

FLOAT_DTYPES = [torch.float64, torch.float32, torch.bfloat16, torch.float16]

finite_goldens = arrays(
    np.float64,
    array_shapes(min_dims=1, max_dims=3, max_side=5),
    elements=st.floats(-100, 100, allow_nan=False),
).map(torch.from_numpy)


@st.composite
def tensors_with_specials(draw: st.DrawFn) -> torch.Tensor:
    x = draw(
        arrays(
            np.float64,
            array_shapes(min_dims=0, max_dims=3, max_side=5),
            elements=st.floats(allow_nan=True, allow_infinity=True, width=16),
        )
    )
    return torch.from_numpy(x).to(draw(st.sampled_from(FLOAT_DTYPES)))


Pair = namedtuple("Pair", ["first", "second"])


@dataclass
class Output:
    logits: torch.Tensor
    past: list[torch.Tensor]


class ModelOutput(OrderedDict):
    """The shape of Hugging Face's ModelOutput: an OrderedDict subclass with attributes."""


# --- verdicts -------------------------------------------------------------------------------


@given(tensors_with_specials())
def test_a_tensor_compared_with_itself_is_identical(x: torch.Tensor) -> None:
    result = compare(x, x.clone(), equal_nan=True)
    assert result.verdict == "identical" and result.ok
    assert compare(x, x.double(), x.clone(), equal_nan=True).verdict == "identical"


@given(finite_goldens, arrays(np.float64, 1, elements=st.floats(-1, 1)), st.floats(0, 1e-3))
def test_a_larger_perturbation_never_gives_a_smaller_error(
    golden: torch.Tensor, direction: np.ndarray, t: float
) -> None:
    delta = torch.from_numpy(direction).expand_as(golden)
    small = compare(golden + t * delta, golden, kind="grad").tensors[0]
    large = compare(golden + 2 * t * delta, golden, kind="grad").tensors[0]
    assert large.max_abs >= small.max_abs
    assert large.rms >= small.rms
    assert large.headroom >= small.headroom
    assert large.n_over >= small.n_over
    if large.verdict == "within":
        assert small.verdict in ("within", "identical")


def _near_two(units: int) -> float:
    return 2.0 + units * 2.0**-22  # float32 spacing in [2, 4) is 2**-22


def test_hand_computed_budget_separates_within_from_diverged() -> None:
    golden = torch.tensor([1.0, 2.0], dtype=torch.float64)
    baseline = torch.tensor([1.0 + 2.0**-20, 2.0], dtype=torch.float32)  # error exactly 2**-20
    tol = KINDS["forward"]
    subnormal = torch.finfo(torch.float32).tiny * torch.finfo(torch.float32).eps
    # The baseline's error, 8 roundoffs of the absmax 2, is over the noise floor: it is the noise.
    budget = tol.fudge * 2.0**-20 + tol.floor_ulps * (2.0**-24 * 2.0 + subnormal)
    allowed = math.floor(budget / 2.0**-22)  # float32 steps above 2 that stay within budget

    within = compare(torch.tensor([1.0, _near_two(allowed)]), golden, baseline)
    broken = compare(torch.tensor([1.0, _near_two(allowed + 1)]), golden, baseline)

    assert within.verdict == "within" and within.worst.budget.value == budget
    assert within.worst.error == allowed * 2.0**-22
    assert within.worst.headroom == allowed * 2.0**-22 / budget <= 1
    assert broken.verdict == "diverged" and not broken.ok
    assert broken.worst.worst_index == (1,)
    assert broken.worst.n_over == 1 and broken.worst.frac_over == 0.5
    assert (
        broken.worst.candidate_value,
        broken.worst.baseline_value,
        broken.worst.golden_value,
    ) == (
        _near_two(allowed + 1),
        2.0,
        2.0,
    )


def test_candidate_equal_to_the_baseline_is_identical_even_when_both_are_off() -> None:
    golden = torch.tensor([1.0, 2.0], dtype=torch.float64)
    baseline = torch.tensor([1.0 + 2.0**-20, 2.0])
    assert compare(baseline.clone(), golden, baseline).verdict == "identical"


def test_identical_without_baseline_needs_the_golden_dtype() -> None:
    golden = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert compare(golden.clone(), golden).verdict == "identical"
    assert compare(golden.float(), golden).verdict == "within"


def test_budget_is_per_tensor_and_worst_is_the_largest_share() -> None:
    golden = {"a": torch.ones(4, dtype=torch.float64), "b": torch.ones(4, dtype=torch.float64)}
    candidate = {"a": torch.ones(4), "b": torch.tensor([1.0, 1.0, 1.0, 1.0 + 2.0**-23])}
    result = compare(candidate, golden)
    assert [t.verdict for t in result.tensors] == ["within", "within"]
    assert result.worst.path == 'outputs["b"]'


def test_compute_dtype_override_widens_the_budget() -> None:
    golden = torch.linspace(-1, 1, 16, dtype=torch.float64)
    candidate = golden.float() * (1 + 2.0**-12)
    assert not compare(candidate, golden).ok
    assert compare(candidate, golden, compute_dtype="tf32").ok


def test_trajectory_budget_grows_with_the_step() -> None:
    golden = torch.linspace(1, 2, 8, dtype=torch.float64)
    baseline = golden + 2.0**-20
    at_start = budget(Measurement(golden, baseline_error=2.0**-20, compute_dtype="fp32",
                                  kind="trajectory"))
    candidate = golden + 1.5 * at_start.value  # float64, judged as fp32 compute
    assert 1.5 < 1 + KINDS["trajectory"].per_step_growth * 10
    assert not compare(candidate, golden, baseline, "trajectory", compute_dtype="fp32").ok
    assert compare(candidate, golden, baseline, "trajectory", compute_dtype="fp32", step=10).ok


def test_integer_tensors_must_match_exactly() -> None:
    tokens = torch.tensor([[3, 1, 4], [1, 5, 9]])
    assert compare(tokens, tokens.clone()).verdict == "identical"
    other = tokens.clone()
    other[1, 2] = 2
    result = compare(other, tokens)
    assert result.verdict == "diverged" and result.worst.worst_index == (1, 2)
    assert "must match exactly" in result.explain()


def test_an_exact_tensor_repeating_the_baseline_is_not_identical_when_the_golden_differs(
) -> None:
    golden, baseline = torch.tensor([[3, 1, 4, 1]]), torch.tensor([[3, 1, 4, 2]])
    result = compare(baseline.clone(), golden, baseline)
    assert result.verdict == "diverged" and not result.explain().startswith("identical")
    assert "1 of 4 element(s) differ" in result.explain()


def test_empty_tensors_are_identical() -> None:
    assert compare(torch.empty(0, 3), torch.empty(0, 3, dtype=torch.float64)).ok


# --- non-finite values ----------------------------------------------------------------------


def test_nan_in_the_candidate_where_the_golden_is_finite_diverges_and_says_so() -> None:
    golden = torch.arange(6, dtype=torch.float64)
    candidate = golden.float()
    candidate[[1, 3, 4]] = math.nan
    result = compare(candidate, golden, golden.float())
    assert result.verdict == "diverged"
    assert "candidate has 3 NaN where golden is finite" in result.explain()
    assert result.worst.worst_index == (1,) and math.isinf(result.worst.headroom)


@pytest.mark.parametrize(
    ("candidate_value", "golden_value"),
    [(math.inf, 1.0), (-math.inf, math.inf), (math.nan, math.inf), (1.0, math.nan)],
)
def test_every_non_finite_disagreement_diverges(
    candidate_value: float, golden_value: float
) -> None:
    golden = torch.tensor([0.5, golden_value], dtype=torch.float64)
    candidate = torch.tensor([0.5, candidate_value])
    assert compare(candidate, golden).verdict == "diverged"


def test_matching_non_finite_values_are_excluded_and_reported() -> None:
    golden = torch.tensor([math.nan, math.inf, 1.0, 2.0], dtype=torch.float64)
    candidate = torch.tensor([math.nan, math.inf, 1.0, 2.0 + 2.0**-22])
    result = compare(candidate, golden, equal_nan=True)
    assert result.ok
    assert result.worst.max_abs == 2.0**-22 and result.worst.worst_index == (3,)
    text = result.explain()
    assert "1 matching NaN" in text and "1 matching inf" in text


# --- masked entries ---------------------------------------------------------------------------

SENTINELS = (-65504.0, torch.finfo(torch.float32).min, -math.inf)


def _masked_logits(seed: int, banned: list[int]) -> torch.Tensor:
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    logits[:, banned] = math.nan  # placeholders, written per side below
    return logits


@pytest.mark.parametrize("golden_sentinel", SENTINELS)
@pytest.mark.parametrize("candidate_sentinel", SENTINELS)
def test_masked_entries_agree_whatever_constant_each_side_writes_and_never_set_the_scale(
    candidate_sentinel: float, golden_sentinel: float
) -> None:
    golden = _masked_logits(0, [2, 7])
    scale = golden.nan_to_num(nan=0.0).abs().max().item()  # what the budget must scale with
    candidate = golden.float().nan_to_num(nan=candidate_sentinel)
    golden = golden.nan_to_num(nan=golden_sentinel)
    result = compare(candidate, golden, candidate.clone())
    assert result.verdict == "identical" and result.worst.budget.scale == scale
    assert "6 element(s) masked (<= -65504)" in result.explain()
    changed = candidate.clone()
    changed[1, 3] += 1e-3 * scale  # far below a sentinel's size, far above fp32 rounding
    assert compare(changed, golden, candidate).verdict == "diverged"


@pytest.mark.parametrize("sentinel", SENTINELS)
def test_an_entry_masked_on_one_side_only_diverges(sentinel: float) -> None:
    golden = _masked_logits(1, [5]).nan_to_num(nan=sentinel)
    candidate = golden.float()
    candidate[0, 5] = -3.0  # the candidate lets a banned token through
    result = compare(candidate, golden)
    assert result.verdict == "diverged" and result.worst.worst_index == (0, 5)
    assert "the golden masks 1 element(s) (<= -65504) where the candidate has a value" in (
        result.explain())


def test_a_large_negative_value_above_the_threshold_is_judged_by_value() -> None:
    golden = torch.tensor([-60000.0, 1.0], dtype=torch.float64)
    assert compare(golden.float(), golden).verdict == "within"
    assert compare(torch.tensor([-65504.0, 1.0]), golden).verdict == "diverged"


def _assert_close_accepts(actual: torch.Tensor, expected: torch.Tensor, equal_nan: bool) -> bool:
    try:
        torch.testing.assert_close(actual, expected, equal_nan=equal_nan)
    except AssertionError:
        return False
    return True


@given(tensors_with_specials(), st.booleans(), st.booleans())
def test_nan_positions_follow_assert_close(x: torch.Tensor, plant: bool, equal_nan: bool) -> None:
    if plant and x.numel():
        x.view(-1)[0] = math.nan  # ten examples rarely draw a NaN by themselves
    accepted = _assert_close_accepts(x, x.clone(), equal_nan)
    assert compare(x, x.clone(), equal_nan=equal_nan).ok == accepted


def test_nan_where_the_golden_has_nan_fails_by_default_and_says_how_to_accept_it() -> None:
    golden = torch.tensor([math.nan, 1.0], dtype=torch.float64)
    candidate = torch.tensor([math.nan, 1.0])
    result = compare(candidate, golden)
    assert not result.ok
    assert "candidate has 1 NaN where golden has NaN too; pass equal_nan=True" in result.explain()
    assert compare(candidate, golden, equal_nan=True).ok


def test_to_dict_is_strict_json_even_with_non_finite_values() -> None:
    golden = {"x": torch.tensor([1.0, 2.0], dtype=torch.float64)}
    result = compare({"x": torch.tensor([math.nan, 2.0])}, golden)
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert data["verdict"] == "diverged" and data["tensors"][0]["headroom"] == "inf"


# --- structure ------------------------------------------------------------------------------

ONE = torch.ones(2)  # the candidate's copy of a shared output ...
ONE64 = torch.ones(2, dtype=torch.float64)  # ... and the golden's: equal values, "within"


def _nest(keys: list[str | int], leaf: object) -> object:
    for key in reversed(keys):
        leaf = {key: leaf} if isinstance(key, str) else [None] * key + [leaf]
    return leaf


def _path(keys: list[str | int]) -> str:
    return "outputs" + "".join(f'["{k}"]' if isinstance(k, str) else f"[{k}]" for k in keys)


@given(st.lists(st.one_of(st.sampled_from(["logits", "past", "h"]), st.integers(0, 3)), max_size=4))
def test_a_shape_change_is_a_divergence_of_its_own_at_its_path(keys: list[str | int]) -> None:
    candidate = _nest(keys, torch.zeros(1, 2, 1, 12))
    golden = _nest(keys, torch.zeros(1, 2, 1, 11, dtype=torch.float64))
    result = compare(candidate, golden)
    assert result.shapes == (ShapeDifference(_path(keys), (1, 2, 1, 12), (1, 2, 1, 11)),)
    assert not result.structure_differs and result.tensors == []
    assert result.verdict == "diverged" and not result.ok
    assert f"{_path(keys)}: (1, 2, 1, 12) vs (1, 2, 1, 11)" in result.explain()


def test_a_shape_change_fails_beside_tensors_within_and_in_assert_parity() -> None:
    candidate = {"out": torch.ones(2), "probs": torch.full((1, 2, 1, 12), 1 / 12)}
    golden = {"out": torch.ones(2, dtype=torch.float64),
              "probs": torch.full((1, 2, 1, 11), 1 / 11, dtype=torch.float64)}
    result = compare(candidate, golden)
    assert [t.verdict for t in result.tensors] == ["within"] and result.verdict == "diverged"
    assert result.to_dict()["shapes"] == [
        {"path": 'outputs["probs"]', "candidate": [1, 2, 1, 12], "golden": [1, 2, 1, 11]}]
    with pytest.raises(AssertionError, match="shape differs"):
        assert_parity(candidate, golden, allow_structure_changes=True)


@pytest.mark.parametrize(
    ("candidate", "golden", "difference"),
    [
        ({"y": ONE}, {"y": ONE64, "a": ONE64}, ('outputs["a"]', "missing", "Tensor(2) float64")),
        ({"y": ONE, "a": ONE}, {"y": ONE64}, ('outputs["a"]', "Tensor(2) float32", "missing")),
        ((ONE, None), (ONE64, ONE64), ("outputs[1]", "None", "Tensor(2) float64")),
        ((ONE, ONE), (ONE64, (ONE64, ONE64)), ("outputs[1]", "Tensor(2) float32", "tuple of 2")),
        ([ONE], [ONE64, ONE64], ("outputs[1]", "missing", "Tensor(2) float64")),
        ((ONE, {"a": ONE}), (ONE64, [ONE64]), ("outputs[1]", "dict of 1", "list of 1")),
        ({"y": ONE, "n": 3}, {"y": ONE64, "n": 3.0}, ('outputs["n"]', "int 3", "float 3.0")),
        (
            {"y": ONE, "s": "mean"},
            {"y": ONE64, "s": "sum"},
            ('outputs["s"]', "str 'mean'", "str 'sum'"),
        ),
        (
            (ONE, torch.ones(2, dtype=torch.long)),
            (ONE64, ONE64),
            ("outputs[1]", "Tensor(2) int64", "Tensor(2) float64"),
        ),
        (
            Pair(ONE, torch.ones(2)),
            Pair(ONE64, torch.ones(2, dtype=torch.long)),
            ("outputs.second", "Tensor(2) float32", "Tensor(2) int64"),
        ),
    ],
)
def test_structure_differences_name_the_path_and_both_sides_beside_the_numeric_verdict(
    candidate: object, golden: object, difference: tuple[str, str, str]
) -> None:
    result = compare(candidate, golden)
    assert result.structure == (StructureDifference(*difference),)
    assert [t.verdict for t in result.tensors] == ["within"]  # the one shared tensor
    assert result.verdict == "within" and result.ok


def test_lists_and_tuples_align_by_position_and_mappings_by_key() -> None:
    assert not compare((ONE, ONE), [ONE64, ONE64]).structure_differs
    result = compare(OrderedDict(b=ONE, a=ONE), {"a": ONE64, "b": ONE64})
    assert not result.structure_differs
    assert [t.path for t in result.tensors] == ['outputs["a"]', 'outputs["b"]']  # golden's order


def test_a_structure_difference_is_said_in_explain_repr_and_to_dict() -> None:
    result = compare({"y": ONE, "attn": None}, {"y": ONE64, "attn": ONE64})
    text = result.explain()
    assert text.startswith("within: all 1 tensor(s) within budget")
    difference = 'outputs["attn"]: candidate None, golden Tensor(2) float64'
    assert f"Structure differs at 1 path(s): {difference}." in text
    assert "structure_differs=True" in repr(result)
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert data["verdict"] == "within" and data["structure_differs"] is True
    assert data["structure"] == [
        {"path": 'outputs["attn"]', "candidate": "None", "golden": "Tensor(2) float64"}
    ]
    assert "structure_differs" not in repr(compare({"y": ONE}, {"y": ONE64}))


def test_assert_parity_fails_on_a_structure_difference_unless_it_is_allowed() -> None:
    candidate, golden = (ONE, None), (ONE64, ONE64)
    with pytest.raises(AssertionError, match=r"Structure differs at 1 path\(s\): outputs\[1\]"):
        assert_parity(candidate, golden)
    assert assert_parity(candidate, golden, allow_structure_changes=True).structure_differs
    with pytest.raises(AssertionError, match="diverged"):
        assert_parity((ONE * 2, None), golden, allow_structure_changes=True)


@pytest.mark.parametrize("candidate, golden", [
    ({"state": ONE}, {"hidden": ONE64}),  # renamed: nothing shared
    ((ONE, ONE), {"logits": ONE64}),  # another container
])
def test_nothing_compared_is_not_identical_and_never_passes(candidate, golden) -> None:
    result = compare(candidate, golden)
    assert not result.compared and result.verdict == NOT_COMPARED == "not compared"
    assert not result.ok
    assert result.explain().startswith("not compared: ")
    assert "identical" not in result.explain()
    with pytest.raises(AssertionError, match="^not compared: "):
        assert_parity(candidate, golden, allow_structure_changes=True)


def test_two_sides_without_tensors_differ_in_nothing() -> None:
    result = compare({"attentions": None}, {"attentions": None})
    assert result.compared and result.ok and result.verdict == "identical"
    assert result.explain().startswith("identical: neither side holds a tensor")


def test_the_baseline_need_only_hold_the_shared_tensors() -> None:
    golden = {"y": ONE64, "attn": ONE64}  # the baseline has the golden's structure
    result = compare({"y": ONE}, golden, {"y": ONE, "attn": ONE})
    assert result.verdict == "identical" and result.structure_differs
    with pytest.raises(StructureMismatch, match=r'^outputs\["y"\]: missing in the baseline'):
        compare({"y": ONE}, golden, {"attn": ONE})
    with pytest.raises(StructureMismatch) as info:
        compare({"y": ONE}, golden, {"y": torch.ones(3)})
    assert str(info.value) == 'outputs["y"]: shape (2,) vs (3,) (candidate vs baseline)'


def test_baseline_must_have_the_candidate_dtype() -> None:
    golden = {"h": [torch.ones(2, dtype=torch.float64)]}
    candidate = {"h": [torch.ones(2, dtype=torch.bfloat16)]}
    with pytest.raises(StructureMismatch, match=r'outputs\["h"\]\[0\]: dtype torch.bfloat16 vs'):
        compare(candidate, golden, {"h": [torch.ones(2)]})


def test_shared_tensors_pair_what_both_sides_hold_still_attached_to_the_graph() -> None:
    weight = torch.ones(2, requires_grad=True)
    a = {"y": weight * 2, "attn": weight * 3, "n": 1.0, "extra": weight * 5}
    b = {"y": ONE64, "attn": None, "n": 1.0}
    shared = shared_tensors(a, b)
    assert [(path, x is a["y"], y is b["y"]) for path, x, y in shared] == [
        ('outputs["y"]', True, True)
    ]
    sum(x.sum() for _, x, _ in shared).backward()
    assert torch.equal(weight.grad, torch.full((2,), 2.0))  # d(2w)/dw: "y" alone reached


def test_dataclasses_namedtuples_and_model_outputs_are_walked() -> None:
    golden = ModelOutput(
        logits=torch.ones(2, dtype=torch.float64), hidden=Pair(torch.zeros(1), "x")
    )
    candidate = ModelOutput(logits=torch.ones(2), hidden=Pair(torch.zeros(1), "x"))
    result = compare(candidate, dict(golden))  # goldens are stored as plain dicts
    assert [t.path for t in result.tensors] == ['outputs["logits"]', 'outputs["hidden"].first']

    out = Output(logits=torch.ones(2), past=[torch.ones(1), torch.ones(1)])
    golden_out = Output(logits=torch.ones(2).double(), past=[torch.ones(1).double()] * 2)
    assert [t.path for t in compare(out, golden_out).tensors] == [
        "outputs.logits",
        "outputs.past[0]",
        "outputs.past[1]",
    ]


class Span:
    """A container that only torch's pytree registry knows how to open."""

    def __init__(self, start: torch.Tensor, end: torch.Tensor) -> None:
        self.start, self.end = start, end


class Bag:
    """Another, registered without key names."""

    def __init__(self, *items: torch.Tensor) -> None:
        self.items = items


class Settings:
    """An opaque leaf, like a model's config object."""


pytree.register_pytree_node(
    Span,
    lambda s: ([s.start, s.end], None),
    lambda children, _: Span(*children),
    flatten_with_keys_fn=lambda s: (
        [(pytree.GetAttrKey("start"), s.start), (pytree.GetAttrKey("end"), s.end)],
        None,
    ),
)
pytree.register_pytree_node(Bag, lambda b: (list(b.items), None), lambda c, _: Bag(*c))


def test_containers_registered_with_torch_pytree_are_walked() -> None:
    candidate = {"span": Span(ONE, ONE * 2), "bag": Bag(ONE)}
    golden = {"span": Span(ONE64, ONE64), "bag": Bag(ONE64)}
    result = compare(candidate, golden)
    assert [(t.path, t.verdict) for t in result.tensors] == [
        ('outputs["span"].start', "within"),
        ('outputs["span"].end', "diverged"),
        ('outputs["bag"][0]', "within"),
    ]


def test_opaque_leaves_are_skipped_and_listed_with_the_rule() -> None:
    result = compare({"y": ONE, "config": Settings()}, {"y": ONE64, "config": Settings()})
    assert [path for path, _ in result.skipped] == ['outputs["config"]']
    reason = result.skipped[0][1]
    assert reason.startswith("Settings: ")
    assert "register its class with torch.utils._pytree" in reason
    assert f'Not compared: outputs["config"] ({reason}).' in result.explain()
    assert "skipped=1" in repr(result)
    assert result.to_dict()["skipped"] == [{"path": 'outputs["config"]', "reason": reason}]
    other = compare({"config": Settings()}, {"config": 3})
    assert other.structure == (StructureDifference('outputs["config"]', "Settings", "int 3"),)


def test_none_and_equal_leaves_are_accepted() -> None:
    tree = {"cache": None, "n": 2, "name": "x", "dtype": torch.float32, "y": torch.ones(1)}
    result = compare(tree, dict(tree))
    assert result.verdict == "identical" and not result.structure_differs


# --- Python numbers -------------------------------------------------------------------------


@given(st.floats(-1e3, 1e3), st.floats(-1e-6, 1e-6))
def test_a_python_float_is_judged_like_a_0d_float64_tensor(x: float, delta: float) -> None:
    as_numbers = compare(x + delta, x).worst
    as_tensors = compare(
        torch.tensor(x + delta, dtype=torch.float64), torch.tensor(x, dtype=torch.float64)
    ).worst
    assert (as_numbers.verdict, as_numbers.error, as_numbers.budget) == (
        as_tensors.verdict,
        as_tensors.error,
        as_tensors.budget,
    )


def test_a_python_float_takes_the_compute_dtype_of_the_candidates_tensors() -> None:
    # A loss.item() of a float32 computation: 1e-12 off is far below float32's rounding.
    candidate = {"logits": ONE, "loss": 1.0 + 1e-12}
    golden = {"logits": ONE64, "loss": 1.0}
    result = compare(candidate, golden)
    assert result.ok and [t.compute_dtype for t in result.tensors] == ["fp32", "fp32"]
    assert compare(1.0 + 1e-12, 1.0, compute_dtype="fp32").ok
    # Alone a float is float64 arithmetic, where 1e-12 is thousands of units of roundoff.
    assert not compare(1.0 + 1e-12, 1.0).ok


@pytest.mark.parametrize(
    ("candidate", "golden", "verdict"),
    [(3, 3, "identical"), (3, 4, "diverged"), (True, True, "identical"), (True, False, "diverged")],
)
def test_ints_and_bools_match_exactly(candidate: int, golden: int, verdict: str) -> None:
    assert compare({"n": candidate}, {"n": golden}).verdict == verdict


# --- the escape hatch -----------------------------------------------------------------------


def test_atol_and_rtol_loosen_a_comparison_by_hand_and_say_so() -> None:
    golden = torch.linspace(1, 2, 8, dtype=torch.float64)
    candidate = (golden * (1 + 1e-3)).float()  # a thousand times fp32 rounding: diverged
    plain = compare(candidate, golden).worst
    assert plain.verdict == "diverged"
    error, scale = plain.error, plain.budget.scale
    loosened = {
        "atol": compare(candidate, golden, atol=error),
        "rtol": compare(candidate, golden, rtol=error / scale),
    }
    assert loosened["atol"].worst.budget.value == plain.budget.value + error
    for name, result in loosened.items():
        assert result.ok, name
        assert "Loosened by hand" in result.explain() and "(added by hand)" in result.explain()
        assert result.to_dict()[name] == getattr(result, name) > 0
        assert result.to_dict()["tensors"][0]["budget"][name] > 0
    with pytest.raises(ValueError, match="atol must be a finite number >= 0"):
        compare(candidate, golden, atol=-error)


def test_the_escape_hatch_leaves_exact_tensors_exact() -> None:
    tokens = torch.tensor([3, 1, 4])
    assert not compare(tokens + 1, tokens, atol=float(tokens.max())).ok


# --- metrics and reporting ------------------------------------------------------------------


@given(st.integers(1, 50), st.sampled_from([torch.float32, torch.bfloat16, torch.float16]))
def test_max_ulp_counts_representable_steps(steps: int, dtype: torch.dtype) -> None:
    golden = torch.tensor([1.5, -0.75], dtype=dtype)
    candidate = golden.clone()
    for _ in range(steps):
        candidate[0] = torch.nextafter(candidate[0], torch.tensor(math.inf, dtype=dtype))
    assert compare(candidate, golden.double()).worst.max_ulp == steps


def test_scaled_candidate_reports_relative_metrics() -> None:
    golden = torch.tensor([1.0, -2.0, 0.0, 4.0], dtype=torch.float64)
    result = compare(golden * 2, golden).worst
    assert result.rel_l2 == 1.0 and result.cosine == 1.0 and result.max_rel == 1.0
    assert compare(-golden, golden).worst.cosine == -1.0


def test_explain_gives_the_budget_formula_values_and_context() -> None:
    golden = torch.tensor([[1.0, 2.0]], dtype=torch.float64)
    baseline = torch.tensor([[1.0 + 2.0**-20, 2.0]])
    result = compare(
        {"logits": torch.tensor([[1.0, 2.5]])}, {"logits": golden}, {"logits": baseline}
    )
    text = result.explain()
    for part in (
        "diverged",
        'outputs["logits"] at index (0, 1)',
        "candidate 2.5, baseline 2, golden 2",
        f"{KINDS['forward'].fudge:g} × baseline error 9.54e-07",
        "floor",
        "Compute dtype fp32",
        "kind forward",
    ):
        assert part in text


def test_assert_parity_raises_the_explanation_or_returns_the_comparison() -> None:
    golden = torch.tensor([1.0, 2.0], dtype=torch.float64)
    assert isinstance(assert_parity(golden.float(), golden, kind="loss"), Comparison)
    with pytest.raises(AssertionError, match="diverged: 1 of 1 tensor"):
        assert_parity(golden.float() + 1, golden)


def test_comparison_truthiness_and_repr() -> None:
    golden = torch.ones(3, dtype=torch.float64)
    assert compare(golden.float(), golden)
    assert not compare(golden.float() * 2, golden)
    assert "verdict='diverged'" in repr(compare(golden.float() * 2, golden))


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_kind_can_be_compared(kind: str) -> None:
    # Baseline and candidate compute one fp32 product in different summation orders, as two
    # kernels would: the candidate is not bit-equal to the baseline, so the budget decides.
    g = torch.Generator().manual_seed(0)
    a = torch.randn(3, 64, dtype=torch.float64, generator=g)
    b = torch.randn(64, 5, dtype=torch.float64, generator=g)
    golden = a @ b
    baseline = a.float() @ b.float()
    candidate = (a.float().unsqueeze(-1) * b.float()).flip(1).sum(1)
    assert not torch.equal(candidate, baseline)
    assert compare(candidate, golden, baseline, kind, reduction_length=64).verdict == "within"
    # A thousandth of every value is far beyond the rounding of a length-64 fp32 sum.
    broken = candidate * (1 + 1e-3)
    assert compare(broken, golden, baseline, kind, reduction_length=64).verdict == "diverged"


def test_gradient_cancelled_to_zero_is_judged_at_its_modules_scale() -> None:
    # A bias gradient that is zero in exact arithmetic (float64 leaves ~1e-17) computed in fp32
    # carries rounding noise of the size of its module's gradients, not of the residue.
    weight = torch.ones(4, 8, dtype=torch.float64)
    golden = {"attn.k_proj.weight": weight, "attn.k_proj.bias": torch.full((8,), 1e-17)}
    baseline = {"attn.k_proj.weight": weight.float(), "attn.k_proj.bias": torch.full((8,), 1e-9)}
    noisy = {"attn.k_proj.weight": weight.float(), "attn.k_proj.bias": torch.full((8,), 1e-7)}
    assert compare(noisy, golden, baseline, kind="grad").ok
    # ... while a real error in the same tensor (a thousandth of the module's scale) fails.
    broken = {"attn.k_proj.weight": weight.float(), "attn.k_proj.bias": torch.full((8,), 1e-3)}
    assert not compare(broken, golden, baseline, kind="grad").ok
    # Outside a module that shows the scale, nothing is relaxed.
    alone = compare(
        noisy["attn.k_proj.bias"],
        golden["attn.k_proj.bias"],
        baseline["attn.k_proj.bias"],
        kind="grad",
    )
    assert not alone.ok


def test_a_modules_gradients_share_its_rounding_scale() -> None:
    # Under near-uniform attention the query gradient is a small difference of terms as large
    # as the value gradient; a kernel that orders that difference otherwise errs at their scale.
    golden = {
        "attn.q_proj.weight": torch.full((4, 8), 1e-4, dtype=torch.float64),
        "attn.v_proj.weight": torch.ones(4, 8, dtype=torch.float64),
    }
    baseline = {name: g.float() for name, g in golden.items()}
    reordered = {**baseline, "attn.q_proj.weight": baseline["attn.q_proj.weight"] + 1e-7}
    assert compare(reordered, golden, baseline, kind="grad").ok
    # Alone, the query gradient's own scale applies and the same error is too much ...
    alone = [t["attn.q_proj.weight"] for t in (reordered, golden, baseline)]
    assert not compare(*alone, kind="grad").ok
    # ... and within the module an error well above the module's rounding (64 * sqrt(8) * u
    # * 1, 1.1e-5 here) still fails: half of the query gradient.
    broken = {**baseline, "attn.q_proj.weight": baseline["attn.q_proj.weight"] * 1.5}
    assert not compare(broken, golden, baseline, kind="grad").ok


def test_a_cancelled_gradient_inherits_its_modules_rounding_in_bf16() -> None:
    # The query gradient, 1/30 of the value gradient here, is a difference of bf16 terms at the
    # value gradient's scale: an error of 7% of its own size is bf16 rounding of those terms.
    g = torch.Generator().manual_seed(0)
    golden = {
        "attn.q_proj.weight": 6e-3 * torch.randn(16, 16, dtype=torch.float64, generator=g),
        "attn.v_proj.weight": 0.18 * torch.randn(16, 16, dtype=torch.float64, generator=g),
    }
    baseline = {name: t.bfloat16() for name, t in golden.items()}
    noise = 4e-4 * torch.randn(16, 16, dtype=torch.float64, generator=g)
    rounded = {**baseline, "attn.q_proj.weight": (golden["attn.q_proj.weight"] + noise).bfloat16()}
    assert compare(rounded, golden, baseline, kind="grad").ok
    alone = [t["attn.q_proj.weight"] for t in (rounded, golden, baseline)]
    assert not compare(*alone, kind="grad").ok
    # A query gradient twice its size is no rounding, within the module or not.
    doubled = {**baseline, "attn.q_proj.weight": baseline["attn.q_proj.weight"] * 2}
    assert not compare(doubled, golden, baseline, kind="grad").ok


def test_a_lucky_baseline_draw_does_not_fail_a_legitimate_twin() -> None:
    # Found by the rotary-offset property (hypothesis profile dev, seed 37): the interleaved
    # rotary twin's bf16 scores at positions shifted by 5, against bf16 scores at the original
    # positions. The baseline happened to err a tenth of a bf16 roundoff of the largest score;
    # a budget of 4 times that draw failed the candidate, which erred three roundoffs.
    config = TransformerConfig(vocab_size=8, d_model=8, n_heads=2, head_dim=8, n_layers=1,
                               d_ff=8, norm="rmsnorm", norm_placement="post", final_norm=False,
                               activation="relu", max_positions=64)
    seed, shift = 1308, 5
    attn = build_model(config, seed, dtype=torch.float64).decoder.layers[0].attn
    attn = variants.get("rotary-interleaved").twin.from_reference(attn)
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, 2, 1, 8, dtype=torch.float64, generator=gen) for _ in range(2))

    def scores(at: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return attn.rotate(q.to(dtype), at) @ attn.rotate(k.to(dtype), at).transpose(-2, -1)

    with torch.no_grad():
        positions = torch.zeros(1, 1, dtype=torch.long)
        golden = scores(positions, torch.float64)
        baseline = scores(positions, torch.bfloat16)
        result = compare(scores(positions + shift, torch.bfloat16), golden, baseline)
    worst = result.worst
    assert worst.budget.baseline_error < 0.2 * 2.0**-8 * worst.budget.scale  # the lucky draw
    assert worst.error > worst.budget.baseline_error * KINDS["forward"].fudge
    assert result.ok and worst.budget.noise_source == "noise floor", result.explain()


def _matmul_problem() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(8, 256, generator=gen, dtype=torch.float64)
    return a, torch.randn(256, 16, generator=gen, dtype=torch.float64)


def test_a_baseline_worse_than_its_dtype_allows_fails_naming_the_baseline() -> None:
    a, b = _matmul_problem()
    golden, candidate = a @ b, a.float() @ b.float()
    # A lost upcast: the fp32 baseline's matmul ran in bf16, 2**16 times fp32's roundoff.
    degraded = (a.bfloat16() @ b.bfloat16()).float()
    result = compare(candidate, golden, degraded)
    # The failure is the baseline's: the candidate is judged by the analytic bound instead.
    assert not result.ok and result.baseline_degraded and result.verdict == "within"
    worst = result.worst
    assert worst.baseline_headroom > 1 and worst.budget.source == "analytic"
    assert worst.error < worst.budget.value < 0.01 * error(degraded, golden, "max_abs")
    assert result.explain().startswith("baseline degraded, a failure of the baseline")
    assert "the baseline itself errs" in result.explain()
    assert result.to_dict()["baseline_degraded"] is True
    # The bar is not lowered: a candidate that errs as the degraded baseline does diverges.
    lost = compare((a.bfloat16() @ b.bfloat16()).float() * (1 + 2**-20), golden, candidate)
    assert lost.verdict == "diverged"
    honest = compare(candidate, golden, a.float() @ b.float() + 0.0)
    assert honest.ok and honest.worst.baseline_headroom < 1


def test_every_verdict_states_the_change_it_would_have_flagged() -> None:
    a, b = _matmul_problem()
    golden, baseline = a @ b, a.float() @ b.float()
    plain = compare(baseline, golden, baseline).worst
    sensitivity, scale = plain.sensitivity, plain.budget.scale
    assert sensitivity == plain.budget.value / scale
    assert f"larger than {sensitivity:.2g} of the golden's scale" in compare(
        baseline, golden, baseline).explain()
    assert compare(baseline, golden, baseline).to_dict()["sensitivity"] == sensitivity
    index = tuple(int(i) for i in np.unravel_index(int(golden.abs().argmax()), golden.shape))
    for factor, verdict in ((1.05, "diverged"), (0.5, "within")):
        moved = baseline.clone()
        moved[index] += factor * sensitivity * scale  # a change of the largest output alone
        assert compare(moved, golden, baseline).verdict == verdict, factor


def test_rotary_frequencies_computed_in_fp16_diverge_on_the_llama3_case(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    case = zoo.get("llama3-rope")

    def logits(dtype: torch.dtype) -> torch.Tensor:
        with torch.no_grad():
            return build_model(case.config, 0, dtype=dtype)(**zoo.case_batch(case))

    golden, baseline = logits(torch.float64), logits(torch.float32)
    # theta = 500000 overflows fp16: the slowest frequencies become 0.
    monkeypatch.setattr(positions, "compute_dtype",
                        lambda dtype: torch.float64 if dtype == torch.float64 else torch.float16)
    result = compare(logits(torch.float32), golden, baseline)
    assert result.verdict == "diverged" and result.worst.headroom > 100
